"""Tiny FusedKV checkpoints, an engine-independent reference forward, and a hand-built EXTEND
batch, shared by the FusedKV engine tests."""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from sgl_kvxfer.forward_batch import ForwardBatch, ForwardMode
from sgl_kvxfer.models.fusedkv_math import FusedKVConfig, expand_key_weight, fuse_kv, fusion_param_names

from tiny_models import tiny_llama

TINY = tiny_llama(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, head_dim=16,
                  torch_dtype="float32")


def write_model(out_dir: str, variant: str | None, seed: int = 0, base: dict = TINY, **section) -> str:
    """config.json (+ a fusedkv section unless variant is None), a dummy tokenizer and a
    safetensors checkpoint with HF names: random weights, fusion tensors for FusedKV, and the
    k/v projections of every layer (a vanilla checkpoint's rows the FusedKV model must ignore)."""
    from safetensors.torch import save_file

    from sgl_kvxfer.models.presets import write_dummy_tokenizer

    cfg = dict(base)
    if variant is not None:
        cfg["fusedkv"] = {"variant": variant, **section}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    write_dummy_tokenizer(out_dir, cfg["vocab_size"])
    save_file(random_tensors(cfg, seed), os.path.join(out_dir, "model.safetensors"))
    return out_dir


def random_tensors(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    Hq, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def w(*shape, std=0.08):
        return torch.randn(shape, generator=g) * std

    t = {"model.embed_tokens.weight": w(V, H, std=1.0), "model.norm.weight": 1 + w(H), "lm_head.weight": w(V, H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": w(Hq * D, H), p + "self_attn.k_proj.weight": w(Hkv * D, H),
                  p + "self_attn.v_proj.weight": w(Hkv * D, H), p + "self_attn.o_proj.weight": w(H, Hq * D),
                  p + "mlp.gate_proj.weight": w(I, H), p + "mlp.up_proj.weight": w(I, H),
                  p + "mlp.down_proj.weight": w(H, I), p + "input_layernorm.weight": 1 + w(H),
                  p + "post_attention_layernorm.weight": 1 + w(H)})
    fkv = FusedKVConfig.from_hf_dict(cfg)
    if fkv is not None and fkv.has_fusion_weights:
        for i in fkv.reconstruction_layers:
            kn, vn = fusion_param_names(i)
            t[kn], t[vn] = 1 + w(2, Hkv, D // 2, std=0.5), 1 + w(2, Hkv, D, std=0.5)
    return t


def _rmsnorm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    a, b = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


@torch.no_grad()
def reference_logits(cfg: dict, t: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Full-sequence causal forward of the (FusedKV / Lite / vanilla) model from its checkpoint
    tensors, fp32, no cache: logits [T, vocab]. Reconstruction layers use no k/v projection."""
    fkv = FusedKVConfig.from_hf_dict(cfg)
    Hq, Hkv, D, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    T = len(ids)
    pos = torch.arange(T)
    x = t["model.embed_tokens.weight"][torch.tensor(ids)]
    kv = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rmsnorm(x, t[p + "input_layernorm.weight"], eps)
        q = _rope((h @ t[p + "self_attn.q_proj.weight"].T).view(T, Hq, D), pos, cfg["rope_theta"])
        if fkv is None or fkv.is_storage(i):
            k = _rope((h @ t[p + "self_attn.k_proj.weight"].T).view(T, Hkv, D), pos, cfg["rope_theta"])
            v = (h @ t[p + "self_attn.v_proj.weight"].T).view(T, Hkv, D)
            kv[i] = k, v
        else:
            (k0, v0), (k1, v1) = kv[fkv.source_layers[0]], kv[fkv.source_layers[1]]
            if fkv.variant == "lite":
                k, v = k1, v0
            else:
                kn, vn = fusion_param_names(i)
                k, v = fuse_kv(k0, k1, v0, v1, expand_key_weight(t[kn]), t[vn])
        g = Hq // Hkv
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(g, 1).transpose(0, 1),
                                           v.repeat_interleave(g, 1).transpose(0, 1), is_causal=True)
        x = x + o.transpose(0, 1).reshape(T, Hq * D) @ t[p + "self_attn.o_proj.weight"].T
        h = _rmsnorm(x, t[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T
    return _rmsnorm(x, t["model.norm.weight"], eps) @ t["lm_head.weight"].T


def extend_batch(runner, runs, spans: bool = True) -> ForwardBatch:
    """A hand-built EXTEND batch. runs: [(row, ids, start, end, logits)]: compute ids[start:end]
    over the prefix [0, start) already in row `row`; logits: n (the last n tokens) or
    (first position, count). spans=False leaves ForwardBatch.logits_spans unset."""
    dev = runner.device
    ids, pos, locs, logits, span_list = [], [], [], [], []
    for row, seq, start, end, want in runs:
        first, count = (end - want, want) if isinstance(want, int) else want
        slots = runner.allocator.alloc(end - start)
        runner.req_to_token.write(row, start, slots)
        logits += range(len(ids) + first - start, len(ids) + first - start + count)
        ids += seq[start:end]
        pos += range(start, end)
        locs.append(slots)
        span_list.append((first, count))
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)  # noqa: E731
    return ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=t(ids), positions=t(pos), out_cache_loc=torch.cat(locs),
        req_pool_indices=t([r[0] for r in runs]), seq_lens=t([r[3] for r in runs]),
        extend_prefix_lens=[r[2] for r in runs], extend_seq_lens=[r[3] - r[2] for r in runs],
        seq_lens_cpu=[r[3] for r in runs], logits_positions=t(logits), req_to_token=runner.req_to_token.table,
        logits_spans=span_list if spans else None)
