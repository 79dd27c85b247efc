"""Engine start-up in the order memory needs it, shared by the server's scheduler process and the
offline Engine:

    weights (load_weights) -> tokenizer -> int4 decision (int4_probe.decide_int4)
        -> ModelRunner: the KV pool, built once at its final size, then the CUDA graphs

The int4 decision divides a tiered pool's memory between its stores, so it comes before the pool;
when it needs the probe, the probe runs on its own small engine (int4_probe.probe_scheduler) that
is freed before the serving pool is allocated.
"""
from __future__ import annotations


def create_runner(cfg):
    """SchedulerConfig -> (ModelRunner, tokenizer, tokenizer path)."""
    from sgl_kvxfer.engine.model_runner import ModelRunner, load_weights
    from sgl_kvxfer.models.loader import load_tokenizer, resolve_tokenizer_path
    from sgl_kvxfer.scheduler.int4_probe import decide_int4

    loaded = load_weights(cfg.engine, cfg.max_running_requests, cfg.max_prefill_tokens)
    tokenizer_path = resolve_tokenizer_path(loaded.model_dir, cfg.engine.tokenizer_path)
    tokenizer = load_tokenizer(tokenizer_path)
    int4 = decide_int4(cfg, loaded, tokenizer)
    runner = ModelRunner(cfg.engine, cfg.max_running_requests, cfg.max_prefill_tokens, loaded=loaded, int4=int4)
    return runner, tokenizer, tokenizer_path
