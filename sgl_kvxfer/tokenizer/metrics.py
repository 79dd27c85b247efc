"""Request counters and latency histograms kept by the tokenizer manager, rendered as
Prometheus text with SGLang's `sglang:` metric names (every sample carries `model_name`).

Gauges that live in the scheduler (queue length, KV usage, cache hit rate, throughput) come
from an `InternalState` round trip at scrape time and are passed to `render`.
"""
from __future__ import annotations

import bisect

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Histogram:
    def __init__(self, buckets=_LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last slot is +Inf
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1


class ServerMetrics:
    def __init__(self):
        self.num_requests_total = 0
        self.num_aborted_requests_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.cached_tokens_total = 0
        self.ttft = Histogram()
        self.itl = Histogram()
        self.e2e = Histogram()

    def on_finish(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int, e2e: float, aborted: bool):
        self.num_requests_total += 1
        self.num_aborted_requests_total += int(aborted)
        self.prompt_tokens_total += prompt_tokens
        self.generation_tokens_total += completion_tokens
        self.cached_tokens_total += cached_tokens
        self.e2e.observe(e2e)

    def render(self, model_name: str, state: dict | None) -> str:
        label = '{model_name="%s"}' % model_name.replace("\\", "\\\\").replace('"', '\\"')
        lines: list[str] = []

        def sample(name: str, kind: str, help_text: str, value: float):
            lines.extend((f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} {kind}", f"sglang:{name}{label} {value}"))

        sample("num_requests_total", "counter", "Number of finished requests.", self.num_requests_total)
        sample("num_aborted_requests_total", "counter", "Number of aborted requests.", self.num_aborted_requests_total)
        sample("prompt_tokens_total", "counter", "Number of prefill tokens processed.", self.prompt_tokens_total)
        sample("generation_tokens_total", "counter", "Number of generation tokens processed.", self.generation_tokens_total)
        sample("cached_tokens_total", "counter", "Number of prompt tokens served from the prefix cache.", self.cached_tokens_total)
        if state is not None:
            total = max(1, state["max_total_num_tokens"])
            sample("num_running_reqs", "gauge", "Number of running requests.", state["num_running_reqs"])
            sample("num_queue_reqs", "gauge", "Number of requests in the waiting queue.", state["num_queue_reqs"])
            sample("num_used_tokens", "gauge", "KV pool tokens in use.", state["kv_used_tokens"])
            sample("max_total_num_tokens", "gauge", "KV pool capacity in tokens.", state["max_total_num_tokens"])
            sample("token_usage", "gauge", "Fraction of the KV pool in use.", round(state["kv_used_tokens"] / total, 6))
            sample("cache_hit_rate", "gauge", "Prefix cache hit rate.", state["cache_hit_rate"])
            sample("gen_throughput", "gauge", "Generation throughput (token/s).", state["last_gen_throughput"])
            kv = state.get("kv_transfer")
            if kv:  # PD roles (disagg/common.py TransferStats)
                sample("kv_transfer_bytes_total", "counter", "KV bytes written to (prefill) or received from "
                       "(decode) the transfer engine.", kv["bytes"])
                sample("kv_transfer_tokens_total", "counter", "Prompt tokens whose KV was transferred.", kv["tokens"])
                sample("kv_transfer_bytes_per_token", "gauge", "KV bytes on the wire per transferred token.",
                       round(kv["bytes_per_token"], 3))
                sample("kv_transfer_rooms_ok_total", "counter", "Rooms whose KV transfer succeeded.",
                       kv["rooms"].get("ok", 0))
                sample("kv_transfer_rooms_failed_total", "counter", "Rooms whose KV transfer failed.",
                       sum(n for k, n in kv["rooms"].items() if k != "ok"))
                sample("kv_transfer_fallbacks_total", "counter", "Decode requests prefilled locally after a "
                       "failed KV transfer (each request once).", kv["fallbacks"])
                sample("kv_transfer_peer_failures_total", "counter", "PD peers (prefill or decode servers) seen "
                       "dying by the liveness probes.", kv.get("peer_failures", 0))
        for name, hist, help_text in (
            ("time_to_first_token_seconds", self.ttft, "Time to first token."),
            ("inter_token_latency_seconds", self.itl, "Inter-token latency."),
            ("e2e_request_latency_seconds", self.e2e, "End-to-end request latency."),
        ):
            lines += [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} histogram"]
            running = 0
            bounds = [str(b) for b in hist.buckets] + ["+Inf"]
            for bound, count in zip(bounds, hist.counts):
                running += count
                lines.append(f'sglang:{name}_bucket{label[:-1]},le="{bound}"}} {running}')
            lines += [f"sglang:{name}_sum{label} {hist.total}", f"sglang:{name}_count{label} {hist.n}"]
        return "\n".join(lines) + "\n"
