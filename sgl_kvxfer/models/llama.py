"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over a flattened ragged batch.

Every tensor here is token-major: T = total tokens of all requests in the batch,
concatenated. Attention across requests is the backend's job (it knows the
per-request extents from `forward_batch`); the model itself is position-wise
except inside `attn_backend.forward_qkv` (RoPE, KV store, attention).

Fused parameters (one matmul each): qkv_proj = [q | k | v] rows and
gate_up_proj = [gate | up] rows. `load_weights` accepts HF's unfused names.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from sgl_kvxfer.layers import fused_ops
from sgl_kvxfer.layers.layernorm import RMSNorm
from sgl_kvxfer.layers.rope import RotaryEmbedding
from sgl_kvxfer.models.arch_config import ModelArchConfig


CPU_MLP_BLOCK = 2048  # rows per MLP block on CPU (LlamaMLP.forward)
# forward_batch.extras key of a callable(layer_id, normed hidden [T, hidden]) run on each layer's
# input_layernorm output (the SCD producer's Patch signal). Absent: nothing runs; present, the
# graph runners step aside (they replay only batches without extras).
HIDDEN_CAPTURE = "hidden_capture"


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.scaling = config.head_dim**-0.5  # softmax scale the backend must use
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, forward_batch) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]. q/k are rotated before the backend sees them."""
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        #   qkv columns: [0, q_size) q | [q_size, q_size+kv_size) k | [.., +kv_size) v
        out = forward_batch.attn_backend.forward_qkv(qkv, cos, sin, self.layer_id, forward_batch)
        return self.o_proj(out.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelArchConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] (SwiGLU). Row-wise, so on CPU a long prefill runs in
        blocks of CPU_MLP_BLOCK rows: the [T, 2I] intermediate then stays in cache (a 16k-token
        block made the bf16 MLP ~1.9x slower, bound by writing and re-reading it)."""
        if x.device.type == "cpu" and x.shape[0] > CPU_MLP_BLOCK:
            return torch.cat([self._mlp(x[i : i + CPU_MLP_BLOCK]) for i in range(0, x.shape[0], CPU_MLP_BLOCK)])
        return self._mlp(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused_ops.silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_id: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, cos, sin, forward_batch, capture=None):
        """Pre-norm block. Returns (mlp_out, residual); the caller adds them at the next norm.
        `capture(layer_id, normed [T, hidden])` sees the attention input (HIDDEN_CAPTURE)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if capture is not None:
            capture(self.self_attn.layer_id, hidden)
        hidden = self.self_attn(hidden, cos, sin, forward_batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelArchConfig):
        super().__init__()
        # _weight: no reset_parameters. Its normal_ under create_model's meta device imports
        # torch._dynamo (about 2.5 s of CPU in every process that builds a model)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# HF checkpoint name fragment -> (fused param fragment, shard key)
_STACKED = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)


class LlamaForCausalLM(nn.Module):
    """Parameter names mirror HF (`model.layers.N...`, `lm_head.weight`) except the fused
    qkv_proj / gate_up_proj. With tied embeddings there is no lm_head module."""

    def __init__(self, config: ModelArchConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch) -> torch.Tensor:
        """input_ids, positions LongTensor[T] -> final-normed hidden states [T, hidden]."""
        hidden = self.model.embed_tokens(input_ids)
        # Every position < its request's seq_len: a host-side bound, so no device sync.
        lens_cpu = getattr(forward_batch, "seq_lens_cpu", None)
        bound = max(lens_cpu) if lens_cpu else None
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype, bound)  # shared by all layers
        residual = None
        extras = getattr(forward_batch, "extras", None)
        capture = extras.get(HIDDEN_CAPTURE) if extras else None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, cos, sin, forward_batch, capture)
        if residual is None:  # zero layers
            return self.model.norm(hidden)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        packed = getattr(self, "packed_lm_head", None)  # layers/cpu_linear.py (CPU bf16)
        if packed is not None:
            from sgl_kvxfer.kernels import cpu_ops
            from sgl_kvxfer.layers.cpu_linear import packed_linear

            logits = packed_linear(hidden, packed)
            if not cpu_ops.enabled():
                return logits.float()
            # NOTE: a reused buffer (no page faults per step): the caller consumes the logits
            # before the next forward, as it must for CUDA-graph replays too
            buf = getattr(self, "_logits_buf_cpu", None)
            if buf is None or buf.shape != logits.shape:
                buf = self._logits_buf_cpu = torch.empty(logits.shape, dtype=torch.float32)
            return cpu_ops.bf16_to_f32(logits, buf)
        return F.linear(hidden, self.lm_head_weight).float()

    def _shard_slice(self, shard) -> slice:
        c = self.config
        if shard == "q":
            return slice(0, c.q_size)
        if shard == "k":
            return slice(c.q_size, c.q_size + c.kv_size)
        if shard == "v":
            return slice(c.q_size + c.kv_size, c.q_size + 2 * c.kv_size)
        i = c.intermediate_size
        return slice(shard * i, (shard + 1) * i)

    def _load_special(self, name: str, tensor: torch.Tensor, params: dict) -> str | None:
        """Variant hook: load one checkpoint tensor the usual mapping does not cover. Returns the
        parameter written, "" for a tensor taken without a parameter, None to map it as usual."""
        return None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into (possibly fused) params. Returns loaded param names;
        raises KeyError on unknown names and ValueError if a parameter was never written."""
        params = dict(self.named_parameters())
        expected = {n: (p.shape[0] if p.dim() else 1) for n, p in params.items()}
        written: dict[str, int] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            special = self._load_special(name, tensor, params)
            if special is not None:  # a variant's own tensor (models/fusedkv_llama.py)
                if special:
                    written[special] = expected[special]
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: head is the embedding
            for fused, part, shard in _STACKED:
                if part in name:
                    target = name.replace(part, fused)
                    sl = self._shard_slice(shard)
                    param = params[target]
                    if tensor.shape[0] != sl.stop - sl.start:
                        raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not fit {target}[{sl}]")
                    param.data[sl].copy_(tensor)
                    written[target] = written.get(target, 0) + tensor.shape[0]
                    break
            else:
                if name not in params:
                    raise KeyError(f"Unexpected weight {name!r} for {type(self).__name__}")
                param = params[name]
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != param {tuple(param.shape)}")
                param.data.copy_(tensor)
                written[name] = expected[name]
        missing = sorted(n for n, rows in expected.items() if written.get(n, 0) < rows)
        if missing:
            raise ValueError(f"Weights missing from checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        return set(written)
