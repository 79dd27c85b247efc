"""SCD end to end, the paper's way: one base-model (producer) prefill serving N specialists
(consumers), TTFT including the producer's prefill, against each specialist prefilling the
prompt itself.

    python benchmarks/pd/scd_e2e.py [--prompt-tokens 8192] [--fanouts 1 2 4] [--rates 0 25 100 200]
        [--repeats 5] [--server-args "..."] [--producer-gpu 0 --consumer-gpu 1]
        [--transfer-backend mooncake] [--artifacts DIR | --ranks 12 20 128 --patch-count 6]
        [--rank-levels 4:8 8:12] [--rank-modes auto 4:8 8:12 top]

Servers: N_max decode servers (specialist i: `--random-seed` 100 + i over dummy weights, SCD
consumer c<i>) start once; a prefill server (the base) with --scd-fanout N starts for each N, in
the order --fanouts lists them.
No router: the client sends the same body, with one fresh bootstrap room, to the producer and
to each of the N consumers at once (disagg/scd_fanout.py's no-router path). Scenarios:

  fanout    a new document (random token ids) asked to N specialists. TTFT_i = from sending to
            consumer i's first streamed chunk: the producer's prefill + its codes on the link +
            consumer i's rebuild + its first step. Oracle: the same prompt sent to the N
            specialists with no bootstrap (each prefills it itself, concurrently on its GPU).
            Reported per N and link rate: median over repeats of the mean and of the max over
            the N specialists (the max: when the last specialist answers).
  shared    a document already in the producer's radix cache (a first request put it there),
            asked with a new question by one specialist that has never seen it: the producer
            computes only the question (its zh pool holds the document's patch codes), then
            codes of the whole prompt go out. Oracle: the specialist prefills document + question,
            each oracle request with a document of its own (cold: never in its radix cache).

Phase trace: every server runs with --enable-pd-trace, the producer's tracing switched off
(POST /kv_transfer_link) except for ONE extra request per point (N and rate; shared document and
rate), run after that point's repeats and kept out of its timings (a traced producer waits for
its kernels at each phase's end). Each of its consumers' trace is stored under the row's
`trace` (disagg/trace.py, scd_prefill.py, scd_decode.py: the producer's queue, prefill[a:b],
code[s], pack[s], wire[s], notice; the consumer's bootstrap, unpack[s], unpack_wait, admit,
first_step; `ttft_ms` to the end of the first step, `rebuild_gpu_ms` the rebuild's device time
by part) with its client-side TTFT; `summary.trace` condenses them.

Link: the producer's in-engine pacing (`--kv-transfer-rate-gbps`, re-paced with POST
/kv_transfer_link); rate 0 = unpaced (paced at 1e6 Gbit/s: no pacing delay). The transfer
backend is `--transfer-backend` (passed to every server as --disaggregation-transfer-backend).

GPU placement: `--producer-gpu G --consumer-gpu G` pass `--base-gpu-id G` to the servers when
launch_server has that flag (`--gpu-placement flag`), else set CUDA_VISIBLE_DEVICES per server
(`visible`); `auto` (default) picks flag when available. `--consumer-gpus` lists one GPU per
consumer when they do not fit one card. Without --artifacts, random artifacts of the model's
architecture with N_max consumers are made (timing only). Writes NAME.json and NAME.png; exits 1
when some fan-out failed (NAME.json's `errors` says why; the other fan-outs still ran).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common.report import device_name, git_commit, write_json  # noqa: E402
from common.sglang_clients import first_chunk  # noqa: E402

from sgl_kvxfer.testing.servers import free_port, start_server, stop_all  # noqa: E402

UNPACED_GBPS = 1e5  # paced far above any link (100 Tbit/s): a shaped link the benchmark can re-pace; the flag takes < 1e6
MAX_NEW_TOKENS = 2
QUIET_HEALTH = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--question-tokens", type=int, default=32, help="the shared scenario's new question")
    ap.add_argument("--fanouts", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rates", type=float, nargs="+", default=[0, 25, 100, 200], help="Gbit/s; 0 = unpaced")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--server-args", default="--dtype bfloat16", help="arguments for every server")
    ap.add_argument("--producer-args", default="", help="the prefill server's own arguments")
    ap.add_argument("--consumer-args", default="", help="every decode server's own arguments")
    ap.add_argument("--transfer-backend", default=None, help="--disaggregation-transfer-backend for every server")
    ap.add_argument("--producer-gpu", type=int, default=None)
    ap.add_argument("--consumer-gpu", type=int, default=None)
    ap.add_argument("--consumer-gpus", type=int, nargs="+", default=None, help="one GPU per consumer (overrides --consumer-gpu)")
    ap.add_argument("--gpu-placement", choices=("auto", "flag", "visible"), default="auto")
    ap.add_argument("--artifacts", default=None, help="SCD artifacts dir (default: random ones, timing only)")
    ap.add_argument("--ranks", type=int, nargs=3, default=[12, 20, 128], metavar=("R_K", "R_V", "R_H"))
    ap.add_argument("--patch-count", type=int, default=6)
    ap.add_argument("--rank-levels", nargs="*", default=["4:8", "8:12"], metavar="R_K:R_V",
                    help="random artifacts' nested levels below --ranks' top (ascending)")
    ap.add_argument("--rank-modes", nargs="*", default=[], metavar="MODE",
                    help="--scd-rank of one producer each (auto, top, R_K:R_V), compared at N=1 after the fan-outs")
    ap.add_argument("--rank-repeats", type=int, default=3)
    ap.add_argument("--rank-producer-args", default="",
                    help="the rank stage's prefill servers' own arguments, after --producer-args (they share one GPU)")
    ap.add_argument("--skip-shared", action="store_true")
    ap.add_argument("--no-trace", action="store_true",
                    help="no traced request per point (servers without --enable-pd-trace)")
    ap.add_argument("--vocab", type=int, default=49152, help="token ids are drawn below this")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    ap.add_argument("--name", default="scd_e2e")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    if min(args.fanouts) < 1 or args.repeats < 1 or min(args.prompt_tokens) < 2 or min(args.rates) < 0:
        ap.error("--fanouts >= 1, --repeats >= 1, --prompt-tokens >= 2, --rates >= 0")
    if args.question_tokens < 1 or args.vocab < 202 or not args.timeout_s > 0 or args.rank_repeats < 1:
        ap.error("--question-tokens >= 1, --vocab >= 202, --timeout-s > 0, --rank-repeats >= 1")
    try:
        args.rank_levels = [tuple(int(x) for x in lv.split(":")) for lv in args.rank_levels]
    except ValueError:
        ap.error(f"--rank-levels: R_K:R_V pairs, got {args.rank_levels}")
    if any(len(lv) != 2 or min(lv) < 1 for lv in args.rank_levels):
        ap.error(f"--rank-levels: R_K:R_V pairs of positive ranks, got {args.rank_levels}")
    n_max = max(args.fanouts)
    if args.consumer_gpus is not None and len(args.consumer_gpus) != n_max:
        ap.error(f"--consumer-gpus needs {n_max} entries (one per consumer)")
    return args


def ids_for(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def body(ids: list[int], **extra) -> dict:
    return {"input_ids": ids, "stream": True, **extra,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}}


def scd_request(p: dict, consumers: list, ids: list[int], timeout: float) -> list[tuple[float, dict]]:
    """One room: the body to the producer and to each consumer at once; each consumer's TTFT."""
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": p["bp"], "bootstrap_room": random.getrandbits(62)}
    req = body(ids, **fields)
    with ThreadPoolExecutor(len(consumers) + 1) as pool:
        t0 = time.perf_counter()
        fp = pool.submit(requests.post, p["h"].url + "/generate", json={**req, "stream": False}, timeout=timeout)
        fs = [pool.submit(first_chunk, c.url, req, t0, timeout) for c in consumers]
        out = [f.result() for f in fs]
        r = fp.result()
    if r.status_code != 200:
        raise RuntimeError(f"producer: {r.status_code} {r.text[:300]}")
    bad = [m.get("kv_transfer", {}).get("status") for _, m in out if m.get("kv_transfer", {}).get("status") != "ok"]
    if bad:
        raise RuntimeError(f"SCD transfers did not succeed: {bad}")
    return out


def set_link(p: dict, rate: float, trace: bool = False) -> None:
    """Pace the producer's link (0: unpaced); trace its rooms opened from now on or not."""
    body_ = {"rate_gbps": rate or UNPACED_GBPS}
    if p.get("trace"):
        body_["trace"] = trace
    requests.post(p["h"].url + "/kv_transfer_link", json=body_, timeout=30).raise_for_status()


def traced_request(p: dict, consumers: list, ids: list[int], rate: float, timeout: float) -> list[dict] | None:
    """One extra SCD request with the producer's trace on (its timing is not a row's: a traced
    producer waits for its kernels); each consumer's trace and its client-side TTFT."""
    if not p.get("trace"):
        return None
    set_link(p, rate, trace=True)
    try:
        out = scd_request(p, consumers, ids, timeout)
    finally:
        set_link(p, rate, trace=False)
    return [{"client_ttft_ms": round(1e3 * t, 3), "trace": m.get("kv_transfer", {}).get("trace"),
             "rebuild_gpu_ms": m.get("kv_transfer", {}).get("rebuild_gpu_ms"),
             "rebuild_host_ms": m.get("kv_transfer", {}).get("rebuild_host_ms"),
             "rebuild_cuda_alloc": m.get("kv_transfer", {}).get("rebuild_cuda_alloc"),
             "segments": m.get("kv_transfer", {}).get("segments"), "wire_ms": m.get("kv_transfer", {}).get("wire_ms")}
            for t, m in out]


def oracle_request(consumers: list, ids: list[int], timeout: float) -> list[float]:
    """Each consumer prefills the prompt itself (no bootstrap), all at once."""
    req = body(ids, bootstrap_host="2.2.2.2", bootstrap_room=0)
    with ThreadPoolExecutor(len(consumers)) as pool:
        t0 = time.perf_counter()
        return [f.result()[0] for f in [pool.submit(first_chunk, c.url, req, t0, timeout) for c in consumers]]


def placement(args, gpu: int | None) -> tuple[list[str], dict]:
    if gpu is None:
        return [], {}
    if args.gpu_placement == "flag":
        return ["--base-gpu-id", str(gpu)], {}
    return [], {"CUDA_VISIBLE_DEVICES": str(gpu)}


def has_base_gpu_id_flag() -> bool:
    out = subprocess.run([sys.executable, "-m", "sgl_kvxfer.launch_server", "--help"], capture_output=True, text=True,
                         timeout=300)
    return "--base-gpu-id" in out.stdout


def make_artifacts(args, server_args: list[str], n: int, out_dir: str) -> str:
    from sgl_kvxfer.models.arch_config import ModelArchConfig
    from sgl_kvxfer.models.loader import resolve_model_path
    from sgl_kvxfer.scd.artifacts import make_random_artifacts

    path = next((server_args[i + 1] for i, a in enumerate(server_args) if a == "--model-path"), None)
    arch = ModelArchConfig.from_dir(resolve_model_path(path))
    L, k = arch.num_hidden_layers, min(args.patch_count, arch.num_hidden_layers)
    patch = sorted({round(1 + i * (L - 2) / max(k - 1, 1)) for i in range(k)}) if k else []
    r_k, r_v = (min(r, arch.head_dim) for r in args.ranks[:2])
    levels = [(a, b) for a, b in args.rank_levels if a <= r_k and b <= r_v and (a, b) != (r_k, r_v)]
    make_random_artifacts(arch, n, r_k, r_v, min(args.ranks[2], arch.hidden_size), patch, seed=0,
                          rank_levels=levels).save(out_dir)
    return out_dir


def med(xs):
    return statistics.median(xs) if xs else None


def row(samples: list[list[float]]) -> dict:
    """samples: per repeat, one TTFT per specialist (s) -> ms statistics."""
    means, maxes = [1e3 * statistics.mean(s) for s in samples], [1e3 * max(s) for s in samples]
    return {"mean_ms": med(means), "max_ms": med(maxes), "max_ms_spread": [min(maxes), max(maxes)],
            "repeats": len(samples)}


def main(argv=None) -> str:
    args = parse_args(argv)
    if args.gpu_placement == "auto":
        args.gpu_placement = "flag" if (args.producer_gpu is not None and has_base_gpu_id_flag()) else "visible"
    server_args = shlex.split(args.server_args)
    if args.transfer_backend:
        server_args += ["--disaggregation-transfer-backend", args.transfer_backend]
    server_args = ["--kv-transfer-timeout", "120", *server_args]
    n_max = max(args.fanouts)
    gpus = args.consumer_gpus or [args.consumer_gpu] * n_max
    model = next((server_args[i + 1] for i, a in enumerate(server_args) if a == "--model-path"), "smollm2-135m")
    res = {"fanout": {}, "shared": {}, "ranks": {}}
    start = time.time()

    def emit(done: bool) -> str:
        payload = {"benchmark": "scd_e2e", "device": device_name("cuda" if "cuda" in args.server_args else "cpu"),
                   "commit": git_commit(), "model": model, "params": vars(args), "complete": done,
                   "link": "in-engine pacing; rate 0 = unpaced", "seconds": round(time.time() - start, 1),
                   "artifacts": manifest, **res, "summary": summarize(res)}
        path = write_json(args.name, payload, args.out_dir)
        plot(payload, path[:-5] + ".png")
        return path

    with tempfile.TemporaryDirectory(prefix="scd_e2e_") as tmp:
        arts = args.artifacts or make_artifacts(args, server_args + shlex.split(args.producer_args), n_max,
                                                os.path.join(tmp, "arts"))
        with open(os.path.join(arts, "manifest.json")) as f:
            m = json.load(f)
        manifest = {"random": args.artifacts is None, "ranks": [m["r_k"], m["r_v"], m["r_h"]],
                    "rank_levels": m.get("rank_levels", []),
                    "patch_layers": m["patch_layers"], "bytes_per_token": m["bytes_per_token"]}
        names = [c["name"] for c in m["consumers"]][:n_max]
        if len(names) < n_max:
            raise SystemExit(f"{arts} has {len(names)} consumers, --fanouts needs {n_max}")
        consumers = []
        try:
            with ThreadPoolExecutor(n_max) as pool:
                futs = []
                for i in range(n_max):
                    flag, env = placement(args, gpus[i])
                    a = [*server_args, *flag, *shlex.split(args.consumer_args), "--random-seed", str(100 + i),
                         *([] if args.no_trace else ["--enable-pd-trace"]),
                         "--scd-artifacts", arts, "--scd-consumer", names[i], "--disaggregation-mode", "decode"]
                    futs.append(pool.submit(start_server, a, env={**QUIET_HEALTH, **env}, name=f"scd_e2e_d{i}"))
                errors = [f.exception() for f in futs if f.exception() is not None]
                consumers = [f.result() for f in futs if f.exception() is None]
                if errors:
                    raise errors[0]
            for n_fan in args.fanouts:  # in the order given: a run cut short keeps the first
                try:
                    run_fanout(args, server_args, arts, consumers, n_fan, res, lambda: emit(False))
                except (RuntimeError, requests.RequestException) as e:  # the other N still run
                    res.setdefault("errors", {})[str(n_fan)] = f"{type(e).__name__}: {str(e)[:2000]}"
                    print(f"N={n_fan} failed: {e}", flush=True)
                emit(False)
            if args.rank_modes:
                try:
                    run_ranks(args, server_args, arts, consumers[0], res, lambda: emit(False))
                except (RuntimeError, requests.RequestException) as e:
                    res.setdefault("errors", {})["ranks"] = f"{type(e).__name__}: {str(e)[:2000]}"
                    print(f"rank modes failed: {e}", flush=True)
        finally:
            stop_all(*consumers)
    path = emit(True)
    print(json.dumps(res.get("summary", summarize(res)), indent=1))
    print("wrote", path)
    return path


def producer_args(args, server_args, arts, n_fan: int, bp: int, rank: str = "top", extra: str = "",
                  trace: bool = False) -> list[str]:
    flag, _ = placement(args, args.producer_gpu)
    return [*server_args, *flag, *shlex.split(args.producer_args), *shlex.split(extra), "--scd-artifacts", arts,
            "--scd-fanout", str(n_fan), *(["--enable-pd-trace"] if trace else []),
            "--scd-rank", rank, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bp),
            "--kv-transfer-rate-gbps", str(UNPACED_GBPS)]


def run_fanout(args, server_args, arts, consumers, n_fan: int, res: dict, emit=lambda: None) -> None:
    """emit(): rewrites the JSON, after the shared document and after each link rate (a run cut
    short keeps what finished)."""
    bp = free_port()
    _, env = placement(args, args.producer_gpu)
    p = {"h": start_server(producer_args(args, server_args, arts, n_fan, bp, trace=not args.no_trace),
                           env={**QUIET_HEALTH, **env},
                           name=f"scd_e2e_p{n_fan}"), "bp": bp, "trace": not args.no_trace}
    cons = consumers[:n_fan]
    seed = 1000 * n_fan
    try:
        set_link(p, 0)  # started with --enable-pd-trace: untraced until a traced request asks
        for n in args.prompt_tokens:  # warm-up: kernels for these shapes, first-request costs
            scd_request(p, cons, ids_for(n, -n, args.vocab), args.timeout_s)
            oracle_request(cons, ids_for(n, -n - 1, args.vocab), args.timeout_s)
        if n_fan == 1 and not args.skip_shared:  # before the fan-out rows: a run cut short keeps it
            run_shared(args, p, cons[0], res)
            emit()
        out = res["fanout"].setdefault(str(n_fan), {})
        for n in args.prompt_tokens:
            orc = [oracle_request(cons, ids_for(n, seed := seed + 1, args.vocab), args.timeout_s)
                   for _ in range(args.repeats)]
            out.setdefault(str(n), {})["oracle"] = row(orc)
            print(f"N={n_fan} {n} tokens oracle: {out[str(n)]['oracle']}", flush=True)
        for rate in args.rates:
            set_link(p, rate)
            for n in args.prompt_tokens:
                runs = [scd_request(p, cons, ids_for(n, seed := seed + 1, args.vocab), args.timeout_s)
                        for _ in range(args.repeats)]
                kv = [meta.get("kv_transfer", {}) for r in runs for _, meta in r]
                out[str(n)][f"scd@{rate:g}"] = {**row([[t for t, _ in r] for r in runs]),
                                                "bytes_per_token": med([k.get("bytes_per_token", 0) for k in kv]),
                                                "wire_ms": med([k.get("wire_ms", 0) for k in kv]),
                                                "link_gbps": med([k.get("link_gbps", 0) for k in kv])}
                print(f"N={n_fan} {n} tokens {rate:g} Gbit/s: {out[str(n)][f'scd@{rate:g}']}", flush=True)
                tr = traced_request(p, cons, ids_for(n, seed := seed + 1, args.vocab), rate, args.timeout_s)
                if tr is not None:
                    out[str(n)][f"scd@{rate:g}"]["trace"] = tr
            emit()
    finally:
        stop_all(p["h"])


def run_shared(args, p: dict, consumer, res: dict) -> None:
    """The document enters the producer's radix cache with a first request; then new questions."""
    for n in args.prompt_tokens:
        doc = ids_for(n - args.question_tokens, 7 + n, args.vocab)
        scd_request(p, [consumer], doc + ids_for(args.question_tokens, 1, args.vocab), args.timeout_s)
        scd_request(p, [consumer], doc + ids_for(args.question_tokens, 2, args.vocab), args.timeout_s)  # warm
        # the oracle is the specialist prefilling document + question cold: every oracle request
        # carries its own document, or the specialist's radix cache would hold it after the first
        fresh_doc = lambda i: ids_for(n - args.question_tokens, 500_000 + 1000 * n + i, args.vocab)
        oracle_request([consumer], fresh_doc(0) + ids_for(args.question_tokens, 3, args.vocab), args.timeout_s)
        out = res["shared"].setdefault(str(n), {})
        for rate in args.rates:
            set_link(p, rate)
            runs = [scd_request(p, [consumer], doc + ids_for(args.question_tokens, 100 + 10 * rate + i, args.vocab),
                                args.timeout_s) for i in range(args.repeats)]
            out[f"scd@{rate:g}"] = row([[t for t, _ in r] for r in runs])
            tr = traced_request(p, [consumer], doc + ids_for(args.question_tokens, 99 + 10 * rate, args.vocab), rate,
                                args.timeout_s)
            if tr is not None:
                out[f"scd@{rate:g}"]["trace"] = tr
        orc = [oracle_request([consumer], fresh_doc(1 + i) + ids_for(args.question_tokens, 50 + i, args.vocab),
                              args.timeout_s) for i in range(args.repeats)]
        out["oracle"] = row(orc)
        print(f"shared document, {n} tokens: {out}", flush=True)


def run_ranks(args, server_args, arts, consumer, res: dict, emit) -> None:
    """One producer per --scd-rank mode, all up at once on the producer GPU; N = 1. At each rate
    the modes take turns (new documents each), so drift over the run weighs on all alike."""
    _, env = placement(args, args.producer_gpu)
    ps = {}
    try:
        with ThreadPoolExecutor(len(args.rank_modes)) as pool:
            futs = {}
            for mode in args.rank_modes:
                bp = free_port()
                futs[mode] = (pool.submit(start_server, producer_args(args, server_args, arts, 1, bp, mode, args.rank_producer_args),
                                          env={**QUIET_HEALTH, **env}, name=f"scd_e2e_r{mode.replace(':', '_')}"), bp)
            for mode, (f, bp) in futs.items():
                if f.exception() is None:
                    ps[mode] = {"h": f.result(), "bp": bp}
            failed = next((f.exception() for f, _ in futs.values() if f.exception() is not None), None)
            if failed is not None:
                raise RuntimeError(f"a rank-mode producer did not start: {failed}")
        n = max(args.prompt_tokens)
        seed = 900_000
        for mode, p in ps.items():  # warm-up, and auto's first prefill-speed observation
            for _ in range(2):
                scd_request(p, [consumer], ids_for(n, seed := seed + 1, args.vocab), args.timeout_s)
        out = res["ranks"].setdefault(str(n), {})
        for rate in args.rates:
            runs = {mode: [] for mode in ps}
            for mode, p in ps.items():
                requests.post(p["h"].url + "/kv_transfer_link", json={"rate_gbps": rate or UNPACED_GBPS},
                              timeout=30).raise_for_status()
            for _ in range(args.rank_repeats):
                for mode, p in ps.items():
                    runs[mode].append(scd_request(p, [consumer], ids_for(n, seed := seed + 1, args.vocab), args.timeout_s))
            for mode, rs in runs.items():
                kv = [meta.get("kv_transfer", {}) for r in rs for _, meta in r]
                out.setdefault(mode, {})[f"scd@{rate:g}"] = {
                    **row([[t for t, _ in r] for r in rs]),
                    "bytes_per_token": med([k.get("bytes_per_token", 0) for k in kv]),
                    "wire_ms": med([k.get("wire_ms", 0) for k in kv])}
                print(f"rank {mode}, {n} tokens, {rate:g} Gbit/s: {out[mode][f'scd@{rate:g}']}", flush=True)
            emit()
        for mode, p in ps.items():
            info = requests.get(p["h"].url + "/server_info", timeout=30).json().get("internal_states") or [{}]
            out.setdefault(mode, {})["level_counts"] = info[0].get("kv_transfer", {}).get("scd", {}).get("level_counts")
    finally:
        stop_all(*[p["h"] for p in ps.values()])


def summarize(res: dict) -> dict:
    """Speed-up of SCD over each specialist's own prefill: oracle / SCD, on the max over the N
    specialists (when the last one answers) and on their mean."""
    out = {"fanout": {}, "shared": {}, "ranks": {}}
    for n_fan, by_n in res["fanout"].items():
        for n, r in by_n.items():
            if "oracle" not in r:
                continue
            for key, v in r.items():
                if key.startswith("scd@") and v["max_ms"]:
                    out["fanout"][f"N={n_fan} {n} tokens {key}"] = {
                        "speedup_max": r["oracle"]["max_ms"] / v["max_ms"], "speedup_mean": r["oracle"]["mean_ms"] / v["mean_ms"]}
    for n, r in res["shared"].items():
        for key, v in r.items():
            if key.startswith("scd@") and "oracle" in r:
                out["shared"][f"{n} tokens {key}"] = r["oracle"]["mean_ms"] / v["mean_ms"]
    out["trace"] = {}  # the traced request of each point: its consumers' phases (ms), median over them
    for label, r in [(f"N={n_fan} {n} tokens {key}", v) for n_fan, by_n in res["fanout"].items()
                     for n, rr in by_n.items() for key, v in rr.items()] + \
            [(f"shared {n} tokens {key}", v) for n, rr in res["shared"].items() for key, v in rr.items()]:
        if isinstance(r, dict) and r.get("trace"):
            out["trace"][label] = trace_summary(r["trace"])
    for n, by_mode in res.get("ranks", {}).items():  # auto's TTFT over the best fixed mode's, per rate
        fixed = {m: r for m, r in by_mode.items() if m != "auto"}
        for key, v in by_mode.get("auto", {}).items():
            if not key.startswith("scd@"):
                continue
            best = min((r[key]["mean_ms"] for r in fixed.values() if key in r), default=None)
            if best:
                out["ranks"][f"{n} tokens {key}"] = {"auto_over_best_fixed": v["mean_ms"] / best}
    return out


def trace_summary(traces: list[dict]) -> dict:
    """Per phase kind (disagg/trace.py's by_phase_ms: summed over a kind's spans), the rebuild's
    device time by part, the server-side TTFT (ttft_ms) and the client's: medians over the
    traced request's consumers."""
    rows = []
    for t in traces:
        tr = t.get("trace") or {}
        row_ = {**{k: v for k, v in (tr.get("by_phase_ms") or {}).items()},
                **{f"rebuild_gpu.{k}": v for k, v in (t.get("rebuild_gpu_ms") or {}).items()},
                **{f"rebuild_host.{k}": v for k, v in (t.get("rebuild_host_ms") or {}).items()},
                **{f"rebuild_cuda_alloc.{k}": v for k, v in (t.get("rebuild_cuda_alloc") or {}).items()},
                "critical_ms": tr.get("critical_ms"), "ttft_ms": tr.get("ttft_ms"),
                "unaccounted_ms": tr.get("unaccounted_ms"), "client_ttft_ms": t.get("client_ttft_ms")}
        rows.append({k: v for k, v in row_.items() if v is not None})
    keys = sorted({k for r in rows for k in r})
    return {k: round(med([r[k] for r in rows if k in r]), 3) for k in keys}


def plot(p: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(17, 4.2))
    n = str(max(p["params"]["prompt_tokens"]))
    plotted = False  # a log axis with no positive point raises: a run whose SCD rows all failed plots linear
    for j, (n_fan, by_n) in enumerate(sorted(p["fanout"].items(), key=lambda x: int(x[0]))):
        r = by_n.get(n, {})
        keys = [k for k in r if k.startswith("scd@")]
        xs = [float(k[4:]) or max(p["params"]["rates"]) * 4 for k in keys]
        ax[0].plot(xs, [r[k]["max_ms"] for k in keys], "o-", c=f"C{j}", label=f"SCD, N={n_fan}")
        plotted = plotted or any(x > 0 for x in xs)
        if "oracle" in r:
            ax[0].axhline(r["oracle"]["max_ms"], ls=":", c=f"C{j}", label=f"own prefill, N={n_fan}")
    if plotted:
        ax[0].set_xscale("log")
    ax[0].set_xlabel("link rate (Gbit/s; rightmost: unpaced)")
    ax[0].set_ylabel("TTFT of the last specialist (ms)")
    ax[0].set_title(f"fan-out, {n}-token document, producer prefill included", fontsize=9)
    ax[0].legend(fontsize=7)
    r = p["shared"].get(n, {})
    keys = [k for k in r if k.startswith("scd@")]
    if keys:
        ax[1].bar(keys + ["oracle"], [r[k]["mean_ms"] for k in keys] + [r.get("oracle", {}).get("mean_ms", 0)])
    ax[1].set_ylabel("TTFT (ms)")
    ax[1].set_title("document in the producer's radix cache, new question", fontsize=9)
    by_mode = p.get("ranks", {}).get(n, {})
    for j, (mode, r) in enumerate(by_mode.items()):
        keys = [k for k in r if k.startswith("scd@")]
        xs = [float(k[4:]) or max(p["params"]["rates"]) * 4 for k in keys]
        order = sorted(range(len(xs)), key=xs.__getitem__)
        ax[2].plot([xs[i] for i in order], [r[keys[i]]["mean_ms"] for i in order], "o-" if mode == "auto" else "s--",
                   c=f"C{j}", label=f"--scd-rank {mode}")
    if by_mode:
        ax[2].set_xscale("log")
        ax[2].legend(fontsize=7)
    ax[2].set_xlabel("link rate (Gbit/s; rightmost: unpaced)")
    ax[2].set_ylabel("TTFT (ms)")
    ax[2].set_title("adaptive rank vs fixed nested levels, N=1", fontsize=9)
    fig.suptitle(f"SCD end to end: {os.path.basename(p['model'].rstrip('/'))}, {p['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    with open(main()) as f:
        failed = json.load(f).get("errors")
    if failed:  # the rows that ran are written; the exit status tells a failed fan-out from a clean run
        print(f"failed fan-outs: {failed}", file=sys.stderr)
        sys.exit(1)
