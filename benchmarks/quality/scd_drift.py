"""How far the SCD specialists drifted from their base: the mismatch SCD has to bridge.

    python benchmarks/quality/scd_drift.py [--specialist code=scripts/scd/specialists/code ...]

For the base model (the producer) and each specialist (base + LoRA adapter, merged as the engine
merges it): perplexity on both corpora's eval split (non-overlapping windows of --window tokens,
at most one per document, seeded), and per layer the cosine similarity between the base's and
the specialist's K (post-RoPE) and V vectors for the same tokens (mean over tokens and kv heads),
plus the relative L2 distance |K_spec - K_base|^2 / |K_spec|^2. Writes scd_drift_<device>.json
(write_json) and .png into --out-dir.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.common.report import RESULTS_DIR, device_name, write_json  # noqa: E402

DEFAULT_SPECIALISTS = [f"{n}={os.path.join(ROOT, 'scripts', 'scd', 'specialists', n)}" for n in ("code", "prose")]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="base model (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--specialist", action="append", default=None, metavar="NAME=ADAPTER_DIR")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows", type=int, default=24, help="per corpus")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA, float32 on CPU")
    ap.add_argument("--out-dir", default=RESULTS_DIR)
    ap.add_argument("--name", default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.window, args.windows = 64, 2
    return args


def main(argv=None) -> str:
    args = parse_args(argv)
    import torch
    from tqdm import tqdm

    from sgl_kvxfer.models.loader import load_model, load_tokenizer, resolve_model_path, resolve_tokenizer_path
    from sgl_kvxfer.scd.data import CORPORA, corpus_path, read_texts, token_chunks
    from sgl_kvxfer.scd.forward import LlamaRunner
    from sgl_kvxfer.scd.identity import identify

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32, "bfloat16": torch.bfloat16,
             "float32": torch.float32}[args.dtype]
    base_dir = resolve_model_path(args.model)
    tok = load_tokenizer(resolve_tokenizer_path(base_dir))
    specs = [s.split("=", 1) for s in (args.specialist or DEFAULT_SPECIALISTS)]
    models = {"base": (base_dir, None), **{n: (base_dir, p) for n, p in specs}}
    runners = {n: LlamaRunner(load_model(d, "auto", dtype, device, 0, merge_lora=l)[0]) for n, (d, l) in models.items()}
    windows = {c: token_chunks(tok, read_texts(corpus_path(c, "eval")), args.window, args.windows,
                               seed=args.seed, max_per_doc=1) for c in CORPORA}
    L = len(runners["base"].layers)
    nll = {n: {c: 0.0 for c in CORPORA} for n in runners}
    count = {c: 0 for c in CORPORA}
    sims = {n: {k: [0.0] * L for k in ("k_cos", "v_cos", "k_rel", "v_rel")} for n in runners if n != "base"}
    n_batches = 0
    bar = tqdm(total=sum(len(w) for w in windows.values()), desc="drift", unit="window")
    for c in CORPORA:
        for s in range(0, len(windows[c]), args.batch_size):
            ids = torch.tensor(windows[c][s:s + args.batch_size], dtype=torch.long, device=device)
            pos = torch.arange(ids.shape[1], device=device).expand_as(ids)
            valid = torch.ones_like(ids, dtype=torch.bool)
            taps = {n: r.forward(ids, pos, valid, kv_layers=range(L), logits="all") for n, r in runners.items()}
            for n, t in taps.items():
                lp = torch.log_softmax(t.logits[:, :-1].float(), -1)
                nll[n][c] -= float(lp.gather(-1, ids[:, 1:, None]).sum())
            count[c] += ids[:, 1:].numel()
            for n in sims:
                for layer in range(L):
                    for kv in ("k", "v"):
                        a = getattr(taps["base"], kv)[layer].float()
                        b = getattr(taps[n], kv)[layer].float()
                        sims[n][f"{kv}_cos"][layer] += float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean())
                        sims[n][f"{kv}_rel"][layer] += float((b - a).pow(2).sum() / b.pow(2).sum())
            n_batches += 1
            bar.update(ids.shape[0])
    bar.close()
    ppl = {n: {c: math.exp(nll[n][c] / count[c]) for c in CORPORA} for n in runners}
    sims = {n: {k: [round(x / n_batches, 6) for x in v] for k, v in d.items()} for n, d in sims.items()}
    payload = {"device": device_name(device), "dtype": str(dtype).replace("torch.", ""), "params": vars(args),
               "models": {n: {"adapter": l, "weight_hash": identify(d, l).weight_hash[:16]} for n, (d, l) in models.items()},
               "windows": {c: len(w) for c, w in windows.items()}, "scored_tokens": count,
               "ppl": ppl, "kv_similarity_vs_base": sims}
    name = args.name or f"scd_drift_{payload['device'].split(' (')[0].replace(' ', '_')}"
    path = write_json(name, payload, args.out_dir)
    plot(payload, path[:-5] + ".png")
    for n in runners:
        print(f"{n:>8}: " + ", ".join(f"PPL {c} {ppl[n][c]:.3f}" for c in CORPORA))
    print(f"wrote {path}")
    return path


def plot(p: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    names, corpora = list(p["ppl"]), list(next(iter(p["ppl"].values())))
    w = 0.8 / len(names)
    for j, n in enumerate(names):
        a.bar([i + j * w for i in range(len(corpora))], [p["ppl"][n][c] for c in corpora], w, label=n)
    a.set_xticks([i + w * (len(names) - 1) / 2 for i in range(len(corpora))], [f"{c} eval" for c in corpora])
    a.set_ylabel("perplexity")
    a.legend()
    for n, d in p["kv_similarity_vs_base"].items():
        b.plot(d["k_cos"], label=f"{n}: K cosine")
        b.plot(d["v_cos"], ls="--", label=f"{n}: V cosine")
    b.set_xlabel("layer")
    b.set_ylabel("cosine(base, specialist), same tokens")
    b.legend(fontsize=8)
    fig.suptitle(f"SCD specialists' drift from the base ({p['device']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
