"""Greedy agreement and logprob closeness of two engine variants on the same prompts.

`--compare backends` (default): triton backend (paged, page 64) vs torch backend (page 1).
`--compare fused`: triton backend with the fused Triton RMSNorm / RoPE / SwiGLU kernels
(SGL_KVXFER_FUSED_ELEMENTWISE=1) vs the same backend on the torch elementwise path; both with
CUDA graphs, so this checks exactly what the fused default changes.

Dummy weights, so near-ties are common and one flipped token changes the rest of a sequence:
we report the exact-sequence match rate, the share of tokens generated before the first
divergence, whether each divergence was a near tie in the torch run (top-2 logprob gap), and
teacher-forced prompt logprob differences (independent of flips).

    python benchmarks/throughput/backend_agreement.py --preset smollm2-135m --dtypes bfloat16 float16
    python benchmarks/throughput/backend_agreement.py --device cpu --preset tiny --num-prompts 2 \
        --output-len 4 --min-len 16 --max-len 40 --dtypes bfloat16      # CPU smoke run (Triton interpreter)
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.report import device_name, git_commit, triton_interpreter_for, write_json  # noqa: E402


def generate(model_dir, backend, dtype, prompts, output_len, load_format="dummy", fused=None, device="cuda"):
    from sgl_kvxfer import Engine, env

    if fused is not None:  # read at call time, so it must be set before the graphs are captured
        os.environ[env.FUSED_ELEMENTWISE.name] = "1" if fused else "0"
    with Engine(model_dir, device=device, load_format=load_format, dtype=dtype, attention_backend=backend,
                max_total_tokens=65536, chunked_prefill_size=512) as eng:
        params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
        return eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                            logprob_start_len=0, top_logprobs_num=2)


def compare(ref, got) -> dict:
    n_tok = sum(len(r["output_ids"]) for r in ref)
    same_prefix, exact, flips, prompt_diff, out_diff = 0, 0, [], [], []
    for r, g in zip(ref, got):
        rl, gl = r["meta_info"]["input_token_logprobs"], g["meta_info"]["input_token_logprobs"]
        prompt_diff += [abs(a[0] - b[0]) for a, b in zip(rl, gl) if a[0] is not None]
        k = 0
        while k < len(r["output_ids"]) and r["output_ids"][k] == g["output_ids"][k]:
            out_diff.append(abs(r["meta_info"]["output_token_logprobs"][k][0]
                                - g["meta_info"]["output_token_logprobs"][k][0]))
            k += 1
        same_prefix += k
        exact += k == len(r["output_ids"])
        if k < len(r["output_ids"]):
            top = r["meta_info"]["output_top_logprobs"][k]
            flips.append({"step": k, "ref_top2_gap": top[0][0] - top[1][0]})
    t = torch.tensor
    return {"sequences": len(ref), "exact_sequence_match_rate": exact / len(ref),
            "tokens_before_first_divergence_rate": same_prefix / n_tok, "divergences": flips,
            "prompt_logprob_abs_diff_max": float(t(prompt_diff).max()),
            "prompt_logprob_abs_diff_mean": float(t(prompt_diff).mean()),
            "output_logprob_abs_diff_max_matched": float(t(out_diff).max()) if out_diff else None}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--model-path", default=None,
                   help="real weights instead of a dummy preset ('smollm2-135m' = embedded default); "
                        "prompts are then real text from this repo's docs")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=2000)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    p.add_argument("--compare", choices=["backends", "fused"], default="backends")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu: the triton backend runs in Triton's interpreter (tiny shapes)")
    p.add_argument("--out-dir", default=None, help="where the JSON goes (default benchmarks/results)")
    args = p.parse_args()
    triton_interpreter_for(args.device)

    from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer, write_preset_config

    rng = random.Random(0)
    load_format, tmp = "dummy", None
    if args.model_path:
        from sgl_kvxfer.models.loader import load_tokenizer, resolve_model_path, resolve_tokenizer_path

        model_dir, load_format = resolve_model_path(args.model_path), "auto"
        args.preset = os.path.basename(model_dir.rstrip("/")) + "_real"
        tokenizer = load_tokenizer(resolve_tokenizer_path(model_dir))
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        text = "".join(open(os.path.join(root, f)).read() for f in ("README.md", "docs/structures.md", "docs/http_api.md"))
        ids = tokenizer.encode(text)
        prompts = []
        for _ in range(args.num_prompts):
            n = min(rng.randint(args.min_len, args.max_len), len(ids) - 1)
            start = rng.randrange(0, len(ids) - n)
            prompts.append(ids[start : start + n])
    else:
        model_dir = tmp = write_preset_config(args.preset, tempfile.mkdtemp(prefix="agreement_"))
        vocab = PRESETS[args.preset]["vocab_size"]
        write_dummy_tokenizer(model_dir, vocab)
        prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
                   for _ in range(args.num_prompts)]
    device = args.device
    payload = {"benchmark": kind_of(args), "device": device_name(device), "commit": git_commit(), "params": vars(args),
               "results": {}}
    for dtype in args.dtypes:
        run = lambda backend, fused=None: generate(model_dir, backend, dtype, prompts, args.output_len,  # noqa: E731
                                                   load_format, fused, device)
        if args.compare == "fused":
            ref, got = run("triton", fused=False), run("triton", fused=True)
        else:
            ref, got = run("torch"), run("triton")
        res = compare(ref, got)
        payload["results"][dtype] = res
        print(f"{dtype}: exact sequences {res['exact_sequence_match_rate']:.0%}, tokens before first "
              f"divergence {res['tokens_before_first_divergence_rate']:.1%}, divergences (step, reference top-2 gap) "
              f"{[(d['step'], round(d['ref_top2_gap'], 4)) for d in res['divergences']]}, prompt logprob |diff| "
              f"max {res['prompt_logprob_abs_diff_max']:.4f} mean {res['prompt_logprob_abs_diff_mean']:.5f}, "
              f"matched output logprob |diff| max {res['output_logprob_abs_diff_max_matched']}", flush=True)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    name = f"{kind_of(args)}_{args.preset}_{device_name(device).split(' (')[0].replace(' ', '_')}"
    print("wrote", write_json(name, payload, args.out_dir))


def kind_of(args) -> str:
    return "backend_agreement" if args.compare == "backends" else "fused_agreement"


if __name__ == "__main__":
    main()
