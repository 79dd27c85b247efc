"""The int4 tolerance probe run through the engine itself (paper Sec. 4.5, spectrum/probe.py).

`resolve_engine_int4` applies `--kv-int4`:
    on / off   -> forced, nothing runs
    auto       -> skipped when the configured policy never emits int4 (the answer is moot);
                  else the cached result for (model fingerprint, trial length), or 3 NIAH trials
                  of --kv-int4-probe-tokens (1024) through this
                  scheduler (chat template, greedy decoding) under the probe's own settings:
                  greedy policy, cost budget 0.3, int4 on. int4 is enabled iff >= 2 succeed.
It runs only when tiering is on (kv_tier_budget < 1), once per scheduler start, before any
request is served; the probe's cached prefixes are flushed afterwards.
"""
from __future__ import annotations

import logging
import time
import uuid

from sgl_kvxfer.message import TokenizedGenerateReq
from sgl_kvxfer.sampling.params import SamplingParams
from sgl_kvxfer.spectrum.byte_budget import uses_int4
from sgl_kvxfer.spectrum.niah import build_probe_trials, load_filler_texts
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


def resolve_engine_int4(tiering, scheduler, tokenizer=None, cache_dir=None, mode: str | None = None) -> Int4Resolution:
    """`mode` defaults to the engine's --kv-int4 (benchmarks pass "auto" to probe an engine
    whose stores were sized with int4 on)."""
    mode = mode or tiering.config.kv_int4
    if mode != "auto":
        return resolve_int4(mode)
    if not uses_int4(tiering.policy):
        return Int4Resolution(enabled=False, source="unused")
    runner = scheduler.runner
    probe_tokens = tiering.config.kv_int4_probe_tokens
    fingerprint = f"{model_fingerprint(runner.hf_config, runner.model.named_parameters())}-t{probe_tokens}"
    cached = load_cached_probe(fingerprint, cache_dir)
    if cached is not None:
        return Int4Resolution(enabled=cached.int4_enabled, source="cache", result=cached)
    if tokenizer is None:
        from sgl_kvxfer.models.loader import load_tokenizer, resolve_tokenizer_path

        tokenizer = load_tokenizer(resolve_tokenizer_path(runner.model_dir, tiering.config.tokenizer_path))
    trials = build_probe_trials(load_filler_texts(), PROBE_NUM_TRIALS, target_tokens=probe_tokens,
                                count_tokens=lambda s: len(tokenizer.encode(s, add_special_tokens=False)))
    logger.info("SpectrumKV: running the int4 probe (%d NIAH trials of %d tokens, %s at b=%.1f; once per "
                "model, then cached)...", len(trials), probe_tokens, PROBE_POLICY, PROBE_BUDGET)
    start = time.perf_counter()
    with tiering.using(policy=PROBE_POLICY, budget=PROBE_BUDGET, unit="cost", int4_allowed=True):
        resolution = resolve_int4("auto", fingerprint, lambda p: run_engine_trial(scheduler, tokenizer, p),
                                  trials, cache_dir)
    scheduler.flush_cache()
    logger.info("SpectrumKV int4 probe: %d/%d trials retrieved the passcode -> int4 %s; done in %.0f s",
                resolution.result.successes, len(trials), "on" if resolution.enabled else "off",
                time.perf_counter() - start)
    return resolution
