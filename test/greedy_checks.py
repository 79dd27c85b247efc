"""One check shared by the tests that compare two engines' greedy outputs (backends, CUDA
graphs vs eager, FusedKV paths): different summation orders may flip a greedy token only at a
near tie."""
from __future__ import annotations


def assert_greedy_close(got: list[dict], ref: list[dict], atol: float, same_length: bool = False) -> None:
    """Per request, step by step: output logprobs within `atol` of the reference's; the first
    step whose tokens differ must be a near tie in the reference (top-2 gap < atol), and the
    comparison of that request stops there (the continuations differ from then on). Both runs
    need return_logprob=True and top_logprobs_num >= 2."""
    for g, r in zip(got, ref):
        gl, rl = g["meta_info"]["output_token_logprobs"], r["meta_info"]["output_token_logprobs"]
        if same_length:
            assert len(g["output_ids"]) == len(r["output_ids"])
        for i, (gt, rt) in enumerate(zip(g["output_ids"], r["output_ids"])):
            assert abs(gl[i][0] - rl[i][0]) < atol, (i, gl[i], rl[i])
            if gt != rt:
                top = r["meta_info"]["output_top_logprobs"][i]
                assert top[0][0] - top[1][0] < atol, f"step {i}: {gt} != {rt} without a near tie"
                break
