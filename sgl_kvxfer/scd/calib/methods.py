"""Consumer prefix caches built from a producer prefill, one function per method.

Every builder returns a KVCache [B, P, H, D] for the consumer (the prompt minus its last token),
from the producer's prefill of the same tokens (`ProducerState`):

    raw_cache         the producer's K/V as is
    quant_cache       the producer's K/V through our int8 / int4 tier codec (kernels/tier_codec.py)
    scd_cache         Reuse layers decoded from codes, patch layers aligned + regenerated with the
                      consumer's own W_k / W_v (Reuse-only: artifacts with no patch layers); with
                      patch_kv, the patch layers are taken from that cache instead (the harness's
                      scd-oracle-patch diagnostic: the consumer's own K/V, aligners as if perfect)
    droidspeak_cache  raw producer K/V except the recomputed layers: each contiguous run [a, b]
                      of them is recomputed by the consumer's own layers a..b, started from the
                      producer's residual stream entering layer a (what DroidSpeak sends)
    with_layers       any cache with some layers replaced (e.g. restored to the oracle's)

Codes pass through the wire dtype exactly as in serving (ScdEncoder -> ScdDecoder).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvxfer.scd.codec import ScdDecoder, ScdEncoder, regenerate_kv
from sgl_kvxfer.scd.calib.forward import KVCache, LlamaRunner, Taps


@dataclass
class ProducerState:
    cache: KVCache  # the producer's own prefix K/V
    taps: Taps  # h (input_layernorm outputs) and resid (streams entering layers) as requested
    positions: torch.Tensor  # [B, P]
    valid: torch.Tensor  # [B, P]


def producer_state(runner: LlamaRunner, ids, positions, valid, h_layers=(), resid_layers=()) -> ProducerState:
    cache, taps = runner.prefill_cache(ids, positions, valid, h_layers=h_layers, resid_layers=resid_layers)
    return ProducerState(cache, taps, positions, valid)


def raw_cache(state: ProducerState) -> KVCache:
    return state.cache


def quant_cache(state: ProducerState, bits: int = 4, group_size: int = 32) -> KVCache:
    from sgl_kvxfer.kernels.tier_codec import dequantize, quantize

    def qd(x):
        g = min(group_size, x.shape[-1])
        q, scale, zero = quantize(x, bits, g)
        return dequantize(q, scale, zero, bits, g, out_dtype=x.dtype)

    return KVCache([qd(k) for k in state.cache.k], [qd(v) for v in state.cache.v], state.cache.valid)


def int4_cache(state: ProducerState, group_size: int = 32) -> KVCache:
    return quant_cache(state, 4, group_size)


def scd_cache(state: ProducerState, enc: ScdEncoder, dec: ScdDecoder, proj, dtype: torch.dtype,
              level: tuple[int, int] | None = None, patch_kv: KVCache | None = None) -> KVCache:
    """proj: the consumer's per-layer KVProjection list (codec.kv_projections); level: the
    nested (r_k, r_v) the codes are sent at (default the top); patch_kv: a cache of the same
    prefix whose patch layers replace the aligned + regenerated ones."""
    m = enc.manifest
    b, p = state.positions.shape
    pos = state.positions.reshape(-1)
    ks, vs = [], []
    for layer in range(m.num_layers):
        if layer in m.patch_layers and patch_kv is not None:
            ks.append(patch_kv.k[layer])
            vs.append(patch_kv.v[layer])
            continue
        if layer in m.patch_layers:
            h = state.taps.h[layer].reshape(b * p, -1)
            k, v = regenerate_kv(dec.align_patch(layer, enc.encode_patch(layer, h)), proj[layer], pos,
                                 dec.rotary, dtype)
        else:
            k0, v0 = state.cache.k[layer], state.cache.v[layer]
            zk, zv = enc.encode_reuse(layer, k0.reshape(b * p, *k0.shape[2:]), v0.reshape(b * p, *v0.shape[2:]), pos,
                                      level)
            k, v = dec.decode_reuse(layer, zk, zv, pos, dtype)
        ks.append(k.view(b, p, *k.shape[1:]))
        vs.append(v.view(b, p, *v.shape[1:]))
    return KVCache(ks, vs, state.valid)


def layer_runs(layers) -> list[tuple[int, int]]:
    """Sorted layer ids -> contiguous runs [(a, b_exclusive), ...]."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and runs[-1][1] == layer:
            runs[-1][1] = layer + 1
        else:
            runs.append([layer, layer + 1])
    return [(a, b) for a, b in runs]


def droidspeak_cache(state: ProducerState, consumer: LlamaRunner, layers) -> KVCache:
    """Needs state.taps.resid for the first layer of every run (producer_state(resid_layers=...))."""
    ks, vs = list(state.cache.k), list(state.cache.v)
    for a, b in layer_runs(layers):
        _, k, v = consumer.forward(None, state.positions, state.valid, start=a, end=b,
                                   hidden_in=state.taps.resid[a], return_kv=True)
        ks[a:b], vs[a:b] = k, v
    return KVCache(ks, vs, state.valid)


def with_layers(cache: KVCache, other: KVCache, layers) -> KVCache:
    """`cache` with `layers` taken from `other`."""
    ks = [other.k[i] if i in layers else k for i, k in enumerate(cache.k)]
    vs = [other.v[i] if i in layers else v for i, v in enumerate(cache.v)]
    return KVCache(ks, vs, cache.valid)


def continuation_logprob(runner: LlamaRunner, cache: KVCache, ids: torch.Tensor, start_pos: torch.Tensor):
    """Teacher-forced continuation over a prefix cache. ids [B, C] are the tokens after the cached
    prefix (ids[:, 0] is the prompt token the cache lacks), start_pos [B] its positions. Returns
    (log-probs [B, C-1, V] float32 predicting ids[:, 1:], targets [B, C-1])."""
    b, c = ids.shape
    pos = start_pos.view(b, 1) + torch.arange(c, device=ids.device)[None, :]
    valid = torch.ones(b, c, dtype=torch.bool, device=ids.device)
    logits = runner.forward(ids, pos, valid, past=cache, logits="all").logits
    return torch.log_softmax(logits[:, :-1].float(), -1), ids[:, 1:]
