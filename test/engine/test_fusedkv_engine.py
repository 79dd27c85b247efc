"""FusedKV / FusedKV-Lite in the engine (CPU, fp32, a 4-layer model: layers 0-1 store KV,
layers 2-3 rebuild it from layers 0 and 1).

1. Fusion wiring: the engine's prompt and output logprobs equal an engine-independent forward
   from the checkpoint tensors (fusion weights read from safetensors; the checkpoint's k/v rows
   of the reconstruction layers are ignored).
2. Prefill skip: the logits of a prefill whose top half runs only the logits rows equal those
   of a prefill whose top half runs every token; a chunked prefill's first chunk runs no
   reconstruction layer and its last chunk gives the one-shot logits.
3. Radix hits + chunked prefill + retraction: greedy outputs equal a run with none of them.
"""
import random

import pytest
import torch
from fusedkv_helpers import TINY, extend_batch, random_tensors, reference_logits, write_model

VARIANTS = ("fusedkv", "lite")


@pytest.fixture(scope="module", params=VARIANTS)
def model_dir(request, tmp_path_factory):
    return write_model(str(tmp_path_factory.mktemp(f"fkv_{request.param}")), request.param, seed=3)


def _cfg(variant):
    return {**TINY, "fusedkv": {"variant": variant}}


def _prompts(seed, lens):
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY["vocab_size"]) for _ in range(n)] for n in lens]


def test_logprobs_match_checkpoint_reference(model_dir):
    from sgl_kvxfer import Engine

    variant = "lite" if "lite" in model_dir else "fusedkv"
    cfg = _cfg(variant)
    tensors = random_tensors(cfg, seed=3)
    prompts = _prompts(0, (23, 40))
    with Engine(model_dir, max_total_tokens=512, chunked_prefill_size=16) as eng:
        out = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1, "temperature": 0},
                           return_logprob=True, logprob_start_len=0)
        eng.flush_cache()  # scoring only (no sampled token: the rows stop short of the last token)
        scored = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 0},
                              return_logprob=True, logprob_start_len=5)
        info = eng.get_server_info()
    for ids, o in zip(prompts, out):
        ref = torch.log_softmax(reference_logits(cfg, tensors, ids), -1)
        got = [lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]]
        want = [float(ref[j - 1, ids[j]]) for j in range(1, len(ids))]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=2e-4, rtol=0)
        got = [lp for lp, _, _ in scored[prompts.index(ids)]["meta_info"]["input_token_logprobs"][1:]]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want[5:]), atol=2e-4, rtol=0)
        first = o["output_ids"][0]
        assert first == int(ref[-1].argmax())
        assert abs(o["meta_info"]["output_token_logprobs"][0][0] - float(ref[-1, first])) < 2e-4
    fkv = info["extra"]["fusedkv"]
    assert fkv["storage_map"] == [True, True, False, False] and fkv["kv_bytes_ratio_vs_vanilla"] == 0.5
    assert info["kv_bytes_per_token"] == fkv["kv_vanilla_bytes_per_token"] / 2


def _count_rows(runner):
    """Record the query rows each reconstruction-layer call gets."""
    seen, backend = [], runner.attn_backend
    inner = backend.forward_reconstruct

    def spy(q, layer_id, batch, recon):
        seen.append(q.shape[0])
        return inner(q, layer_id, batch, recon)

    backend.forward_reconstruct = spy
    return seen


def test_prefill_skip_logits_equal_full_prefill(model_dir):
    from sgl_kvxfer.config import ServerArgs
    from sgl_kvxfer.engine.model_runner import ModelRunner

    cfg = ServerArgs.from_flat(model_path=model_dir, max_total_tokens=512).scheduler.engine
    runner = ModelRunner(cfg)
    a, b, c = _prompts(1, (37, 21, 30))
    rows = [runner.req_to_token.alloc() for _ in range(4)]
    seen = _count_rows(runner)
    # one batch: a samples (its last token), b wants 5 prompt-logprob rows + its sample row, c
    # scores positions 3 .. 28 without sampling (its last token has no logits row)
    runs = [(rows[0], a, 0, len(a), 1), (rows[1], b, 0, len(b), 6), (rows[3], c, 0, len(c), (3, 26))]
    logits = {}
    for skip, spans in ((True, True), (True, False), (False, True)):
        runner.model.skip_prefill_rows = skip
        seen.clear()
        logits[skip, spans] = runner.forward(extend_batch(runner, runs, spans=spans))
        assert seen == ([33] if skip else [len(a) + len(b) + len(c)]) * 2, seen  # two reconstruction layers
    assert logits[True, True].shape == (33, TINY["vocab_size"])
    torch.testing.assert_close(logits[True, True], logits[False, True], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[True, False], logits[False, True], atol=1e-5, rtol=1e-5)
    logits[False] = logits[False, True]

    # chunked: a in two chunks; the first produces no logits and runs no reconstruction layer
    runner.model.skip_prefill_rows = True
    seen.clear()
    first = runner.forward(extend_batch(runner, [(rows[2], a, 0, 20, 0)]))
    assert first.shape[0] == 0 and seen == []
    last = runner.forward(extend_batch(runner, [(rows[2], a, 20, len(a), 1)]))
    assert seen == [1, 1]
    torch.testing.assert_close(last, logits[False][:1], atol=1e-5, rtol=1e-5)


def test_radix_chunked_retraction_unchanged(model_dir, monkeypatch):
    """Shared prefixes (radix hits), 16-token chunks and, with the decode reserve off in a small
    pool, retractions: greedy outputs equal a one-request-at-a-time run with neither."""
    import sgl_kvxfer.scheduler.batch_formation as sched
    from sgl_kvxfer import Engine

    rng = random.Random(5)
    stem = _prompts(2, (40,))[0]
    prompts = [stem + [rng.randrange(3, 128) for _ in range(rng.randrange(3, 20))] for _ in range(12)]
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with Engine(model_dir, max_total_tokens=2048, chunked_prefill_size=4096, disable_radix_cache=True,
                max_running_requests=1) as ref_eng:
        want = ref_eng.generate(input_ids=prompts, sampling_params=params)
    monkeypatch.setattr(sched, "decode_reserve", lambda *a, **k: 0)
    with Engine(model_dir, max_total_tokens=180, chunked_prefill_size=16, max_running_requests=12) as eng:
        got = eng.generate(input_ids=prompts, sampling_params=params)
        eng.runner.allocator.debug_check()
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert sum(g["meta_info"]["cached_tokens"] for g in got) >= 40 * 5
    assert sum(g["meta_info"]["num_retractions"] for g in got) > 0


def test_spectrum_tiers_at_half_budget(model_dir):
    """SpectrumKV tiers over the stored layers only: at b = 0.5 the resident KV is about a
    quarter of a vanilla model's at the model dtype; radix hits extend over tiered prefixes."""
    from sgl_kvxfer import Engine
    from sgl_kvxfer.spectrum.tiers import TIER_INT4, TIER_INT8

    prompts = _prompts(4, (60, 45, 80))
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    kw = dict(dtype="bfloat16", attention_backend="torch", max_total_tokens=2048, chunked_prefill_size=32)
    with Engine(model_dir, **kw) as eng:
        base = eng.generate(input_ids=prompts, sampling_params=params)
    with Engine(model_dir, kv_tier_budget=0.5, kv_int4="on", kv_decode_recent=4, kv_quant_group_size=16,
                kv_tier_page_size=16, **kw) as eng:
        got = eng.generate(input_ids=prompts, sampling_params=params)
        used = eng.runner.allocator.used_counts()
        assert used[TIER_INT8] > 30 and used[TIER_INT4] > 30, used
        fkv = eng.get_server_info()["extra"]["fusedkv"]
        hits = eng.generate(input_ids=[p + [7, 8, 9] for p in prompts], sampling_params=params)
        eng.runner.allocator.debug_check()
    assert fkv["kv_bytes_ratio_vs_vanilla"] < 0.3, fkv
    assert all(h["meta_info"]["cached_tokens"] >= 32 and len(h["output_ids"]) == 10 for h in hits)
    same_first = sum(g["output_ids"][0] == b["output_ids"][0] for g, b in zip(got, base))
    assert same_first >= 2, (got, base)


@pytest.mark.gpu
def test_tiered_decode_graphs_on_cuda(model_dir, tmp_path):
    """On CUDA a FusedKV engine over a tiered pool captures its decode graphs (its reconstruction
    layers decode through kernels/fusedkv_tiered_decode.py) and decodes what the eager engine does.
    head_dim 32: compiled, the int tiers' kernel needs it (TINY's 16 runs only interpreted)."""
    from sgl_kvxfer import Engine

    variant = "lite" if "lite" in model_dir else "fusedkv"
    model_dir = write_model(str(tmp_path), variant, seed=3, base={**TINY, "head_dim": 32, "hidden_size": 128})

    prompts = _prompts(5, (60, 45, 80))
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    kw = dict(device="cuda", dtype="bfloat16", attention_backend="triton", max_total_tokens=2048,
              chunked_prefill_size=32, kv_tier_budget=0.5, kv_int4="on", kv_decode_recent=4,
              kv_quant_group_size=16, kv_tier_page_size=16)
    out = {}
    for graphs in (False, True):
        with Engine(model_dir, disable_cuda_graph=not graphs, **kw) as eng:
            assert (eng.runner.graph_runner is not None) == graphs
            assert eng.runner.attn_backend.path == "triton-tiered"
            out[graphs] = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    assert out[True] == out[False]
