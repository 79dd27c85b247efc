"""Decode query taps of SpectrumKV's cold tier (scheduler/cold_tier.py): which layers' decode
queries are scored, and the buffers their forward copies q into.

    backend.query_taps = {layer: [max_running_requests, Hq, D] buffer}   (layers/attention/base.py)

NOTE: the copy into a tap is part of every captured CUDA graph, so the taps are installed when
the runner is built, before its graphs are captured (ModelRunner), with the layers chosen from the
flags: the `--kv-promote-layers` most int4-sensitive layers of `--kv-layer-profile` when one is
given, else that many spread evenly through the model. They are not changed afterwards.
"""
from __future__ import annotations

import torch


def probe_layers(num_layers: int, count: int, ranking: list[int] | None = None) -> list[int]:
    """Layers whose decode queries are scored: the first `count` of `ranking` (most sensitive
    first, from a layer profile) or `count` layers spread evenly through the middle of the model."""
    if count >= num_layers:
        return list(range(num_layers))
    if ranking:
        return sorted(ranking[:count])
    return sorted({min(num_layers - 1, round((i + 1) * num_layers / (count + 1))) for i in range(count)})


def start_up_probe_layers(config, num_layers: int) -> list[int]:
    """The probe layers an EngineConfig asks for (module docstring)."""
    ranking = None
    if config.kv_layer_profile:
        from sgl_kvxfer.spectrum.layer_budget import LayerProfile

        gains = LayerProfile.load(config.kv_layer_profile).gain_up
        ranking = sorted(range(len(gains)), key=lambda layer: -gains[layer])
    return probe_layers(num_layers, config.kv_promote_layers, ranking)


def install_query_taps(backend, layers: list[int], max_rows: int, dtype: torch.dtype, device) -> dict:
    """Give `backend` one zeroed tap per layer of `layers`; returns them."""
    backend.query_taps = {layer: torch.zeros((max_rows, backend.num_q_heads, backend.head_dim), dtype=dtype,
                                             device=device) for layer in sorted(layers)}
    return backend.query_taps
