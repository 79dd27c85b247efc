"""The tiered prefill against the fp16 one: TTFT of a server computing a prompt alone, per
--kv-tier-budget, with no transfer (no router, no transfer engine: runs where PD cannot).

    python benchmarks/pd/tiered_prefill.py [--budgets 1.0 0.5 0.3] [--prompt 8192] [--repeats 5]
        [--server-args "..."] [--out-dir DIR] [--name tiered_prefill]

For each budget, one server (server args + `--kv-tier-budget b`) starts, serves one warm-up
prompt (other token ids: kernel compiles stay out), then `--repeats` prompts of random token ids
(nothing hits the radix cache), each streamed with one new token: TTFT is the time to the first
streamed chunk, the prefill with its importance capture and re-tiering (b < 1) included. The
ratio of each budget's median to b = 1.0's is the tiered prefill's cost (`ratios`). The JSON is
rewritten after every budget; an interrupt (SIGINT) keeps what was measured.
"""
from __future__ import annotations

import argparse
import os
import random
import shlex
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.report import device_name, write_json  # noqa: E402
from common.sglang_clients import first_chunk  # noqa: E402

from sgl_kvxfer.testing.servers import start_server, stop_all  # noqa: E402


def prompt_ids(length: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab - 100) for _ in range(length)]


def ttft_ms(url: str, ids: list[int]) -> float:
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}}
    return 1e3 * first_chunk(url, body, time.perf_counter(), 1800)[0]


def summary(xs: list[float]) -> dict:
    return {"median_ms": statistics.median(xs), "min_ms": min(xs), "max_ms": max(xs), "runs_ms": xs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.5, 0.3])
    ap.add_argument("--prompt", type=int, default=8192, help="prompt length (tokens)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=49152, help="token ids are drawn below this")
    ap.add_argument("--server-args", required=True)
    ap.add_argument("--device", default="cuda", help="for the JSON's device name")
    ap.add_argument("--name", default="tiered_prefill")
    ap.add_argument("--out-dir", default=None)
    a = ap.parse_args()
    for b in a.budgets:
        if not 0 < b <= 1:
            ap.error(f"--budgets must be in (0, 1], got {b}")
    if a.prompt < 1 or a.repeats < 1:
        ap.error("--prompt and --repeats must be >= 1")
    result = {"device": device_name(a.device), "prompt": a.prompt, "repeats": a.repeats,
              "server_args": a.server_args, "budgets": {}, "ratios": {}}
    try:
        for b in a.budgets:
            server = start_server([*shlex.split(a.server_args), "--kv-tier-budget", str(b)], name=f"prefill_b{b}")
            try:
                ttft_ms(server.url, prompt_ids(a.prompt, -1, a.vocab))
                runs = [ttft_ms(server.url, prompt_ids(a.prompt, 1000 * i + int(100 * b), a.vocab))
                        for i in range(a.repeats)]
            finally:
                stop_all(server)
            result["budgets"][str(b)] = summary(runs)
            base = result["budgets"].get("1.0")
            if base is not None:
                result["ratios"] = {f"b={k} / b=1.0": v["median_ms"] / base["median_ms"]
                                    for k, v in result["budgets"].items() if k != "1.0"}
            print(f"b={b}: TTFT {summary(runs)['median_ms']:.1f} ms [{min(runs):.1f}, {max(runs):.1f}]", flush=True)
            write_json(a.name, result, a.out_dir)
    except KeyboardInterrupt:
        result["interrupted"] = True
        write_json(a.name, result, a.out_dir)


if __name__ == "__main__":
    main()
