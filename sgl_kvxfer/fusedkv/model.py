"""Compact Llama-style LM for training and retrofit (no KV cache), in every cross-layer KV layout.

Full-sequence forward with SDPA (causal). Parameter names are HF Llama's
(`model.layers.{i}.self_attn.q_proj.weight`, ...), so a Llama checkpoint loads as is and a
converted model saves as a checkpoint the engine reads: layers that store no KV have no k_proj /
v_proj, and FusedKV ones a `self_attn.kv_fusion` (models/fusedkv_math.KVFusion).

Layouts (L layers; all but vanilla store KV for L/2 of them, so they compare at equal KV bytes):

    vanilla   every layer stores its own K, V
    fusedkv   layers n..L-1: K_i, V_i = fuse_kv(K_s0, K_s1, V_s0, V_s1, weights_i)   (paper Eq. 4-5)
    lite      layers n..L-1: K_i, V_i = K_s1, V_s0                                  (paper Eq. 6)
    yoco      layers n..L-1: K_i, V_i = K_n-1, V_n-1   (YOCO-style: one shared cache from the middle)
    cla2      odd layers:    K_i, V_i = K_i-1, V_i-1   (CLA: adjacent pairs share one cache)

fusedkv and lite are the engine's (a `fusedkv` section in config.json); yoco and cla2 exist only
here, as baselines of the from-scratch comparison (scratch.py). RoPE is the half-split rotation of
layers/rope.py (channel j pairs with j + D/2).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sgl_kvxfer.layers.rope import compute_inv_freq
from sgl_kvxfer.models.fusedkv_math import FusedKVConfig, KVFusion, init_fusion_weights

CROSS_LAYER = ("cla2", "yoco")  # training-only baselines (no engine support)
LAYOUTS = ("vanilla", "fusedkv", "lite") + CROSS_LAYER


@dataclass(frozen=True)
class LMConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    recon_intermediate_size: int | None = None  # MLP width of layers that store no KV (None: same)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 8192
    fusedkv: FusedKVConfig | None = None
    cross_layer: str | None = None  # "cla2" | "yoco" (exclusive with fusedkv)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads or self.head_dim % 2:
            raise ValueError(f"heads {self.num_heads}/{self.num_kv_heads}, head_dim {self.head_dim}: need GQA groups and an even head_dim")
        if self.fusedkv is not None and self.fusedkv.num_hidden_layers != self.num_layers:
            raise ValueError("fusedkv.num_hidden_layers != num_layers")
        if self.cross_layer is not None:
            if self.cross_layer not in CROSS_LAYER or self.fusedkv is not None:
                raise ValueError(f"cross_layer must be one of {CROSS_LAYER} and exclusive with fusedkv")
            if self.num_layers % 2:
                raise ValueError(f"{self.cross_layer} needs an even layer count, got {self.num_layers}")

    @property
    def layout(self) -> str:
        return self.cross_layer or (self.fusedkv.variant if self.fusedkv else "vanilla")

    def stores(self, layer: int) -> bool:
        if self.cross_layer == "cla2":
            return layer % 2 == 0
        if self.cross_layer == "yoco":
            return layer < self.num_layers // 2
        return self.fusedkv is None or self.fusedkv.is_storage(layer)

    def shared_source(self, layer: int) -> tuple[int, int]:
        """(layer whose K, layer whose V) a non-storing layer of a sharing layout attends over."""
        if self.cross_layer == "cla2":
            return layer - 1, layer - 1
        if self.cross_layer == "yoco":
            mid = self.num_layers // 2 - 1
            return mid, mid
        return self.fusedkv.kv_sources(layer)

    @property
    def num_storage_layers(self) -> int:
        return sum(self.stores(i) for i in range(self.num_layers))

    def intermediate_of(self, layer: int) -> int:
        if not self.stores(layer) and self.recon_intermediate_size:
            return self.recon_intermediate_size
        return self.intermediate_size

    def with_layout(self, layout: str, recon_intermediate_size: int | None = None, **fusedkv_kw) -> "LMConfig":
        """This shape in another layout (fusedkv_kw: FusedKVConfig fields for fusedkv / lite)."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        fk = FusedKVConfig(num_hidden_layers=self.num_layers, variant=layout, **fusedkv_kw) \
            if layout in ("fusedkv", "lite") else None
        return dataclasses.replace(self, fusedkv=fk, cross_layer=layout if layout in CROSS_LAYER else None,
                                   recon_intermediate_size=recon_intermediate_size)

    @classmethod
    def from_hf_dict(cls, d: dict) -> "LMConfig":
        from sgl_kvxfer.models.arch_config import ModelArchConfig

        a = ModelArchConfig.from_hf_dict(d)
        if a.rope_scaling is not None or a.attention_bias or a.mlp_bias:
            raise ValueError("the compact LM covers plain-RoPE, bias-free Llama models (e.g. SmolLM2)")
        return cls(vocab_size=a.vocab_size, hidden_size=a.hidden_size, num_layers=a.num_hidden_layers,
                   num_heads=a.num_attention_heads, num_kv_heads=a.num_key_value_heads, head_dim=a.head_dim,
                   intermediate_size=a.intermediate_size, rope_theta=a.rope_theta, rms_norm_eps=a.rms_norm_eps,
                   tie_word_embeddings=a.tie_word_embeddings, max_position_embeddings=a.max_position_embeddings,
                   fusedkv=FusedKVConfig.from_hf_dict(d))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):  # HF Llama's rounding: fp32 statistics, weight applied in x's dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D], cos/sin [T, 1, D/2] -> rotated (differentiable)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA: q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq * D]."""
    B, T = q.shape[:2]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2).reshape(B, T, -1)


class Attention(nn.Module):
    def __init__(self, c: LMConfig, layer: int):
        super().__init__()
        self.layer, self.c = layer, c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.stores = c.stores(layer)
        if self.stores:
            self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
            self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        elif c.fusedkv is not None and c.fusedkv.has_fusion_weights:
            self.kv_fusion = KVFusion(c.num_kv_heads, c.head_dim)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def query(self, x, cos, sin):
        B, T, _ = x.shape
        return rope(self.q_proj(x).view(B, T, self.c.num_heads, self.c.head_dim), cos, sin)

    def rebuilt_kv(self, kv: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """A non-storing layer's (K, V) [B, T, Hkv, D] from the storage layers' `kv`."""
        if hasattr(self, "kv_fusion"):
            s0, s1 = self.c.fusedkv.source_layers
            return self.kv_fusion(kv[s0][0], kv[s1][0], kv[s0][1], kv[s1][1])
        ks, vs = self.c.shared_source(self.layer)
        return kv[ks][0], kv[vs][1]

    def forward(self, x, cos, sin, kv: dict):
        """x [B, T, hidden]; kv {layer: (K, V) [B, T, Hkv, D] post-RoPE}: storage layers add theirs."""
        out, own = self.attend_over(x, cos, sin, None if self.stores else self.rebuilt_kv(kv))
        if own is not None:
            kv[self.layer] = own
        return out

    def attend_over(self, x, cos, sin, rebuilt: tuple | None) -> tuple[torch.Tensor, tuple | None]:
        """(attention output, this layer's own (K, V) or None) over `rebuilt` (a non-storing
        layer's K, V) or its own projections. No layer index and no dict in here: this is the unit
        compile_blocks compiles, one graph for every layer of a kind."""
        c, (B, T, _) = self.c, x.shape
        q = self.query(x, cos, sin)
        if rebuilt is None:
            k = rope(self.k_proj(x).view(B, T, c.num_kv_heads, c.head_dim), cos, sin)
            v = self.v_proj(x).view(B, T, c.num_kv_heads, c.head_dim)
            own = (k, v)
        else:
            (k, v), own = rebuilt, None
        return self.o_proj(attend(q, k, v)), own


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: LMConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, layer)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_of(layer))

    def forward(self, x, cos, sin, kv):
        return self.feed_forward(x, self.self_attn(self.input_layernorm(x), cos, sin, kv))

    def feed_forward(self, x, attn_out):
        """The residual add of the attention output, then the MLP's residual branch."""
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))


class LM(nn.Module):
    def __init__(self, c: LMConfig):
        super().__init__()
        self.config = c
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.model.layers = nn.ModuleList(Block(c, i) for i in range(c.num_layers))
        self.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        inv_freq, self.attn_scaling = compute_inv_freq(c.head_dim, c.rope_theta, None, c.max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotary(self, T: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D/2] in the autocast dtype when autocast is on."""
        freqs = torch.arange(T, device=device, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        if torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
        return ((freqs.cos() * self.attn_scaling).to(dtype)[:, None, :],
                (freqs.sin() * self.attn_scaling).to(dtype)[:, None, :])

    def forward(self, ids: torch.Tensor, return_kv: bool = False, hidden_out: list | None = None):
        """ids [B, T] -> logits [B, T, V] (and {layer: (K, V)} of the storage layers).
        hidden_out: a list that receives each layer's output (the residual stream) [B, T, hidden]."""
        x = self.model.embed_tokens(ids)
        cos, sin = self.rotary(ids.shape[1], ids.device, x.dtype)
        kv: dict = {}
        for block in self.model.layers:
            x = block(x, cos, sin, kv)
            if hidden_out is not None:
                hidden_out.append(x)
        x = self.model.norm(x)
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, w)
        return (logits, kv) if return_kv else logits

    # ---- init and bookkeeping ----------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """From-scratch init: N(0, std) matrices and embedding, residual outputs (o_proj,
        down_proj) scaled by 1/sqrt(2L), norms 1, fusion weights per fusedkv.init."""
        g = torch.Generator().manual_seed(seed)
        c = self.config
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif ".kv_fusion." not in name:
                s = std / math.sqrt(2 * c.num_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=g) * s)
        if c.fusedkv is not None:
            for layer, (kp, vw) in init_fusion_weights(c.fusedkv, c.num_kv_heads, c.head_dim).items():
                fusion = self.model.layers[layer].self_attn.kv_fusion
                fusion.key_pair_weight.copy_(kp)
                fusion.value_weight.copy_(vw)

    def param_counts(self) -> dict:
        total = sum(p.numel() for p in self.parameters())
        emb = self.model.embed_tokens.weight.numel() + (0 if self.lm_head is None else self.lm_head.weight.numel())
        fusion = sum(p.numel() for n, p in self.named_parameters() if ".kv_fusion." in n)
        kv_proj = sum(p.numel() for n, p in self.named_parameters() if n.endswith(("k_proj.weight", "v_proj.weight")))
        return {"total": total, "embedding": emb, "non_embedding": total - emb, "fusion": fusion, "kv_proj": kv_proj}

    def kv_bytes_per_token(self, elem_bytes: int = 2) -> int:
        c = self.config
        return c.num_storage_layers * 2 * c.num_kv_heads * c.head_dim * elem_bytes


def compile_blocks(lm: LM) -> None:
    """torch.compile every block's dict-free units in place: the input norm, the attention's
    attend_over and the feed-forward (norm, MLP, both residual adds); the embedding, the head and
    the kv dict's bookkeeping stay eager. The units hold no layer index, so all layers of a kind
    (storing / rebuilding) share a graph per grad mode and shape: a few graphs for the whole model,
    inside dynamo's recompile limit whatever the depth. Parameter names and the state dict are
    unchanged (nn.Module.compile and instance attributes)."""
    for block in lm.model.layers:
        block.input_layernorm.compile()
        block.self_attn.attend_over = torch.compile(block.self_attn.attend_over)
        block.feed_forward = torch.compile(block.feed_forward)


def matched_recon_intermediate(c: LMConfig, layout: str) -> int | None:
    """MLP width of the layers that store no KV that gives a sharing layout the vanilla model's
    parameter count: each such layer drops k_proj + v_proj (2 * hidden * Hkv * D) and FusedKV's
    adds 3 * Hkv * D fusion weights; each MLP unit is 3 * hidden parameters. Rounded to the nearest."""
    if layout == "vanilla":
        return None
    kvd = c.num_kv_heads * c.head_dim
    removed = 2 * c.hidden_size * kvd - (3 * kvd if layout == "fusedkv" else 0)
    return c.intermediate_size + round(removed / (3 * c.hidden_size))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


@torch.no_grad()
def greedy(model: LM, ids: list[int], max_new: int, eos: tuple[int, ...] = ()) -> list[int]:
    """Greedy continuation (full forward per token: no KV cache here)."""
    dev = next(model.parameters()).device
    out = list(ids)
    for _ in range(max_new):
        nxt = int(model(torch.tensor([out], device=dev))[0, -1].argmax())
        out.append(nxt)
        if nxt in eos:
            break
    return out[len(ids):]
