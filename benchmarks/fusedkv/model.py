"""Compact Llama-style LM (vanilla, FusedKV, FusedKV-Lite) for training and retrofit, no KV cache.

Full-sequence forward with SDPA (causal). Parameter names are HF Llama's
(`model.layers.{i}.self_attn.q_proj.weight`, ...), so SmolLM2's checkpoint loads as is and a
converted model saves as a checkpoint the engine reads: reconstruction layers have no k_proj /
v_proj, and FusedKV ones a `self_attn.kv_fusion` (fusedkv_math.KVFusion). Within one forward:

    storage layer l:         K_l, V_l = RoPE(k_proj(x)), v_proj(x)      (kept for the sources)
    reconstruction layer i:  FusedKV  K_i, V_i = fuse_kv(K_s0, K_s1, V_s0, V_s1, weights_i)
                             Lite     K_i, V_i = K_s1, V_s0

RoPE is the half-split rotation of layers/rope.py (channel j pairs with j + D/2).
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


@dataclass(frozen=True)
class LMConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    recon_intermediate_size: int | None = None  # MLP width of reconstruction layers (None: same)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 8192
    fusedkv: FusedKVConfig | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads or self.head_dim % 2:
            raise ValueError(f"heads {self.num_heads}/{self.num_kv_heads}, head_dim {self.head_dim}: need GQA groups and an even head_dim")
        if self.fusedkv is not None and self.fusedkv.num_hidden_layers != self.num_layers:
            raise ValueError("fusedkv.num_hidden_layers != num_layers")

    def intermediate_of(self, layer: int) -> int:
        recon = self.fusedkv is not None and not self.fusedkv.is_storage(layer)
        return self.recon_intermediate_size if recon and self.recon_intermediate_size else self.intermediate_size

    def with_fusedkv(self, fusedkv: FusedKVConfig | None, recon_intermediate_size: int | None = None) -> "LMConfig":
        return dataclasses.replace(self, fusedkv=fusedkv, recon_intermediate_size=recon_intermediate_size)

    @classmethod
    def from_hf_dict(cls, d: dict) -> "LMConfig":
        from sgl_kvxfer.models.arch_config import ModelArchConfig

        a = ModelArchConfig.from_hf_dict(d)
        if a.rope_scaling is not None or a.attention_bias or a.mlp_bias:
            raise ValueError("the compact LM covers plain-RoPE, bias-free Llama models (SmolLM2)")
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


class Attention(nn.Module):
    def __init__(self, c: LMConfig, layer: int):
        super().__init__()
        self.layer, self.c = layer, c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.stores = c.fusedkv is None or c.fusedkv.is_storage(layer)
        if self.stores:
            self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
            self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        elif c.fusedkv.has_fusion_weights:
            self.kv_fusion = KVFusion(c.num_kv_heads, c.head_dim)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, kv: dict):
        """x [B, T, hidden]; kv {layer: (K, V) [B, T, Hkv, D] post-RoPE}: storage layers add theirs."""
        c, (B, T, _) = self.c, x.shape
        q = rope(self.q_proj(x).view(B, T, c.num_heads, c.head_dim), cos, sin)
        if self.stores:
            k = rope(self.k_proj(x).view(B, T, c.num_kv_heads, c.head_dim), cos, sin)
            v = self.v_proj(x).view(B, T, c.num_kv_heads, c.head_dim)
            kv[self.layer] = (k, v)
        else:
            s0, s1 = c.fusedkv.source_layers
            if c.fusedkv.has_fusion_weights:
                k, v = self.kv_fusion(kv[s0][0], kv[s1][0], kv[s0][1], kv[s1][1])
            else:
                k, v = kv[s1][0], kv[s0][1]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=c.num_heads != c.num_kv_heads)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


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
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv)
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

    def forward(self, ids: torch.Tensor, return_kv: bool = False):
        """ids [B, T] -> logits [B, T, V] (and {layer: (K, V)} of the storage layers)."""
        T = ids.shape[1]
        freqs = torch.arange(T, device=ids.device, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        x = self.model.embed_tokens(ids)
        cos = (freqs.cos() * self.attn_scaling).to(x.dtype)[:, None, :]
        sin = (freqs.sin() * self.attn_scaling).to(x.dtype)[:, None, :]
        if torch.is_autocast_enabled(x.device.type):
            dt = torch.get_autocast_dtype(x.device.type)
            cos, sin = cos.to(dt), sin.to(dt)
        kv: dict = {}
        for block in self.model.layers:
            x = block(x, cos, sin, kv)
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
        n = c.num_layers if c.fusedkv is None else c.fusedkv.num_storage_layers
        return n * 2 * c.num_kv_heads * c.head_dim * elem_bytes


def matched_recon_intermediate(c: LMConfig, fusedkv: FusedKVConfig) -> int:
    """MLP width of the reconstruction layers that gives a FusedKV / Lite model the vanilla
    model's parameter count: each drops k_proj + v_proj (2 * hidden * Hkv * D) and FusedKV adds
    3 * Hkv * D fusion weights; each MLP unit is 3 * hidden parameters. Rounded to the nearest."""
    kvd = c.num_kv_heads * c.head_dim
    removed = 2 * c.hidden_size * kvd - (3 * kvd if fusedkv.has_fusion_weights else 0)
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


# ---- LoRA ---------------------------------------------------------------------------------------
class LoRALinear(nn.Module):
    """base(x) + scale * B(A(x)); base frozen, B zero-initialized (starts as the base)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base, self.scale = base, alpha / rank
        base.weight.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype)) * self.scale


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def apply_lora(model: nn.Module, rank: int, alpha: float, targets=LORA_TARGETS) -> list[str]:
    """Wrap every nn.Linear named in `targets` (by attribute name); returns their module paths."""
    wrapped = []
    for name, module in list(model.named_modules()):
        for attr in targets:
            child = getattr(module, attr, None)
            if isinstance(child, nn.Linear):
                setattr(module, attr, LoRALinear(child, rank, alpha))
                wrapped.append(f"{name}.{attr}" if name else attr)
    return wrapped


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """{'<module path>.lora_A' / '.lora_B': tensor} of every LoRALinear."""
    return {f"{n}.{p}": getattr(m, p).detach() for n, m in model.named_modules()
            if isinstance(m, LoRALinear) for p in ("lora_A", "lora_B")}


def merge_lora_into(tensors: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scale: float) -> None:
    """W += scale * B @ A for each adapted '<path>.weight' of an HF-named state dict (in place,
    in fp32, back to W's dtype)."""
    for key in [k for k in adapter if k.endswith(".lora_A")]:
        path = key[: -len(".lora_A")]
        w = tensors[path + ".weight"]
        delta = adapter[path + ".lora_B"].float() @ adapter[key].float()
        tensors[path + ".weight"] = (w.float() + scale * delta).to(w.dtype)


def unwrap_lora(model: nn.Module) -> None:
    """Merge every LoRALinear back into a plain nn.Linear (HF names again)."""
    for name, module in list(model.named_modules()):
        for attr, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                with torch.no_grad():
                    child.base.weight += child.scale * (child.lora_B.float() @ child.lora_A.float()).to(child.base.weight.dtype)
                setattr(module, attr, child.base)
