"""FusedKV and FusedKV-Lite variants of the Llama family, chosen by config.json's `fusedkv`
section (models/fusedkv_math.py: FusedKVConfig; docs/fusedkv.md).

    layer   0 .. n-1   storage layers: LlamaDecoderLayer as is (q, k, v; K/V stored in the pool)
    layer   n .. L-1   reconstruction layers: q_proj + o_proj only; attention over K/V rebuilt
                       from the caches of the source layers (s0, s1) = source_layers:
                         fusedkv:  K = a0 * K_s0 + a1 * K_s1,  V = b0 * V_s0 + b1 * V_s1  (post-RoPE)
                         lite:     K = K_s1,                   V = V_s0

Prefill skips the top half: a reconstruction layer stores nothing, so in an EXTEND batch it
runs only for the rows that produce logits (`logits_positions`: each sampling request's last
token and the prompt-logprob rows). The model then returns hidden states for those rows only
(`returns_logits_rows`); an intermediate chunk of a chunked prefill has no such row and runs
no reconstruction layer at all.

    EXTEND  hidden [T, H] -> storage layers -> hidden[logits_positions] [N, H] -> top layers
    DECODE  hidden [B, H] -> every layer over all B rows (each row samples; logits rows = 0..B-1)

Fusion weights are not nn.Parameters here: the checkpoint's float32 tensors (or the config's
init, when the checkpoint has none) are kept in float32 per channel on the model's device,
since the model dtype would round them (`finish_load`).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
from torch import nn

from sgl_kvxfer.forward_batch import ForwardMode
from sgl_kvxfer.layers import fused_ops
from sgl_kvxfer.layers.layernorm import RMSNorm
from sgl_kvxfer.layers.rope import apply_rope
from sgl_kvxfer.models.arch_config import ModelArchConfig
from sgl_kvxfer.models.fusedkv_math import (FusedKVConfig, check_fusion_tensors, expand_key_weight,
                                            fusion_param_names, init_fusion_weights)
from sgl_kvxfer.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass
class KVReconstruction:
    """What a reconstruction layer hands the attention backend: its two source layers and,
    for FusedKV, the per-channel weights (float32 [2, Hkv, D]; [0] weighs s0, [1] s1).
    Lite: key_weight = value_weight = None (K from s1, V from s0)."""
    sources: tuple[int, int]
    key_weight: torch.Tensor | None = None
    value_weight: torch.Tensor | None = None
    packed: torch.Tensor | None = None  # float32 [4, Hkv, D] = (a0, a1, b0, b1): the kernels' layout

    @property
    def lite(self) -> bool:
        return self.key_weight is None


def rope_q(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """q [N, Hq, D] -> rotated, contiguous. CUDA fp16/bf16: the fused RoPE kernel with no k heads
    (one launch instead of torch's six)."""
    if fused_ops.wants_fused(q.device.type, q.dtype) and cos.dtype == q.dtype:
        from sgl_kvxfer.kernels.fused_rope import fused_rope

        return fused_rope(q, q[:, :0], cos, sin)[0]
    return apply_rope(q, cos, sin)


class ReconstructionAttention(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_id: int, fkv: FusedKVConfig):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.q_size = config.q_size
        self.q_proj = nn.Linear(config.hidden_size, self.q_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.recon = KVReconstruction(fkv.source_layers)  # weights set by finish_load

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, forward_batch) -> torch.Tensor:
        """hidden [N, hidden] (the rows that need output) -> [N, hidden]."""
        n = hidden.shape[0]
        q = rope_q(self.q_proj(hidden).view(n, self.num_heads, self.head_dim), cos, sin)
        out = forward_batch.attn_backend.forward_reconstruct(q, self.layer_id, forward_batch, self.recon)
        return self.o_proj(out.reshape(n, self.q_size))


class ReconstructionDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelArchConfig, layer_id: int, fkv: FusedKVConfig):
        nn.Module.__init__(self)  # LlamaDecoderLayer's body with a q-only attention
        self.self_attn = ReconstructionAttention(config, layer_id, fkv)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class FusedKVLlamaForCausalLM(LlamaForCausalLM):
    returns_logits_rows = True  # forward returns hidden[logits_positions] (ModelRunner.forward)

    def __init__(self, config: ModelArchConfig):
        super().__init__(config)
        self.fusedkv = FusedKVConfig.from_hf_dict(config.extra)
        if self.fusedkv is None:
            raise ValueError("FusedKVLlamaForCausalLM needs a 'fusedkv' section in config.json")
        for i in self.fusedkv.reconstruction_layers:
            self.model.layers[i] = ReconstructionDecoderLayer(config, i, self.fusedkv)
        # False runs the top half over every prompt token (the reference the tests compare with)
        self.skip_prefill_rows = True
        self._fusion_tensors: dict[str, torch.Tensor] = {}
        self._dropped_kv_rows = 0

    @property
    def num_storage_layers(self) -> int:
        return self.fusedkv.num_storage_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states of the logits rows [N, hidden]
        (EXTEND; all T rows with skip_prefill_rows off) or of every row [B, hidden] (DECODE)."""
        hidden = self.model.embed_tokens(input_ids)
        lens_cpu = getattr(forward_batch, "seq_lens_cpu", None)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype, max(lens_cpu) if lens_cpu else None)
        n = self.num_storage_layers
        residual = None
        for layer in self.model.layers[:n]:
            hidden, residual = layer(hidden, residual, cos, sin, forward_batch)
        rows = None
        if forward_batch.mode == ForwardMode.EXTEND:
            rows = forward_batch.logits_positions if self.skip_prefill_rows else None
            if rows is not None:
                if rows.numel() == 0:  # e.g. an intermediate prefill chunk: no top-half work at all
                    return hidden.new_empty((0, hidden.shape[1]))
                hidden, residual, cos, sin = hidden[rows], residual[rows], cos[rows], sin[rows]
        forward_batch.attn_backend.prepare_reconstruct(forward_batch, rows)
        for layer in self.model.layers[n:]:
            hidden, residual = layer(hidden, residual, cos, sin, forward_batch)
        hidden, _ = self.model.norm(hidden, residual)
        if forward_batch.mode == ForwardMode.EXTEND and rows is None:
            hidden = hidden[forward_batch.logits_positions]
        return hidden

    # ------------------------------------------------------------------ weights
    def _load_special(self, name, tensor, params):
        m = _LAYER.match(name)
        if m is None or self.fusedkv.is_storage(int(m.group(1))):
            return None
        if ".kv_fusion." in name:
            self._fusion_tensors[name] = tensor.detach().to(torch.float32, copy=True)
            return ""
        if ".k_proj." in name or ".v_proj." in name:
            # a vanilla checkpoint's k/v rows of a reconstruction layer: unused by construction
            self._dropped_kv_rows += tensor.shape[0]
            return ""
        if ".q_proj." in name:
            param = params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != param {tuple(param.shape)}")
            param.data.copy_(tensor)
            return name
        return None

    @torch.no_grad()
    def finish_load(self, load_format: str) -> None:
        """Set every reconstruction layer's KVReconstruction: weights from the checkpoint, or,
        when it has none (dummy weights, a vanilla checkpoint with a fusedkv section), from
        the config's init. Lite takes none."""
        cfg, a = self.fusedkv, self.config
        if self._dropped_kv_rows:
            logger.info("FusedKV: ignored k/v projection rows of the reconstruction layers (%d rows)",
                        self._dropped_kv_rows)
        tensors, self._fusion_tensors = self._fusion_tensors, {}
        if cfg.has_fusion_weights and not tensors:
            if load_format != "dummy":
                logger.warning("FusedKV: the checkpoint has no kv_fusion tensors; using init %r (seed %d)",
                               cfg.init, cfg.init_seed)
            for i, (kw, vw) in init_fusion_weights(cfg, a.num_key_value_heads, a.head_dim).items():
                kn, vn = fusion_param_names(i)
                tensors[kn], tensors[vn] = kw, vw
        check_fusion_tensors(cfg, tensors, a.num_key_value_heads, a.head_dim)
        device = self.model.embed_tokens.weight.device
        for i in cfg.reconstruction_layers:
            recon = self.model.layers[i].self_attn.recon
            if cfg.has_fusion_weights:
                kn, vn = fusion_param_names(i)
                recon.key_weight = expand_key_weight(tensors[kn]).to(device).contiguous()
                recon.value_weight = tensors[vn].to(device).contiguous()
                recon.packed = torch.cat([recon.key_weight, recon.value_weight]).contiguous()
