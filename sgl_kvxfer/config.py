"""Frozen configuration chain that mirrors process nesting.

    ServerArgs          (HTTP server, tokenizer manager, launcher)
      └─ SchedulerConfig    (scheduler process: batching, radix cache)
           └─ EngineConfig      (model runner: weights, KV pool, attention)

Each component receives only its own level. Flat keyword arguments (as `Engine(**kw)` and the
CLI use) are routed to their level by field name in `ServerArgs.from_flat`. Argparse defaults
come from these dataclasses (`add_cli_args`). Derived values are properties.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

# an SCD nested rank level as the flags name it: R_K:R_V, each 1-99999
_SCD_LEVEL = re.compile(r"[1-9][0-9]{0,4}:[1-9][0-9]{0,4}")

DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")
LOAD_FORMAT_CHOICES = ("auto", "safetensors", "gguf", "dummy")
KV_INT4_CHOICES = ("auto", "on", "off")
KV_IMPORTANCE_CHOICES = ("attn", "attn-max", "norm")
KV_BUDGET_UNIT_CHOICES = ("bytes", "cost")
KV_TRANSFER_STREAM_CHOICES = ("auto", "end", "int8", "chunk", "chunk-upgrade")
AUTO_INT8_STREAM_MIN_BUDGET = 0.5  # --kv-transfer-stream auto: int8 stream on a GPU at budgets >= this


CPU_DEFAULT_PAGE_SIZE = 16
# --chunked-prefill-size auto, SGLang's rule by device memory (GiB below which each size applies;
# above the last: 16384); on the CPU 2048
AUTO_CHUNK_BY_GPU_GIB = ((35, 2048), (60, 4096), (160, 8192))
CLI_HELP = {
    "kv_transfer_last_chunk": "PD prefill, --kv-transfer-stream chunk / chunk-upgrade at --kv-tier-budget < 1: "
                              "the prompt's last N tokens are a chunk of their own, so little KV is left to "
                              "send when the prompt ends (0: off; else 32 .. 1048576; default 512)",
    "kv_transfer_stream_chunk": "PD prefill: while its KV crosses a link slower than NVLink (RDMA, TCP, or a paced "
                                "link), prompt chunks are at most N tokens, so each chunk's KV leaves while the next "
                                "computes (0: off; else 32 .. 1048576; default 2048)",
    "chunked_prefill_size": "the most tokens per prefill chunk; -1: no chunking (default: by device memory as "
                            "SGLang does: 8192 on a GPU of 60-160 GiB such as an H100 or H200, 2048 on the CPU)",
    "kv_quant_group_size": "SpectrumKV int8/int4 quantization group (channels per scale/zero pair); "
                           "0 (default) = head_dim, one pair per token and kv head",
    "kv_tier_page_size": "SpectrumKV: tokens per page of the int8/int4 stores (power of two >= 16, "
                         "default 64; the decode kernel reads 256 tokens a step, several pages or part of one)"
                         "; the fp16 store stays slot-granular",
    "served_model_name": "the model name /v1/models and /get_model_info report (default: --model-path as "
                         "given, or smollm2-135m for the embedded default)",
    "merge_lora": "a peft LoRA adapter dir merged into the model weights at load (base + adapter)",
    "scd_rank": "SCD prefill: the codes' nested rank level: top (default), R_K:R_V, or auto (per request "
                "from the link rate; sgl_kvxfer/scd/rank_policy.py)",
    "scd_wire_frac": "SCD prefill, --scd-rank auto: the highest level whose codes cross the link within this "
                     "fraction of the prefill's own time (default 0.25)",
    "scd_min_rank": "SCD prefill, --scd-rank auto: never send a level below this R_K:R_V (a level of the "
                    "artifacts), or auto: below the lowest level whose calibrated agreement with the consumer's "
                    "own prefill is within one point of the top level's (default: the lowest level may go)",
    "kv_claim_timeout": "PD prefill: seconds from a request's arrival within which a decode must register for "
                        "its room, else the room ends naming the decode (default 5; at most --kv-transfer-timeout)",
    "shutdown_grace_period_secs": "on SIGTERM / Ctrl-C: seconds in-flight requests may run on before they end "
                                  "with a 503 (default 20); new requests get 503 at once; a second signal stops",
}


def auto_chunk_size(gpu_gib: float | None) -> int:
    """--chunked-prefill-size when unset: SGLang's size for a GPU of this much memory (GiB), 2048
    on the CPU (None)."""
    if gpu_gib is None:
        return 2048
    for below, size in AUTO_CHUNK_BY_GPU_GIB:
        if gpu_gib < below:
            return size
    return 16384


@functools.cache
def _gpu_memory_gib(index: int) -> float:
    import torch

    return torch.cuda.get_device_properties(min(index, torch.cuda.device_count() - 1)).total_memory / (1 << 30)


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None  # None or "smollm2-135m": the embedded default
    tokenizer_path: str | None = None
    dtype: str = "auto"
    device: str = "auto"  # "cpu", "cuda", or auto
    base_gpu_id: int = 0  # SGLang's: the GPU this server runs on (a PD pair on one host: 0 and 1)
    load_format: str = "auto"
    context_length: int | None = None
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    attention_backend: str | None = None  # None: triton on GPU; on CPU torch (fp32) or cpu (bf16)
    random_seed: int = 42
    page_size: int = 1
    # Decode steps replayed from CUDA graphs (engine/cuda_graph_runner.py): CUDA with the triton
    # attention backend only. cuda_graph_max_bs None: min(max_running_requests, 256).
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    # Prefill (extend) forwards replayed from CUDA graphs, one per token bucket
    # (engine/prefill_graph_runner.py). Off by default: it pays where prefill steps are bound by
    # kernel launches (small models); max tokens None: the scheduler's max_prefill_tokens.
    enable_prefill_cuda_graph: bool = False
    prefill_cuda_graph_max_tokens: int | None = None
    # SpectrumKV; budget 1.0 keeps every token at the model dtype.
    kv_tier_budget: float = 1.0
    kv_tier_policy: str = "greedy"
    kv_sink_tokens: int = 4
    kv_importance: str = "attn"
    kv_recency_lambda: float = 0.0
    kv_int4: str = "auto"
    # Length of the int4 probe's NIAH trials. It must be a length at which the fp16 model itself
    # retrieves, else the probe measures long-context ability, not int4 tolerance (spectrum/probe.py).
    kv_int4_probe_tokens: int = 1024
    # "bytes": resident KV bytes (scales included) <= b x fp16 bytes; "cost": the paper's Eq. 3
    # normalized cost (scales not counted). See sgl_kvxfer/spectrum/byte_budget.py.
    kv_budget_unit: str = "bytes"
    # channels per (scale, zero) pair of the int tiers; 0: head_dim (one pair per token and
    # kv head, the cheapest to decode); see resolved_group_size
    kv_quant_group_size: int = 0
    # tokens per page of the int8 / int4 stores (the fp16 store stays slot-granular); the decode
    # kernel's loop step (256 tokens) spans several pages or part of one (kernels/README.md
    # section 10); a page tail left by a short run costs memory
    kv_tier_page_size: int = 64
    kv_importance_window: int = 32  # last W prompt queries whose attention ranks tokens
    kv_decode_recent: int = 64  # newest generated tokens kept fp16; older ones demoted in runs of this size
    kv_tier_staging: float = 0.25  # share of KV memory kept as fp16 slots for tokens not yet tiered
    # Per-layer budgets (spectrum/layer_budget.py): "profile" moves the int4 store's bytes across
    # layers by the sensitivity in kv_layer_profile (JSON of spectrum_calib.layer_profile).
    kv_layer_budget: str = "uniform"
    kv_layer_profile: str | None = None
    # Cold tier (scheduler/cold_tier.py): int4 and dropped tokens keep an fp16 copy in host memory;
    # int4 ones come back to fp16 when a decode query's attention on them reaches
    # kv_promote_threshold (one head's probability), scored every kv_promote_interval steps on
    # kv_promote_layers layers (the most int4-sensitive of kv_layer_profile when given,
    # spectrum/query_taps.py), with the int4 and dropped tokens within kv_promote_radius each side;
    # kv_cold_tier_tokens host copies (0: the pool's size); kv_promote_drop_run > 0: a run of
    # dropped tokens contiguous with the promoted ones comes back too, up to that many each side;
    # kv_promote_max_tokens (0: no cap) bounds the tokens one scoring pass promotes, the stretches
    # around the strongest hits first (the rest stay candidates for a later pass).
    kv_cold_tier: bool = False
    kv_promote_threshold: float = 0.02
    kv_promote_interval: int = 16
    kv_promote_layers: int = 2
    kv_promote_radius: int = 4
    kv_cold_tier_tokens: int = 0
    kv_promote_drop_run: int = 32
    kv_promote_max_tokens: int = 256
    # A peft LoRA adapter dir merged into the weights at load (W += alpha/r * B @ A; models/lora.py):
    # serves base + adapter at base speed (SCD's specialists, sgl_kvxfer/scd/README.md).
    merge_lora: str | None = None

    def __post_init__(self):
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMAT_CHOICES:
            raise ValueError(f"load_format must be one of {LOAD_FORMAT_CHOICES}, got {self.load_format!r}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError(f"max_total_tokens must be >= 16, got {self.max_total_tokens}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {self.context_length}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if not 0 <= self.base_gpu_id < 1024:
            raise ValueError(f"base_gpu_id must be in 0..1023, got {self.base_gpu_id}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.prefill_cuda_graph_max_tokens is not None and self.prefill_cuda_graph_max_tokens < 16:
            raise ValueError(f"prefill_cuda_graph_max_tokens must be >= 16, got {self.prefill_cuda_graph_max_tokens}")
        if self.attention_backend == "flashinfer" and self.resolved_device != "cuda":
            raise ValueError(f"--attention-backend flashinfer runs on CUDA only, got device "
                             f"{self.resolved_device!r}; use --attention-backend triton or torch")
        if self.attention_backend == "triton" and self.page_size > 1 and (
                self.page_size < 16 or self.page_size & (self.page_size - 1)):
            raise ValueError(f"--attention-backend triton needs --page-size 1 (default 64) or a power "
                             f"of two >= 16, got {self.page_size}")
        if not 0.0 < self.kv_tier_budget <= 1.0:
            raise ValueError(f"kv_tier_budget must be in (0, 1], got {self.kv_tier_budget}")
        if self.kv_int4 not in KV_INT4_CHOICES:
            raise ValueError(f"kv_int4 must be one of {KV_INT4_CHOICES}, got {self.kv_int4!r}")
        if self.kv_int4_probe_tokens < 128:
            raise ValueError(f"kv_int4_probe_tokens must be >= 128, got {self.kv_int4_probe_tokens}")
        if self.kv_importance not in KV_IMPORTANCE_CHOICES:
            raise ValueError(f"kv_importance must be one of {KV_IMPORTANCE_CHOICES}, got {self.kv_importance!r}")
        if self.kv_sink_tokens < 0 or self.kv_recency_lambda < 0:
            raise ValueError("kv_sink_tokens and kv_recency_lambda must be >= 0")
        if self.kv_budget_unit not in KV_BUDGET_UNIT_CHOICES:
            raise ValueError(f"kv_budget_unit must be one of {KV_BUDGET_UNIT_CHOICES}, got {self.kv_budget_unit!r}")
        if self.kv_quant_group_size != 0 and (self.kv_quant_group_size < 2 or self.kv_quant_group_size % 2):
            raise ValueError(f"kv_quant_group_size must be 0 (= head_dim) or an even number >= 2, "
                             f"got {self.kv_quant_group_size}")
        if self.kv_tier_page_size < 16 or self.kv_tier_page_size & (self.kv_tier_page_size - 1):
            raise ValueError(f"kv_tier_page_size must be a power of two >= 16 (the paged kernels' page), "
                             f"got {self.kv_tier_page_size}")
        if self.kv_importance_window < 1 or self.kv_decode_recent < 1:
            raise ValueError("kv_importance_window and kv_decode_recent must be >= 1")
        if not 0.0 < self.kv_tier_staging < 1.0:
            raise ValueError(f"kv_tier_staging must be in (0, 1), got {self.kv_tier_staging}")
        self._validate_layer_budget_and_cold_tier()
        if self.merge_lora is not None and not os.path.isfile(
                os.path.join(os.path.expanduser(self.merge_lora), "adapter_config.json")):
            raise ValueError(f"merge_lora must be a peft LoRA adapter dir (with adapter_config.json), "
                             f"got {self.merge_lora!r}")
        if self.tiering_enabled and (self.attention_backend not in (None, "torch", "triton") or self.page_size > 1):
            raise ValueError("SpectrumKV tiering (--kv-tier-budget < 1) runs on the torch or triton attention "
                             "backend with --page-size 1 (the fp16 store is slot-granular; the int stores are "
                             "paged by --kv-tier-page-size)")
        if self.tiering_enabled:
            from sgl_kvxfer.spectrum.policies import TIER_POLICIES

            if self.kv_tier_policy not in TIER_POLICIES:
                raise ValueError(f"kv_tier_policy must be one of {tuple(TIER_POLICIES)}, got {self.kv_tier_policy!r}")

    def _validate_layer_budget_and_cold_tier(self) -> None:
        from sgl_kvxfer.spectrum.layer_budget import LAYER_BUDGET_CHOICES, LayerProfile

        if self.kv_layer_budget not in LAYER_BUDGET_CHOICES:
            raise ValueError(f"kv_layer_budget must be one of {LAYER_BUDGET_CHOICES}, got {self.kv_layer_budget!r}")
        if self.kv_layer_budget == "profile" and self.kv_layer_profile is None:
            raise ValueError("--kv-layer-budget profile needs --kv-layer-profile, a JSON file written by "
                             "python -m sgl_kvxfer.spectrum_calib.layer_profile")
        if self.kv_layer_profile is not None:
            if self.kv_layer_budget != "profile" and not self.kv_cold_tier:
                raise ValueError("--kv-layer-profile is read with --kv-layer-budget profile or --kv-cold-tier "
                                 "(whose probe layers are then the profile's most int4-sensitive)")
            if not isinstance(self.kv_layer_profile, str) or not os.path.isfile(self.kv_layer_profile):
                raise ValueError(f"--kv-layer-profile must be a JSON file written by python -m "
                                 f"sgl_kvxfer.spectrum_calib.layer_profile; got {self.kv_layer_profile!r}")
            try:
                LayerProfile.load(self.kv_layer_profile)
            except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"--kv-layer-profile {self.kv_layer_profile}: {exc}") from None
        if not (isinstance(self.kv_promote_threshold, (int, float)) and 0.0 < self.kv_promote_threshold <= 1.0):
            raise ValueError(f"kv_promote_threshold must be in (0, 1] (an attention probability), "
                             f"got {self.kv_promote_threshold}")
        for name, lo, hi in (("kv_promote_interval", 1, 1 << 20), ("kv_promote_layers", 1, 4096),
                             ("kv_promote_radius", 0, 4096), ("kv_cold_tier_tokens", 0, 1 << 40),
                             ("kv_promote_drop_run", 0, 4096), ("kv_promote_max_tokens", 0, 1 << 20)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
        if self.kv_cold_tier and not self.tiering_enabled:
            raise ValueError("--kv-cold-tier keeps host copies of int4 and dropped tokens: it needs --kv-tier-budget < 1")
        custom = self.kv_layer_budget == "profile" or self.kv_tier_policy == "kivi"
        if custom and self.tiering_enabled and self.resolved_attention_backend != "torch":
            raise ValueError("--kv-layer-budget profile and --kv-tier-policy kivi store per-layer int formats the "
                             "Triton kernels do not read: use --attention-backend torch")

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_attention_backend(self) -> str:
        if self.attention_backend:
            return self.attention_backend
        if self.tiering_enabled:
            # CUDA: the Triton tiered kernels (fp16 / bf16 models); the torch reference on the CPU,
            # for float32 and for the per-layer int formats the kernels do not read (profile, kivi)
            custom = self.kv_layer_budget == "profile" or self.kv_tier_policy == "kivi"
            if self.resolved_device == "cuda" and self.dtype != "float32" and not custom:
                return "triton"
            return "torch"
        if self.resolved_device == "cpu":
            # fp32 ("auto" on CPU): the exact torch reference; bf16: native in-place decode
            return "cpu" if self.dtype == "bfloat16" else "torch"
        return "triton"

    @property
    def resolved_page_size(self) -> int:
        """KV page size: --page-size, except that the Triton and FlashInfer backends (paged kernels)
        turn the token-granular default 1 into the kernels' DEFAULT_PAGE_SIZE (64). Tiered pools stay
        slot-granular at page 1 (their int stores are paged by kv_tier_page_size instead)."""
        if (self.page_size == 1 and self.resolved_attention_backend in ("triton", "flashinfer")
                and not self.tiering_enabled):
            from sgl_kvxfer.kernels.paged_layout import DEFAULT_PAGE_SIZE

            return DEFAULT_PAGE_SIZE
        if self.page_size == 1 and self.resolved_attention_backend == "cpu":
            # runs of 16 slots per request: decode tokens of a request stay near each other
            # instead of B rows apart (the in-place decode kernel is bound by scattered reads)
            return CPU_DEFAULT_PAGE_SIZE
        return self.page_size

    @property
    def tiering_enabled(self) -> bool:
        return self.kv_tier_budget < 1.0

    def resolved_group_size(self, head_dim: int) -> int:
        """kv_quant_group_size, with 0 (the default) meaning head_dim: one scale/zero pair per
        token and kv head. Validated against the model's head_dim here (the config alone does
        not know it)."""
        g = self.kv_quant_group_size or head_dim
        if head_dim % g or (g != head_dim and (head_dim // 2) % g):
            raise ValueError(f"kv_quant_group_size {g} must be 0 (= head_dim) or divide half the model's "
                             f"head_dim {head_dim} (int4 packs channels j and j + head_dim / 2 in one byte)")
        return g


@dataclass(frozen=True)
class SchedulerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None  # -1 disables chunking
    max_prefill_tokens: int = 16384
    disable_radix_cache: bool = False
    schedule_policy: str = "lpm"  # longest-prefix-match first, or "fcfs"
    stream_interval: int = 1
    # CUDA: launch decode step N+1 before applying step N's results (scheduler/overlap.py)
    disable_overlap_schedule: bool = False
    # PD disaggregation (sgl_kvxfer/disagg/), SGLang's flags: the server's role, the prefill's
    # bootstrap server port (decode: the fallback when a request's bootstrap_port is null), the
    # transfer engine ("fake": no KV moves).
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "mooncake"
    # RDMA devices for Mooncake: "mlx5_0,mlx5_1", or {"<gpu id>": "mlx5_0", ...} inline or in a
    # .json file (SGLang's forms; disagg/mooncake.py); None: every HCA Mooncake finds
    disaggregation_ib_device: str | None = None
    # Ours: seconds a room may go without progress (no claim, no segment, no ack) before it
    # fails (the decode then prefills locally); the registered transfer buffer per server
    # (prefill: packed segments; decode: staging regions); at kv_tier_budget < 1, what streams
    # during chunked prefill ("end": nothing, tiers go out at prefill end; "int8": chunks at
    # int8, final tiers after; "chunk": each chunk at tiers chosen for it; "chunk-upgrade": that,
    # then the tokens whose final tier is more precise; "auto": resolved_kv_transfer_stream);
    # a link rate / latency paced in the engine (0: unpaced; benchmarks/pd/shaped_link.py
    # checks the achieved rate against the setting).
    kv_transfer_timeout: float = 30.0
    # prefill: seconds from a request's arrival within which a decode must register for its room
    # (KVRegister, sent by a live decode as soon as it has the request); a room none registered
    # for ends then, naming the decode side: the decode died or never got the request. Capped at
    # kv_transfer_timeout (claim_deadline_s); a too-short value costs a local prefill on a slow
    # decode, never a wrong answer.
    kv_claim_timeout: float = 5.0
    kv_transfer_buffer_mb: int = 1024
    kv_transfer_stream: str = "auto"
    # prefill, chunk streams at kv_tier_budget < 1: the prompt's last this many tokens are a
    # chunk of their own (when what remains of the prompt is one chunk and at least twice this),
    # so the segment written after the prompt ends is short; 0: chunks as chunked_prefill_size cuts them
    kv_transfer_last_chunk: int = 512
    # prefill: chunks of at most this many tokens while the KV link is slower than NVLink
    # (PrefillRole.stream_chunk_tokens), so the KV streams under the compute; 0: off
    kv_transfer_stream_chunk: int = 2048
    kv_transfer_rate_gbps: float = 0.0
    kv_transfer_latency_ms: float = 0.0
    # Every PD reply's meta_info.kv_transfer.trace: the request's phases on both servers
    # (disagg/trace.py). A traced prefill chunk waits for its GPU kernels to end its span.
    enable_pd_trace: bool = False
    # SCD over PD (docs/pd_disaggregation.md, "SCD over PD"): the artifacts dir of
    # `python -m sgl_kvxfer.scd.calib` (prefill: ship the prompt's KV as codes; decode:
    # rebuild its KV from them), the consumer this decode server is in the manifest (default:
    # the one this server's weights match), and how many decode servers claim each room's
    # codes before the prefill frees them (or the room times out).
    scd_artifacts: str | None = None
    scd_consumer: str | None = None
    scd_fanout: int = 1
    # prefill: the nested rank level the codes go at (artifacts with rank levels): "top", a fixed
    # "R_K:R_V", or "auto" (per request from the link rate, scd/rank_policy.py, with the wire
    # budget scd_wire_frac x the prefill's own time)
    scd_rank: str = "top"
    scd_wire_frac: float = 0.25
    scd_min_rank: str | None = None  # auto's floor level "R_K:R_V" or "auto" (rank_policy.quality_floor)

    def __post_init__(self):
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size != -1 and self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be -1 or >= 1, got {self.chunked_prefill_size}")
        if self.schedule_policy not in ("lpm", "fcfs"):
            raise ValueError(f"schedule_policy must be 'lpm' or 'fcfs', got {self.schedule_policy!r}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        from sgl_kvxfer.disagg import DISAGGREGATION_MODES, TRANSFER_BACKEND_CHOICES

        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(f"disaggregation_mode must be one of {DISAGGREGATION_MODES}, got {self.disaggregation_mode!r}")
        if self.disaggregation_transfer_backend not in TRANSFER_BACKEND_CHOICES:
            raise ValueError(f"disaggregation_transfer_backend must be one of {TRANSFER_BACKEND_CHOICES} "
                             f"(nixl, ascend and mori are not implemented), got {self.disaggregation_transfer_backend!r}")
        if not 0 < self.disaggregation_bootstrap_port < 65536:
            raise ValueError(f"disaggregation_bootstrap_port must be in 1..65535, got {self.disaggregation_bootstrap_port}")
        if not 0 < self.kv_transfer_timeout <= 86400 or self.kv_transfer_buffer_mb < 1:  # NaN fails too
            raise ValueError("kv_transfer_timeout must be in (0, 86400] and kv_transfer_buffer_mb >= 1, got "
                             f"{self.kv_transfer_timeout} and {self.kv_transfer_buffer_mb}")
        if not 0 < self.kv_claim_timeout <= 86400:
            raise ValueError(f"kv_claim_timeout must be in (0, 86400] seconds, got {self.kv_claim_timeout}")
        if self.kv_transfer_stream not in KV_TRANSFER_STREAM_CHOICES:
            raise ValueError(f"kv_transfer_stream must be one of {KV_TRANSFER_STREAM_CHOICES}, got {self.kv_transfer_stream!r}")
        last = self.kv_transfer_last_chunk
        if isinstance(last, bool) or not isinstance(last, int) or not (last == 0 or 32 <= last <= 1 << 20):
            raise ValueError(f"kv_transfer_last_chunk must be 0 (off) or tokens in [32, {1 << 20}], got {last!r}")
        cap = self.kv_transfer_stream_chunk
        if isinstance(cap, bool) or not isinstance(cap, int) or not (cap == 0 or 32 <= cap <= 1 << 20):
            raise ValueError(f"kv_transfer_stream_chunk must be 0 (off) or tokens in [32, {1 << 20}], got {cap!r}")
        if not (0 <= self.kv_transfer_rate_gbps < 1e6 and 0 <= self.kv_transfer_latency_ms < 1e6):
            raise ValueError("kv_transfer_rate_gbps and kv_transfer_latency_ms must be in [0, 1e6)")
        if self.disaggregation_ib_device is not None:
            from sgl_kvxfer.disagg.mooncake import ib_devices_for_gpu

            ib_devices_for_gpu(self.disaggregation_ib_device, self.engine.base_gpu_id)  # ValueError if malformed
        e = self.engine
        if self.disaggregation_mode != "null" and (e.kv_cold_tier or e.kv_layer_budget == "profile"
                                                   or e.kv_tier_policy == "kivi" and e.tiering_enabled):
            raise ValueError("--kv-cold-tier, --kv-layer-budget profile and --kv-tier-policy kivi run without PD "
                             "disaggregation (their int formats and host copies do not travel)")
        self._validate_scd()

    def _validate_scd(self) -> None:
        if self.scd_fanout < 1:
            raise ValueError(f"scd_fanout must be >= 1, got {self.scd_fanout}")
        if not (isinstance(self.scd_wire_frac, (int, float)) and 0 < self.scd_wire_frac < float("inf")):
            raise ValueError(f"--scd-wire-frac must be a finite number > 0, got {self.scd_wire_frac}")
        if self.scd_rank not in ("top", "auto") and not _SCD_LEVEL.fullmatch(self.scd_rank):
            raise ValueError(f"--scd-rank must be top, auto or R_K:R_V (a level of the artifacts), got {self.scd_rank!r}")
        if self.scd_min_rank is not None:
            if self.scd_min_rank != "auto" and not _SCD_LEVEL.fullmatch(self.scd_min_rank):
                raise ValueError(f"--scd-min-rank must be auto or R_K:R_V (a level of the artifacts), "
                                 f"got {self.scd_min_rank!r}")
            if self.scd_rank != "auto":
                raise ValueError(f"--scd-min-rank bounds --scd-rank auto, not --scd-rank {self.scd_rank}")
        if self.scd_artifacts is None:
            if self.scd_consumer is not None or self.scd_fanout != 1 or self.scd_rank != "top":
                raise ValueError("--scd-consumer, --scd-fanout and --scd-rank need --scd-artifacts")
            return
        if self.disaggregation_mode == "null" or self.disaggregation_transfer_backend == "fake":
            raise ValueError("--scd-artifacts needs --disaggregation-mode prefill or decode and a transfer "
                             "backend that moves bytes (not fake)")
        if not os.path.isfile(os.path.join(self.scd_artifacts, "manifest.json")):
            raise ValueError(f"--scd-artifacts {self.scd_artifacts}: no manifest.json there "
                             "(python -m sgl_kvxfer.scd.calib writes it)")
        if self.disaggregation_mode == "prefill" and self.scd_consumer is not None:
            raise ValueError("--scd-consumer names the consumer a decode server is; a prefill encodes for all")
        if self.disaggregation_mode == "decode" and (self.scd_fanout != 1 or self.scd_rank != "top"):
            raise ValueError("--scd-fanout and --scd-rank are the prefill's (a decode server reads any level)")
        if self.engine.tiering_enabled:
            raise ValueError("--scd-artifacts runs with fp16-family KV pools (--kv-tier-budget 1.0): codes are "
                             "encoded from and decoded into the model dtype")

    @property
    def resolved_kv_transfer_stream(self) -> str:
        """What streams during a tiered prefill; "auto" is the variant measured faster
        (docs/pd_disaggregation.md, "Measured"). On a GPU with a link paced at a set rate
        (--kv-transfer-rate-gbps > 0, a slow link: at 10 Gbit/s the 8k prompt's wire outlasts
        its prefill) "chunk": each chunk's KV leaves while the next one computes. Unpaced, the
        int8 stream from AUTO_INT8_STREAM_MIN_BUDGET up, where its int8 copies cost little more
        than the budget's own bytes and hide behind the prefill; tiers at the end below it, and
        on CPU, where quantizing each chunk competes with the prefill for the same cores."""
        if self.kv_transfer_stream != "auto":
            return self.kv_transfer_stream
        on_gpu = self.engine.resolved_device.startswith("cuda")
        if not (on_gpu and self.engine.kv_tier_budget < 1.0):
            return "end"
        if self.kv_transfer_rate_gbps > 0:
            return "chunk"
        return "int8" if self.engine.kv_tier_budget >= AUTO_INT8_STREAM_MIN_BUDGET else "end"

    @property
    def resolved_chunked_prefill_size(self) -> int | None:
        """Tokens per prefill chunk, or None for no chunking; unset: by device memory (auto_chunk_size)."""
        if self.chunked_prefill_size == -1:
            return None
        if self.chunked_prefill_size:
            return self.chunked_prefill_size
        e = self.engine
        return auto_chunk_size(_gpu_memory_gib(e.base_gpu_id) if e.resolved_device == "cuda" else None)


# The server's cross-process links (ServerArgs.ipc_addr): Unix sockets in one folder.
IPC_LINKS = ("scheduler_input", "detokenizer_input", "tokenizer_input")
# HAZARD: a Unix socket's path is at most 107 bytes on Linux (sockaddr_un.sun_path, 108 with its
# NUL; 103 on macOS); zmq refuses a longer one only when the process binds, after start-up.
IPC_PATH_MAX = 107 if sys.platform.startswith("linux") else 103


def ipc_dir_fits(ipc_dir: str) -> bool:
    """Every link's socket path in ipc_dir within IPC_PATH_MAX bytes."""
    longest = max(IPC_LINKS, key=len)
    return len(os.fsencode(os.path.join(ipc_dir, longest))) <= IPC_PATH_MAX


@dataclass(frozen=True)
class ServerArgs:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    admin_api_key: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    enable_metrics: bool = False
    skip_tokenizer_init: bool = False
    # SIGTERM / Ctrl-C: seconds in-flight requests may run on before they end with a 503
    # (server/shutdown.py); the name is sglang-router's. Below Kubernetes' default 30 s grace.
    shutdown_grace_period_secs: float = 20.0
    ipc_dir: str | None = None  # directory for ipc:// sockets; default a fresh temp dir

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        name = self.served_model_name
        if name is not None and not (0 < len(name) <= 256 and name.isprintable() and name.strip() == name):
            raise ValueError("served_model_name must be 1-256 printable characters without surrounding "
                             f"spaces, got {name[:64]!r}")
        if not 0.0 <= self.shutdown_grace_period_secs <= 86400.0:  # NaN fails too
            raise ValueError(f"shutdown_grace_period_secs must be in [0, 86400], got {self.shutdown_grace_period_secs}")
        if self.ipc_dir is not None and not ipc_dir_fits(self.ipc_dir):
            raise ValueError(f"ipc_dir {self.ipc_dir!r} is too long for a socket path (at most {IPC_PATH_MAX} bytes "
                             "with the link name)")

    @property
    def resolved_served_model_name(self) -> str:
        """The name /v1/models and the model info routes give (SGLang's --served-model-name):
        the flag, else --model-path as given, else the embedded default's name (never the cache
        folder a model was converted into)."""
        from sgl_kvxfer.models.convert import EMBEDDED_NAMES

        return self.served_model_name or self.engine.model_path or EMBEDDED_NAMES[0]

    @property
    def engine(self) -> EngineConfig:
        return self.scheduler.engine

    # Every cross-process link is named here, and only here.
    def ipc_addr(self, link: str) -> str:
        assert link in IPC_LINKS, link
        assert self.ipc_dir is not None, "ServerArgs.with_ipc_dir() must run before processes start"
        return f"ipc://{os.path.join(self.ipc_dir, link)}"

    def with_ipc_dir(self) -> "ServerArgs":
        """A fresh folder for the ipc:// sockets: in the temp dir (TMPDIR), or in /tmp where the
        temp dir is too deep for a socket path (a Unix socket's path holds at most
        IPC_PATH_MAX bytes; pytest's per-test temp dirs exceed it)."""
        if self.ipc_dir is not None:
            return self
        import tempfile

        for base in (None, "/tmp"):
            if base is not None and not os.path.isdir(base):
                continue
            d = tempfile.mkdtemp(prefix="sgl_kvxfer_ipc_", dir=base)
            if ipc_dir_fits(d):
                return dataclasses.replace(self, ipc_dir=d)
            os.rmdir(d)
        raise RuntimeError(f"no temp folder short enough for the server's sockets (paths of at most {IPC_PATH_MAX} "
                           f"bytes): {tempfile.gettempdir()!r} is too deep; set TMPDIR to a shorter folder")

    # ---------------------------------------------------------------- flat views
    @classmethod
    def from_flat(cls, **kwargs: Any) -> "ServerArgs":
        """Route flat keyword arguments to their level; unknown names raise TypeError."""
        levels = {EngineConfig: {}, SchedulerConfig: {}, ServerArgs: {}}
        owner = {}
        for level in levels:
            for f in dataclasses.fields(level):
                if f.name not in ("engine", "scheduler"):
                    owner[f.name] = level
        for key, value in kwargs.items():
            if key == "model":  # SGLang alias
                key = "model_path"
            if key not in owner:
                raise TypeError(f"unknown server argument {key!r}")
            levels[owner[key]][key] = value
        engine = EngineConfig(**levels[EngineConfig])
        scheduler = SchedulerConfig(engine=engine, **levels[SchedulerConfig])
        return cls(scheduler=scheduler, **levels[ServerArgs])

    def to_flat(self) -> dict[str, Any]:
        flat = {}
        for obj in (self.engine, self.scheduler, self):
            for f in dataclasses.fields(obj):
                if f.name not in ("engine", "scheduler"):
                    flat[f.name] = getattr(obj, f.name)
        return flat

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, choices: dict[str, tuple] | None = None) -> None:
        """One `--flag-name` per field, defaults from the dataclasses. `choices` may restrict
        registry-backed flags (e.g. {"attention_backend": ("torch", "triton")})."""
        choices = choices or {}
        for level in (EngineConfig, SchedulerConfig, ServerArgs):
            for f in dataclasses.fields(level):
                if f.name in ("engine", "scheduler", "ipc_dir"):
                    continue
                flag = "--" + f.name.replace("_", "-")
                default = f.default
                names = [flag] + (["--model"] if f.name == "model_path" else [])
                if f.type in ("bool",) or isinstance(default, bool):
                    parser.add_argument(*names, dest=f.name, action="store_true", default=default)
                    continue
                kind = {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
                extra = {"choices": choices[f.name]} if f.name in choices else {}
                if f.name == "dtype":
                    extra = {"choices": DTYPE_CHOICES}
                elif f.name == "load_format":
                    extra = {"choices": LOAD_FORMAT_CHOICES}
                elif f.name == "kv_int4":
                    extra = {"choices": KV_INT4_CHOICES}
                elif f.name == "kv_importance":
                    extra = {"choices": KV_IMPORTANCE_CHOICES}
                elif f.name == "kv_budget_unit":
                    extra = {"choices": KV_BUDGET_UNIT_CHOICES}
                elif f.name == "kv_transfer_stream":
                    extra = {"choices": KV_TRANSFER_STREAM_CHOICES}
                elif f.name == "kv_layer_budget":
                    from sgl_kvxfer.spectrum.layer_budget import LAYER_BUDGET_CHOICES

                    extra = {"choices": LAYER_BUDGET_CHOICES}
                elif f.name in ("disaggregation_mode", "disaggregation_transfer_backend"):
                    from sgl_kvxfer.disagg import DISAGGREGATION_MODES, TRANSFER_BACKEND_CHOICES

                    extra = {"choices": DISAGGREGATION_MODES if f.name == "disaggregation_mode"
                             else TRANSFER_BACKEND_CHOICES}
                elif f.name == "kv_tier_policy":
                    from sgl_kvxfer.spectrum.policies import TIER_POLICIES

                    extra = {"choices": tuple(TIER_POLICIES)}
                if f.name in CLI_HELP:
                    extra["help"] = CLI_HELP[f.name]
                parser.add_argument(*names, dest=f.name, type=kind, default=default, **extra)

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> "ServerArgs":
        return cls.from_flat(**vars(namespace))
