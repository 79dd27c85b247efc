"""SCD over PD end to end on CPU: a producer prefill server and specialist decode servers with
other weights (a tiny random Llama pair, test/scd/scd_tiny.py), Mooncake over loopback TCP and
the real `sglang_router` 0.3.2 in front of (P, D_a).

Every consumer reply is checked against an in-process reference of the same pipeline
(sgl_kvxfer/scd/calib/forward.py: the producer's prefill of the prompt's first n - 1 tokens, encode,
the consumer's decode, then the consumer's own forward of the last prompt token and greedy
steps): first-token logprobs and greedy tokens. The consumer's own full prefill (the oracle)
gives other logprobs, so the comparison can tell SCD from a local prefill.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import random
import sys
import time

import pytest
import requests
import torch

from servers import ROOT, Deadline, free_port, scaled, start_all, start_router, stop_all

sys.path.insert(0, os.path.join(ROOT, "test", "scd"))
from scd_tiny import TINY, perturbed, tiny_state, write_model  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    __import__("importlib").util.find_spec("sglang_router") is None, reason="sglang-router is not installed")]

TIMEOUT = "5"  # --kv-transfer-timeout, seconds: unclaimed fan-out rooms close after it
COMMON = ["--device", "cpu", "--max-total-tokens", "4096", "--chunked-prefill-size", "16", "--max-running-requests", "8",
          "--context-length", "512", "--log-level", "warning", "--enable-metrics", "--kv-transfer-buffer-mb", "16",
          "--kv-transfer-timeout", TIMEOUT]
ROOM_CORRUPT = 9301
PATCH = [2]
LEVELS = ((2, 2), (4, 4))  # nested levels below the top (8, 8)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Producer P and consumers a, b (P's weights + noise); artifacts calibrated for exactly these
    weights (random tensors, real identities), and another run's artifacts (other encoders)."""
    from sgl_kvxfer.models.arch_config import ModelArchConfig
    from sgl_kvxfer.scd.artifacts import make_random_artifacts
    from sgl_kvxfer.scd.identity import identify

    root = tmp_path_factory.mktemp("scd_serving")
    sd = tiny_state(TINY, 0)
    dirs = {"producer": write_model(root / "producer", TINY, sd), "a": write_model(root / "a", TINY, perturbed(sd, 0.15, 1)),
            "b": write_model(root / "b", TINY, perturbed(sd, 0.3, 2))}
    arch = ModelArchConfig.from_dir(dirs["producer"])
    out = {}
    for run, seed in (("arts", 0), ("other", 1)):
        arts = make_random_artifacts(arch, ["a", "b"], 8, 8, 32, PATCH, seed=seed, dtype="float32",
                                     rank_levels=LEVELS)
        manifest = dataclasses.replace(arts.manifest, producer=identify(dirs["producer"], name="producer"),
                                       consumers=(identify(dirs["a"], name="a"), identify(dirs["b"], name="b")))
        out[run] = str(root / run)
        type(arts)(manifest, arts.tensors).save(out[run])
        if run == "arts":  # the same fits with int4 codes on the wire
            out["arts_int4"] = str(root / "arts_int4")
            type(arts)(dataclasses.replace(manifest, dtype="int4"), arts.tensors).save(out["arts_int4"])
    return {**dirs, **out}


@pytest.fixture(scope="module")
def cluster(pair):
    bp = free_port()

    def role(mode, model, arts, *extra):
        return [*COMMON, "--model-path", pair[model], "--disaggregation-mode", mode, "--scd-artifacts", pair[arts], *extra]

    bp2 = free_port()
    p, p2, da, db, dx = start_all([
        (role("prefill", "producer", "arts", "--disaggregation-bootstrap-port", str(bp), "--scd-fanout", "2",
              "--enable-pd-trace"),
         {"SGL_KVXFER_KV_TRANSFER_FAULT": f"corrupt@{ROOM_CORRUPT}"}, "scd_prefill"),
        (role("prefill", "producer", "arts", "--disaggregation-bootstrap-port", str(bp2), "--scd-rank", "2:2"),
         None, "scd_prefill_level"),
        (role("decode", "a", "arts", "--enable-pd-trace"), None, "scd_decode_a"),
        (role("decode", "b", "arts"), None, "scd_decode_b"),
        (role("decode", "a", "other"), None, "scd_decode_other")])
    try:
        router = start_router([(p.url, bp)], [da.url])
    except Exception:
        stop_all(p, p2, da, db, dx)
        raise
    yield {"P": p, "P2": p2, "bp2": bp2, "a": da, "b": db, "other": dx, "router": router, "bp": bp, "pair": pair}
    stop_all(router, p, p2, da, db, dx)


# ---------------------------------------------------------------- the in-process reference
@pytest.fixture(scope="module")
def reference(pair):
    """reference(consumer, prompt, steps) -> (first-token logprobs [V], greedy tokens);
    oracle(consumer, prompt) -> the consumer's own full-prefill first-token logprobs."""
    from sgl_kvxfer.models.loader import load_model
    from sgl_kvxfer.scd import ScdArtifacts, ScdDecoder, ScdEncoder, kv_projections
    from sgl_kvxfer.scd.calib.forward import KVCache, LlamaRunner, left_pad

    models = {k: load_model(pair[k], "auto", torch.float32, "cpu", 0)[0] for k in ("producer", "a", "b")}
    loaded = {key: ScdArtifacts.load(pair[key]) for key in ("arts", "arts_int4")}
    layers = range(TINY["num_hidden_layers"])

    def scd(consumer, prompt, steps, level=None, arts_key="arts"):
        arts = loaded[arts_key]
        enc, dec, mc = ScdEncoder(arts), ScdDecoder(arts, consumer), models[consumer]
        projs = kv_projections(mc)
        ids, valid, pos = left_pad([prompt[:-1]])
        taps = LlamaRunner(models["producer"]).forward(ids, pos, valid, kv_layers=layers, h_layers=PATCH)
        p, ks, vs = pos[0], [], []
        for layer in layers:
            if layer in PATCH:
                k, v = dec.regenerate_patch(layer, enc.encode_patch(layer, taps.h[layer][0]), p, projs[layer])
            else:
                k, v = dec.decode_reuse(layer, *enc.encode_reuse(layer, taps.k[layer][0], taps.v[layer][0], p, level), p)
            ks.append(k[None])
            vs.append(v[None])
        cache, runner = KVCache(ks, vs, valid), LlamaRunner(mc)
        last, at = torch.tensor([[prompt[-1]]]), torch.tensor([[len(prompt) - 1]])
        logits = runner.forward(last, at, torch.ones(1, 1, dtype=torch.bool), past=cache, logits="last").logits
        return torch.log_softmax(logits[0, -1], -1), runner.greedy(cache, last[0], at[0], steps)[0]

    def oracle(consumer, prompt):
        ids, valid, pos = left_pad([prompt])
        return torch.log_softmax(LlamaRunner(models[consumer]).forward(ids, pos, valid, logits="last").logits[0, -1], -1)

    return scd, oracle


def prompt_ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def body(prompt, steps=6, **extra):
    return {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 5,
            "sampling_params": {"max_new_tokens": steps, "temperature": 0, "ignore_eos": True}, **extra}


def assert_matches(reply, ref_logprobs, ref_tokens):
    top = reply["meta_info"]["output_top_logprobs"][0]
    got = torch.tensor([lp for lp, *_ in top])
    assert [t for _, t, *_ in top] == ref_logprobs.topk(5).indices.tolist()
    assert torch.allclose(got, ref_logprobs.topk(5).values, atol=2e-3), (got, ref_logprobs.topk(5).values)
    assert reply["output_ids"] == ref_tokens


def post(url, payload, timeout=scaled(120)):
    r = requests.post(url + "/generate", json=payload, timeout=scaled(timeout))
    assert r.status_code == 200, r.text
    return r.json()


def direct(cluster, payload, room, decodes):
    """What the router does, to P and each decode at once; returns (P's reply, decode replies)."""
    payload = {**payload, "bootstrap_host": "127.0.0.1", "bootstrap_port": cluster["bp"], "bootstrap_room": room}
    with cf.ThreadPoolExecutor(1 + len(decodes)) as pool:
        fp = pool.submit(requests.post, cluster["P"].url + "/generate", json=payload, timeout=scaled(120))
        fds = [pool.submit(requests.post, cluster[d].url + "/generate", json=payload, timeout=scaled(120)) for d in decodes]
        return fp.result(), [f.result() for f in fds]


def transfer_state(handle):
    return requests.get(handle.url + "/server_info", timeout=scaled(30)).json()["internal_states"][0]


def producer_counts(cluster) -> tuple[int, int]:
    """(prefills whose codes P encoded, consumers P served successfully)."""
    kv = transfer_state(cluster["P"])["kv_transfer"]
    return kv["scd"]["encoded"]["rooms"], kv["rooms"].get("ok", 0)


# ---------------------------------------------------------------- tests
def test_router_drives_scd_and_the_consumer_decodes_its_own_tokens(cluster, reference):
    scd, oracle = reference
    prompt = prompt_ids(41, 1)
    reply = post(cluster["router"].url, body(prompt))
    kv = reply["meta_info"]["kv_transfer"]
    assert kv["status"] == "ok" and kv["scd"]["consumer"] == "a"
    # codes of the first n - 1 positions, float32: (3 reuse layers x 2 kv heads x (8 + 8) + 1 patch layer x 32) x 4 B
    assert kv["bytes"] == (3 * 2 * 16 + 32) * 4 * 40 and reply["meta_info"]["prompt_tokens"] == 41
    ref_lp, ref_tokens = scd("a", prompt, 6)
    assert_matches(reply, ref_lp, ref_tokens)
    # the oracle (a's own prefill) differs by far more than the tolerance: the check sees SCD
    assert (oracle("a", prompt) - ref_lp).abs().max() > 0.05


def test_one_prefill_feeds_two_specialists(cluster, reference):
    from sgl_kvxfer.disagg.scd_fanout import fanout_generate

    scd, _ = reference
    prompt = prompt_ids(37, 2)
    before = producer_counts(cluster)
    ra, rb = fanout_generate(body(prompt), [cluster["b"].url], router=cluster["router"].url)
    ka, kb = ra["meta_info"]["kv_transfer"], rb["meta_info"]["kv_transfer"]
    assert ka["status"] == kb["status"] == "ok" and ka["bootstrap_room"] == kb["bootstrap_room"]
    assert (ka["scd"]["consumer"], kb["scd"]["consumer"]) == ("a", "b")
    assert_matches(ra, *scd("a", prompt, 6))
    assert_matches(rb, *scd("b", prompt, 6))
    # one prefill on P (its codes encoded once), its room served twice, and no local prefill on
    # either consumer (status ok above: no fallback)
    after = producer_counts(cluster)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 2)


def test_fanout_without_router_and_a_third_claim_is_refused(cluster, reference):
    from sgl_kvxfer.disagg.scd_fanout import fanout_generate

    scd, oracle = reference
    prompt = prompt_ids(23, 3)
    ra, rb = fanout_generate(body(prompt), [cluster["a"].url, cluster["b"].url], prefill=(cluster["P"].url, cluster["bp"]))
    assert_matches(ra, *scd("a", prompt, 6))
    assert_matches(rb, *scd("b", prompt, 6))
    room = ra["meta_info"]["kv_transfer"]["bootstrap_room"]
    # the room served its --scd-fanout 2: a third claim is refused and that consumer prefills itself
    late = post(cluster["a"].url, {**body(prompt), "bootstrap_host": "127.0.0.1", "bootstrap_port": cluster["bp"],
                                   "bootstrap_room": room})
    assert late["meta_info"]["kv_transfer"]["status"].startswith("fallback: prefill failed: room closed")
    assert (torch.tensor([lp for lp, *_ in late["meta_info"]["output_top_logprobs"][0]])
            - oracle("a", prompt).topk(5).values).abs().max() < 2e-3


def test_mismatched_artifacts_fail_the_request_clearly(cluster):
    rp, (rx,) = direct(cluster, body(prompt_ids(20, 4)), 9302, ["other"])
    assert rp.status_code == 200
    assert rx.status_code == 400 and "SCD artifacts differ" in rx.text, rx.text


def test_corrupt_codes_fall_back_to_the_consumers_own_prefill(cluster, reference):
    _, oracle = reference
    prompt = prompt_ids(30, 5)
    rp, (ra,) = direct(cluster, body(prompt), ROOM_CORRUPT, ["a"])
    assert rp.status_code == 200 and ra.status_code == 200, ra.text
    reply = ra.json()
    assert reply["meta_info"]["kv_transfer"]["status"].startswith("fallback: checksum mismatch")
    got = torch.tensor([lp for lp, *_ in reply["meta_info"]["output_top_logprobs"][0]])
    assert (got - oracle("a", prompt).topk(5).values).abs().max() < 2e-3


def test_a_lower_rank_level_and_a_cached_prefix(cluster, reference):
    """P2 sends codes at level 2:2 (--scd-rank): the consumer reads the level from the segment
    and decodes as the in-process reference at that level. A second prompt sharing a prefix
    with the first takes it from P2's radix cache (its patch codes from the zh pool) and still
    decodes exactly as a full prefill's codes would."""
    scd, _ = reference
    first = prompt_ids(48, 7)
    second = first[:40] + prompt_ids(9, 8)
    for prompt, room in ((first, 9401), (second, 9402)):
        payload = {**body(prompt), "bootstrap_host": "127.0.0.1", "bootstrap_port": cluster["bp2"], "bootstrap_room": room}
        with cf.ThreadPoolExecutor(2) as pool:
            fp = pool.submit(requests.post, cluster["P2"].url + "/generate", json=payload, timeout=120)
            reply = post(cluster["a"].url, payload)
            rp = fp.result().json()
        kv = reply["meta_info"]["kv_transfer"]
        assert kv["status"] == "ok" and rp["meta_info"]["kv_transfer"]["scd_level"] == [2, 2]
        assert kv["bytes"] == (3 * 2 * 4 + 32) * 4 * (len(prompt) - 1)
        assert_matches(reply, *scd("a", prompt, 6, level=(2, 2)))
    assert rp["meta_info"]["cached_tokens"] >= 32  # the second prompt's prefix came from the radix cache
    levels = transfer_state(cluster["P2"])["kv_transfer"]["scd"]["level_counts"]
    assert levels["2:2"] == 2 and levels["8:8"] == 0


def test_traced_phases_and_a_cached_document_goes_ahead_of_the_question(cluster, reference):
    """P and a trace (--enable-pd-trace): the reply's trace holds the SCD phases of both sides,
    and `ttft_ms` ends with the consumer's first decode step. A document already in P's radix
    cache goes out as a segment of its own, coded before the question's forward is launched,
    and the consumer still decodes exactly as from a full prefill's codes."""
    scd, _ = reference
    doc = prompt_ids(40, 21)
    for i, room in enumerate((9501, 9502)):
        prompt = doc + prompt_ids(9, 22 + i)
        rp, (ra,) = direct(cluster, body(prompt), room, ["a"])
        assert rp.status_code == 200 and ra.status_code == 200, ra.text
        reply = ra.json()
        assert_matches(reply, *scd("a", prompt, 6))
    kv = reply["meta_info"]["kv_transfer"]
    cached = rp.json()["meta_info"]["cached_tokens"]
    assert kv["status"] == "ok" and cached >= 32
    trace = kv["trace"]
    phases = {name: (start, dur) for name, start, dur in trace["phases"]}
    for name in ("p.queue", "p.code[0]", "p.pack[0]", "p.wire[0]", "p.notice", "d.bootstrap", "d.unpack[0]",
                 "d.admit", "d.first_step"):
        assert name in phases, (name, sorted(phases))
    first_forward = min(start for name, start, _ in trace["phases"] if name.startswith("p.prefill["))
    assert phases["p.pack[0]"][0] + phases["p.pack[0]"][1] <= first_forward + 1e-3  # the document's codes first
    assert trace["ttft_ms"] >= trace["critical_ms"] > 0
    assert trace["ttft_ms"] == pytest.approx(sum(phases["d.first_step"]), abs=1e-2)
    assert set(kv["rebuild_gpu_ms"]) == {"unpack_codes", "reuse", "patch", "kv_write"}
    assert set(kv["rebuild_host_ms"]) == set(kv["rebuild_gpu_ms"])
    unpacked = sum(dur for name, _, dur in trace["phases"] if name.startswith("d.unpack["))
    assert 0 < sum(kv["rebuild_host_ms"].values()) <= unpacked + 0.05  # parts of the unpack spans
    assert kv["segments"] >= 2  # the cached document, then the question's chunk(s)


def test_unclaimed_rooms_close_and_nothing_leaks(cluster):
    """Every room above that got fewer than 2 consumers closes after the timeout; then no
    server holds KV, rooms, send-buffer or staging bytes."""
    time.sleep(float(TIMEOUT) + 1)
    for name in ("P", "P2", "a", "b", "other"):
        deadline = Deadline(30)
        while True:
            requests.post(cluster[name].url + "/flush_cache", timeout=scaled(30))
            st = transfer_state(cluster[name])
            kv = st["kv_transfer"]
            if st["kv_used_tokens"] == 0 and not kv["rooms_open"] and not kv.get("send_buffer_used_bytes") \
                    and not kv.get("staging_used_bytes"):
                break
            assert not deadline.expired(), (name, st, str(deadline))
            time.sleep(0.5)
    closed = transfer_state(cluster["P"])["kv_transfer"]["scd"]["rooms_closed"]
    assert closed.get("served", 0) >= 2 and closed.get("fan-out timed out", 0) >= 3, closed


@pytest.mark.heavy  # about 25 s on 2 cores: CI leaves it out (README, Tests)
def test_int4_codes_over_the_wire(pair, reference):
    """Artifacts whose manifest sends int4 codes: the producer quantises and packs them, the
    consumer unpacks and decodes exactly as the in-process reference with the same artifacts, at
    the quantised bytes (integers + one bf16 scale per token and field)."""
    from sgl_kvxfer.mem_cache.scd_quant import field_bytes

    scd, oracle = reference
    bp = free_port()

    def role(mode, model, *extra):
        return [*COMMON, "--model-path", pair[model], "--disaggregation-mode", mode, "--scd-artifacts",
                pair["arts_int4"], *extra]

    p, da = start_all([(role("prefill", "producer", "--disaggregation-bootstrap-port", str(bp)), None, "scd_int4_prefill"),
                       (role("decode", "a"), None, "scd_int4_decode")])
    try:
        prompt = prompt_ids(33, 11)
        payload = {**body(prompt), "bootstrap_host": "127.0.0.1", "bootstrap_port": bp, "bootstrap_room": 9401}
        with cf.ThreadPoolExecutor(2) as pool:
            fp = pool.submit(requests.post, p.url + "/generate", json=payload, timeout=scaled(120))
            fa = pool.submit(requests.post, da.url + "/generate", json=payload, timeout=scaled(120))
            rp, ra = fp.result(), fa.result()
        assert rp.status_code == 200 and ra.status_code == 200, ra.text
        reply = ra.json()
        kv = reply["meta_info"]["kv_transfer"]
        assert kv["status"] == "ok", kv
        per_token = 3 * (field_bytes(2 * 8, 4) + field_bytes(2 * 8, 4)) + field_bytes(32, 4)
        assert kv["bytes"] == per_token * 32
        ref_lp, ref_tokens = scd("a", prompt, 6, arts_key="arts_int4")
        assert_matches(reply, ref_lp, ref_tokens)
        # int4 is not the float codes: the reference moved, and the served reply followed it
        assert (scd("a", prompt, 6)[0] - ref_lp).abs().max() > 1e-4
    finally:
        stop_all(p, da)
