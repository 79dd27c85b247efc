"""The int4 tolerance probe run through the engine itself (paper Sec. 4.5, spectrum/probe.py).

`decide_int4` applies `--kv-int4` at start-up, BEFORE the KV pool is built (the decision divides
the pool's memory between the tiers, so the pool and its CUDA graphs are built once):
    on / off   -> forced, nothing runs
    auto       -> skipped when the configured policy never emits int4 (the answer is moot);
                  else the cached result for (model fingerprint, trial length), or 3 NIAH trials
                  of --kv-int4-probe-tokens (1024) under the probe's own settings (greedy
                  policy, cost budget 0.3, int4 on; chat template, greedy decoding) on a probe
                  engine: the loaded weights, a Scheduler and a tiered pool just large enough
                  for one trial, eager (no CUDA graphs), freed before the serving pool is
                  allocated. int4 is enabled iff >= 2 trials succeed.
`resolve_engine_int4` runs the same probe through an engine that already serves (benchmarks).
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import math
import time
import uuid

import torch

from sgl_kvxfer.message import TokenizedGenerateReq
from sgl_kvxfer.sampling.params import SamplingParams
from sgl_kvxfer.spectrum.byte_budget import uses_int4
from sgl_kvxfer.spectrum.niah import build_probe_trials, load_filler_texts
from sgl_kvxfer.spectrum.policies import create_tier_policy
from sgl_kvxfer.spectrum.probe import (PROBE_BUDGET, PROBE_NUM_TRIALS, PROBE_POLICY, Int4Resolution,
                                       load_cached_probe, model_fingerprint, resolve_int4)

logger = logging.getLogger(__name__)

PROBE_MAX_NEW_TOKENS = 32


def chat_prompt_ids(tokenizer, user_message: str) -> list[int]:
    """The user message under the model's chat template (raw text when it has none)."""
    text = user_message
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": user_message}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def run_engine_trial(scheduler, tokenizer, user_message: str, max_new_tokens: int = PROBE_MAX_NEW_TOKENS) -> str:
    """Greedy completion of one chat turn, stepping the scheduler until the request finishes.

    Only legal while the scheduler serves nothing else (start-up): it consumes the outbox.
    """
    ids = chat_prompt_ids(tokenizer, user_message)
    sampling = SamplingParams.from_dict({"max_new_tokens": max_new_tokens, "temperature": 0})
    msg = TokenizedGenerateReq(rid=f"int4-probe-{uuid.uuid4().hex}", input_ids=ids, sampling=sampling)
    scheduler.handle(msg)
    out, finished = [], None
    while finished is None:
        if not scheduler.step() and not scheduler.outbox:
            raise RuntimeError("int4 probe: the scheduler stopped before the trial finished")
        for o in scheduler.take_outputs():
            out.extend(o.new_output_ids)
            finished = o.finish_reason if o.finish_reason is not None else finished
    if finished.get("type") == "abort":
        raise RuntimeError(f"int4 probe trial rejected: {finished.get('message')} "
                           "(use --kv-int4 on|off, or give the KV pool more memory)")
    return tokenizer.decode(out, skip_special_tokens=True)


def probe_fingerprint(hf_config: dict, model, probe_tokens: int) -> str:
    """The probe cache's key: the model (config + sampled weights) and the trial length."""
    return f"{model_fingerprint(hf_config, model.named_parameters())}-t{probe_tokens}"


def probe_trials(tokenizer, probe_tokens: int):
    return build_probe_trials(load_filler_texts(), PROBE_NUM_TRIALS, target_tokens=probe_tokens,
                              count_tokens=lambda s: len(tokenizer.encode(s, add_special_tokens=False)))


def _known_answer(mode: str, policy, fingerprint, cache_dir) -> Int4Resolution | None:
    """The decision when no trial needs to run (forced, moot, cached); None: probe.
    `fingerprint` is a callable: hashing the weights is skipped where the answer is known."""
    if mode != "auto":
        return resolve_int4(mode)
    if not uses_int4(policy):
        return Int4Resolution(enabled=False, source="unused")
    cached = load_cached_probe(fingerprint(), cache_dir)
    if cached is not None:
        return Int4Resolution(enabled=cached.int4_enabled, source="cache", result=cached)
    return None


def _run_probe(scheduler, tokenizer, trials, probe_tokens: int, fingerprint: str, cache_dir) -> Int4Resolution:
    """The trials through `scheduler` (already under the probe's settings); stores the result."""
    logger.info("SpectrumKV: running the int4 probe (%d NIAH trials of %d tokens, %s at b=%.1f; once per "
                "model, then cached)...", len(trials), probe_tokens, PROBE_POLICY, PROBE_BUDGET)
    start = time.perf_counter()
    resolution = resolve_int4("auto", fingerprint, lambda p: run_engine_trial(scheduler, tokenizer, p),
                              trials, cache_dir)
    logger.info("SpectrumKV int4 probe: %d/%d trials retrieved the passcode -> int4 %s; done in %.0f s",
                resolution.result.successes, len(trials), "on" if resolution.enabled else "off",
                time.perf_counter() - start)
    return resolution


def decide_int4(cfg, loaded, tokenizer, cache_dir=None) -> Int4Resolution | None:
    """The int4 decision for SchedulerConfig `cfg` and the weights `loaded`
    (engine/model_runner.load_weights), before any KV pool exists. None when tiering is off."""
    engine = cfg.engine
    if not engine.tiering_enabled:
        return None
    tokens = engine.kv_int4_probe_tokens
    fingerprint = functools.cache(lambda: probe_fingerprint(loaded.hf_config, loaded.model, tokens))
    known = _known_answer(engine.kv_int4, create_tier_policy(engine.kv_tier_policy), fingerprint, cache_dir)
    if known is not None:
        return known
    trials = probe_trials(tokenizer, tokens)
    need = max(len(chat_prompt_ids(tokenizer, t.prompt)) for t in trials) + PROBE_MAX_NEW_TOKENS
    scheduler = probe_scheduler(cfg, loaded, tokenizer, need)
    try:
        return _run_probe(scheduler, tokenizer, trials, tokens, fingerprint(), cache_dir)
    finally:  # NOTE: the probe pool must be gone before the serving pool measures free memory
        del scheduler
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def probe_scheduler(cfg, loaded, tokenizer, need_tokens: int):
    """A Scheduler over the loaded weights whose tiered pool runs the probe's settings and whose
    fp16 (staging) store holds one trial of `need_tokens` (prompt + completion) whole."""
    from sgl_kvxfer.engine.model_runner import ModelRunner
    from sgl_kvxfer.scheduler.scheduler import Scheduler

    engine = cfg.engine
    # staging x size slots stay fp16 (mem_cache/tier_plan.py); +1 for the floor
    size = max(math.ceil(need_tokens / engine.kv_tier_staging) + 1, engine.kv_tier_page_size)
    engine = dataclasses.replace(engine, kv_tier_policy=PROBE_POLICY, kv_tier_budget=PROBE_BUDGET,
                                 kv_budget_unit="cost", kv_int4="on", max_total_tokens=size,
                                 disable_cuda_graph=True, enable_prefill_cuda_graph=False)
    probe_cfg = dataclasses.replace(cfg, engine=engine, max_running_requests=1)  # no PD role is attached
    runner = ModelRunner(engine, 1, cfg.max_prefill_tokens, loaded=loaded, int4=resolve_int4("on"))
    return Scheduler(probe_cfg, runner, tokenizer)


def resolve_engine_int4(tiering, scheduler, tokenizer=None, cache_dir=None, mode: str | None = None) -> Int4Resolution:
    """The probe through a serving engine's own scheduler (benchmarks): `mode` defaults to its
    --kv-int4 (benchmarks pass "auto" to probe an engine whose stores were sized with int4 on).
    Only legal while the scheduler serves nothing else; its cache is flushed afterwards."""
    runner, tokens = scheduler.runner, tiering.config.kv_int4_probe_tokens
    fingerprint = functools.cache(lambda: probe_fingerprint(runner.hf_config, runner.model, tokens))
    known = _known_answer(mode or tiering.config.kv_int4, tiering.policy, fingerprint, cache_dir)
    if known is not None:
        return known
    if tokenizer is None:
        from sgl_kvxfer.models.loader import load_tokenizer, resolve_tokenizer_path

        tokenizer = load_tokenizer(resolve_tokenizer_path(runner.model_dir, tiering.config.tokenizer_path))
    trials = probe_trials(tokenizer, tokens)
    with tiering.using(policy=PROBE_POLICY, budget=PROBE_BUDGET, unit="cost", int4_allowed=True):
        resolution = _run_probe(scheduler, tokenizer, trials, tokens, fingerprint(), cache_dir)
    scheduler.flush_cache()
    return resolution
