"""bf16 on CPU: the engine on the native kernels (cpu attention backend, C++ elementwise ops,
prepacked oneDNN linears) is as accurate as the same engine on the torch path.

bf16 runs differ from each other by rounding noise (logprob gaps of ~0.1 are normal over 30
layers, and greedy runs may part at near-ties), so the check is against fp32: the native
engine's logprobs (prompt: extend path; generated tokens: native decode attention) are no
further from the fp32 engine's than the torch bf16 path's are, and every token it generates is
the fp32 model's greedy choice up to a near-tie.
"""
import pytest
import torch

from sgl_kvxfer.kernels import cpu_ops

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("native_cpu_ops"),
              pytest.mark.skipif(not cpu_ops.toolchain_found(), reason="no C++ toolchain for the native CPU kernels")]

PROMPTS = ["The capital of France is a city with a long history. Its museums",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    ",
           "Once upon a time, in a small village by the sea, there lived",
           "SELECT name, age FROM users WHERE"]
NEW = 16


def _score(engine, ids):
    """(logprob of each token after the first, top-1 logprob at each of those positions)."""
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=0, top_logprobs_num=1)
    m = out["meta_info"]
    return (torch.tensor([e[0] for e in m["input_token_logprobs"][1:]]),
            torch.tensor([t[0][0] for t in m["input_top_logprobs"][1:]]))


def test_native_bf16_engine_is_as_accurate_as_the_torch_path(smollm2_path, monkeypatch):
    from sgl_kvxfer import Engine

    with Engine(smollm2_path, dtype="bfloat16", device="cpu", max_total_tokens=8000) as native:
        assert native.server_args.engine.resolved_attention_backend == "cpu"
        assert native.runner.attn_backend.native is not None  # in-place decode kernel
        assert native.runner.model.packed_lm_head is not None  # prepacked oneDNN linears
        outs = native.generate(PROMPTS, {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
                               return_logprob=True)
        seqs = [native.tokenizer.encode(p) + o["output_ids"] for p, o in zip(PROMPTS, outs)]
        native_scores = [_score(native, s)[0] for s in seqs]
    with Engine(smollm2_path, dtype="float32", device="cpu", max_total_tokens=8000) as fp32:
        exact = [_score(fp32, s) for s in seqs]
    monkeypatch.setenv("SGL_KVXFER_CPU_KERNELS", "0")
    with Engine(smollm2_path, dtype="bfloat16", device="cpu", max_total_tokens=8000,
                attention_backend="torch") as torch_bf16:
        assert getattr(torch_bf16.runner.model, "packed_lm_head", None) is None
        torch_scores = [_score(torch_bf16, s)[0] for s in seqs]

    ref = torch.cat([e[0] for e in exact])
    err_native = (torch.cat(native_scores) - ref).abs().mean()
    err_torch = (torch.cat(torch_scores) - ref).abs().mean()
    assert err_native <= 1.5 * err_torch + 0.01, (err_native, err_torch)  # extend path

    gen_native = torch.cat([torch.tensor([e[0] for e in o["meta_info"]["output_token_logprobs"]]) for o in outs])
    gen_ref = torch.cat([e[0][-NEW:] for e in exact])
    gen_torch = torch.cat([t[-NEW:] for t in torch_scores])
    assert len(gen_native) == len(PROMPTS) * NEW
    assert (gen_native - gen_ref).abs().mean() <= 1.5 * (gen_torch - gen_ref).abs().mean() + 0.01  # decode
    gap = torch.cat([(e[1] - e[0])[-NEW:] for e in exact])  # fp32 top-1 minus the chosen token
    assert float(gap.max()) < 0.3, gap
