"""int4 tolerance probe (paper Sec. 4.5, Algorithm 1 step 1) and `--kv-int4 auto|on|off`.

Rule: run PROBE_NUM_TRIALS (3) NIAH trials of PROBE_TOKENS (1024, `--kv-int4-probe-tokens`)
with the 3-tier greedy policy at b = 0.3 and int4
enabled; int4 is enabled iff at least PROBE_MIN_SUCCESSES (2) succeed. Otherwise the model runs
2-tier (fp16 + int8). Modes: "on" / "off" force the answer and never probe; "auto" reads the
on-disk cache and probes only on a miss, then stores the result.

Cache: one JSON file per model under $SGL_KVXFER_PROBE_CACHE, else ~/.cache/sgl_kvxfer/int4_probe/,
named by `model_fingerprint` (config JSON + a strided sample of every weight's bytes) plus the
trial length, so a changed checkpoint, config or probe length re-probes. The trial runner is a callable prompt -> completion,
so this module knows nothing about the engine; the caller must run it under
PROBE_POLICY at PROBE_BUDGET with int4 on and apply the chat template.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from sgl_kvxfer.spectrum.niah import NIAHTrial, build_probe_trials, load_filler_texts, niah_success

PROBE_POLICY = "greedy"
PROBE_BUDGET = 0.3
PROBE_NUM_TRIALS = 3
PROBE_MIN_SUCCESSES = 2
# Trial length (--kv-int4-probe-tokens). The paper's models retrieve at 4k; SmolLM2-135M at fp16
# does not (1 of these 3 trials at 4096 tokens, 3/3 at 1k), and a probe whose trials fail at fp16
# would turn int4 off for a reason int4 has nothing to do with. Measured on an H200:
# benchmarks/results/niah_NVIDIA_H200.json ("probe" -> "fp16_outcomes").
PROBE_TOKENS = 1024
INT4_MODES = ("auto", "on", "off")
# NOTE: belongs in the typed env.py once it exists; read here so the probe works standalone.
from sgl_kvxfer import env as _env

ENV_PROBE_CACHE = _env.PROBE_CACHE.name
_FINGERPRINT_VERSION = 1


def int4_decision(outcomes: Sequence[bool], min_successes: int = PROBE_MIN_SUCCESSES) -> bool:
    """Enable int4 iff at least `min_successes` trials succeeded."""
    return sum(bool(o) for o in outcomes) >= min_successes


@dataclass
class ProbeResult:
    fingerprint: str
    outcomes: list[bool]
    int4_enabled: bool
    policy: str = PROBE_POLICY
    budget: float = PROBE_BUDGET
    responses: list[str] = field(default_factory=list)

    @property
    def successes(self) -> int:
        return sum(self.outcomes)


def run_int4_probe(run_trial: Callable[[str], str], trials: Sequence[NIAHTrial] | None = None,
                   fingerprint: str = "", min_successes: int = PROBE_MIN_SUCCESSES) -> ProbeResult:
    """Run every trial through `run_trial` (prompt -> completion) and apply the 2-of-3 rule."""
    if trials is None:
        trials = build_probe_trials(load_filler_texts(), PROBE_NUM_TRIALS, target_tokens=PROBE_TOKENS)
    responses = [run_trial(t.prompt) for t in trials]
    outcomes = [niah_success(r, t.passcode) for r, t in zip(responses, trials)]
    return ProbeResult(fingerprint=fingerprint, outcomes=outcomes,
                       int4_enabled=int4_decision(outcomes, min_successes), responses=responses)


def _tensor_items(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]):
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    return sorted(((str(k), v) for k, v in items), key=lambda kv: kv[0])


def model_fingerprint(config: Mapping[str, Any] | Any,
                      tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                      samples_per_tensor: int = 64) -> str:
    """sha256 (32 hex) of the canonical config JSON plus, per tensor (sorted by name): name, dtype,
    shape and the bytes of `samples_per_tensor` evenly strided elements (first and last included).

    Cheap (a few KB read per model), yet any re-trained or re-quantized checkpoint changes it.
    `config` may be a dict or an object with to_dict() (HF PretrainedConfig). Meta tensors hash
    by name/dtype/shape only.
    """
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    h = hashlib.sha256(f"spectrumkv-fingerprint-v{_FINGERPRINT_VERSION}".encode())
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name, t in _tensor_items(tensors):
        h.update(f"|{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.device.type == "meta" or t.numel() == 0:
            continue
        flat = t.detach().reshape(-1)
        idx = torch.linspace(0, flat.numel() - 1, min(samples_per_tensor, flat.numel()),
                             dtype=torch.float64).round().long().to(flat.device)
        sample = flat[idx].cpu().contiguous()
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def probe_cache_dir() -> Path:
    env = _env.PROBE_CACHE.get()
    return Path(env) if env else Path.home() / ".cache" / "sgl_kvxfer" / "int4_probe"


def _cache_path(fingerprint: str, cache_dir: str | Path | None) -> Path:
    return Path(cache_dir or probe_cache_dir()) / f"{fingerprint}.json"


def load_cached_probe(fingerprint: str, cache_dir: str | Path | None = None) -> ProbeResult | None:
    """The stored result for this fingerprint, or None (missing or unreadable file = miss)."""
    try:
        data = json.loads(_cache_path(fingerprint, cache_dir).read_text())
        result = ProbeResult(**data)
    except (OSError, ValueError, TypeError):
        return None
    return result if result.fingerprint == fingerprint else None


def store_probe(result: ProbeResult, cache_dir: str | Path | None = None) -> Path:
    """Write atomically (tmp file + rename) so concurrent launches never read half a file."""
    path = _cache_path(result.fingerprint, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(result), f, indent=1)
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class Int4Resolution:
    enabled: bool
    source: str  # "on", "off", "cache" or "probe"
    result: ProbeResult | None = None


def resolve_int4(mode: str, fingerprint: str = "", run_trial: Callable[[str], str] | None = None,
                 trials: Sequence[NIAHTrial] | None = None,
                 cache_dir: str | Path | None = None) -> Int4Resolution:
    """Apply `--kv-int4`: on/off force; auto = cached result for `fingerprint`, else probe + store."""
    if mode not in INT4_MODES:
        raise ValueError(f"kv_int4 must be one of {INT4_MODES}, got {mode!r}")
    if mode != "auto":
        return Int4Resolution(enabled=mode == "on", source=mode)
    if not fingerprint:
        raise ValueError("kv_int4=auto needs a model fingerprint to key the probe cache")
    cached = load_cached_probe(fingerprint, cache_dir)
    if cached is not None:
        return Int4Resolution(enabled=cached.int4_enabled, source="cache", result=cached)
    if run_trial is None:
        raise ValueError("kv_int4=auto with no cached probe result needs run_trial")
    result = run_int4_probe(run_trial, trials, fingerprint)
    store_probe(result, cache_dir)
    return Int4Resolution(enabled=result.int4_enabled, source="probe", result=result)
