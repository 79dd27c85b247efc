"""From-scratch training: vanilla vs FusedKV vs FusedKV-Lite at equal parameters and tokens.

    python benchmarks/fusedkv/data.py                                  # once: .cache/fusedkv
    python benchmarks/fusedkv/train.py --device cuda                   # GPU, preset "small"
    python benchmarks/fusedkv/train.py --preset toy --device cpu       # seconds, CPU smoke run

Three models of one Llama-style shape (benchmarks/fusedkv/model.py, SmolLM2's vocabulary,
tied embeddings). FusedKV / Lite keep the bottom half's KV (layers 0..L/2-1, sources 0 and
L/2-1) and drop k_proj / v_proj from the top half; their reconstruction layers' MLPs are
widened to give back those parameters (`matched_recon_intermediate`, counts in the JSON).
All three see the same windows of prose + code train tokens in the same order (one seeded
permutation per epoch), AdamW as the paper (beta2 0.95, wd 0.1 on matrices, clip 1.0, warmup
then cosine to 10%), bf16 autocast on CUDA. Validation loss on a fixed subset of the eval
split every `eval_every` steps, and on the whole eval split at the end.

Time bound: before training, each model runs a few timed steps and one eval pass; the step
count is the preset's (epochs x windows / batch) or fewer, so that all three models, their
evals included, fit `--time-budget-s`. Output: fusedkv_train_<device>.json (curves, params,
tokens/s, achieved TFLOP/s, final losses, the targets) + .png.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from common.report import device_name, write_json  # noqa: E402
from data import DEFAULT_DIR, EpochBatches, load_split, mixed_chunks  # noqa: E402
from model import LM, LMConfig, lm_loss, matched_recon_intermediate  # noqa: E402

from sgl_kvxfer.models.fusedkv_math import FusedKVConfig  # noqa: E402

VARIANTS = ("vanilla", "fusedkv", "lite")
PRESETS = {
    # ~51M parameters (25.7M non-embedding), MHA 8 x 64; 3 epochs of the 4.58M train tokens
    "small": dict(hidden=512, layers=8, heads=8, kv_heads=8, head_dim=64, inter=1408, seq=1024, batch=32,
                  epochs=3.0, lr=1.5e-3, eval_every=20, eval_windows=64, probe_steps=3),
    # CPU smoke run (seconds): the pipeline, not the result
    "toy": dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, inter=128, seq=64, batch=4,
                epochs=None, steps=8, lr=3e-3, eval_every=4, eval_windows=4, probe_steps=1,
                max_train_windows=64, max_eval_windows=8),
}


def build_models(p: dict, vocab: int) -> dict[str, LM]:
    base = LMConfig(vocab_size=vocab, hidden_size=p["hidden"], num_layers=p["layers"], num_heads=p["heads"],
                    num_kv_heads=p["kv_heads"], head_dim=p["head_dim"], intermediate_size=p["inter"])
    out = {"vanilla": LM(base)}
    for variant in ("fusedkv", "lite"):
        fk = FusedKVConfig(num_hidden_layers=p["layers"], variant=variant, init="equivalent")
        out[variant] = LM(base.with_fusedkv(fk, matched_recon_intermediate(base, fk)))
    return out


def flops_per_token(m: LM, seq: int) -> float:
    """Training FLOPs per token: 6 x (matrix params incl. the tied head) + causal attention."""
    c, pc = m.config, m.param_counts()
    attn = 6 * c.num_layers * seq * c.num_heads * c.head_dim  # QK^T and PV, fwd+bwd, causal half
    return 6 * (pc["non_embedding"] + c.vocab_size * c.hidden_size) + attn


def make_optimizer(m: LM, lr: float, device: str):
    decay = [p for p in m.parameters() if p.dim() == 2]
    other = [p for p in m.parameters() if p.dim() != 2]  # norms, fusion weights
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), fused=device.startswith("cuda"))


def lr_at(step: int, steps: int, lr: float) -> float:
    warm = max(1, steps // 10)
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def autocast(device: str, dtype: torch.dtype | None):
    return torch.autocast("cuda", dtype=dtype) if device.startswith("cuda") and dtype else torch.autocast("cpu", enabled=False)


def train_step(m, opt, batch, device, dtype) -> float:
    batch = batch.to(device, non_blocking=True)
    with autocast(device, dtype):
        loss = lm_loss(m(batch[:, :-1]), batch[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


@torch.no_grad()
def evaluate(m, windows, batch_size, device, dtype) -> float:
    m.eval()
    total, n = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        b = windows[i:i + batch_size].to(device)
        with autocast(device, dtype):
            loss = lm_loss(m(b[:, :-1]), b[:, 1:])
        total += loss.item() * b.shape[0]
        n += b.shape[0]
    m.train()
    return total / n


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def probe(m, batches, eval_sub, p, device, dtype) -> tuple[float, float]:
    """(seconds per train step, seconds per eval pass of the subset), measured after warm-up.
    Runs a throwaway optimizer: the caller re-initializes the model afterwards."""
    opt = make_optimizer(m, 1e-9, device)
    train_step(m, opt, next(batches), device, dtype)
    evaluate(m, eval_sub, p["batch"], device, dtype)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(p["probe_steps"]):
        train_step(m, opt, next(batches), device, dtype)
    sync(device)
    t_step = (time.perf_counter() - t0) / p["probe_steps"]
    t0 = time.perf_counter()
    evaluate(m, eval_sub, p["batch"], device, dtype)
    sync(device)
    return t_step, time.perf_counter() - t0


def plan_steps(p, n_windows, probes, n_eval_full, budget_s) -> tuple[int, int]:
    """(planned steps, affordable steps): the preset's epochs (or steps) capped by the budget."""
    planned = p.get("steps") or max(1, int(p["epochs"] * n_windows // p["batch"]))
    per_step = sum(t for t, _ in probes.values())
    evals = sum(e for _, e in probes.values())
    final = 2 * evals * n_eval_full / p["eval_windows"]  # the whole split, then per domain
    afford = int((budget_s - final) / (per_step + evals / p["eval_every"])) if budget_s else planned
    return planned, max(1, min(planned, afford))


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for v, r in res["models"].items():
        toks = [s * res["tokens_per_step"] / 1e6 for s in r["val_steps"]]
        ax[0].plot(toks, r["val_loss"], marker=".", label=f"{v} ({r['params']['total'] / 1e6:.1f}M)")
        ax[1].plot([s * res["tokens_per_step"] / 1e6 for s in range(len(r["train_loss"]))], r["train_loss"],
                   alpha=0.7, label=v)
    ax[0].set(xlabel="train tokens (M)", ylabel="validation loss (eval split subset)", title="validation")
    ax[1].set(xlabel="train tokens (M)", ylabel="train loss", title="training")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend()
    lo = min(min(r["val_loss"]) for r in res["models"].values())
    ax[0].set_ylim(lo - 0.05, lo + 1.5)
    fig.suptitle(f"FusedKV from scratch, {res['device']}: final val loss " +
                 ", ".join(f"{v} {r['final_val_loss']:.4f}" for v, r in res["models"].items()))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--data-dir", default=DEFAULT_DIR)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="CUDA autocast dtype")
    ap.add_argument("--time-budget-s", type=float, default=300.0, help="all three models, evals included (0: no cap)")
    ap.add_argument("--steps", type=int, default=None, help="override the preset's step count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=None)
    a = ap.parse_args(argv)
    p = dict(PRESETS[a.preset])
    if a.steps:
        p["steps"] = a.steps
    dtype = torch.bfloat16 if a.dtype == "bfloat16" else None
    if a.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    train = mixed_chunks(load_split(a.data_dir, "train"), p["seq"], p.get("max_train_windows"))
    eval_full = mixed_chunks(load_split(a.data_dir, "eval"), p["seq"], p.get("max_eval_windows"))
    eval_dom = {d: mixed_chunks({d: t}, p["seq"], p.get("max_eval_windows"))
                for d, t in load_split(a.data_dir, "eval").items()}
    g = torch.Generator().manual_seed(1)
    eval_sub = eval_full[torch.randperm(eval_full.shape[0], generator=g)[: p["eval_windows"]]]
    import json

    with open(os.path.join(a.data_dir, "meta.json")) as f:
        vocab = json.load(f)["vocab_size"]
    models = build_models(p, vocab)
    probes = {}
    for v, m in models.items():
        m.to(a.device).train()
        probes[v] = probe(m, EpochBatches(train, p["batch"], seed=99), eval_sub, p, a.device, dtype)
        print(f"probe {v}: {probes[v][0] * 1e3:.0f} ms/step, eval subset {probes[v][1]:.2f} s", flush=True)
    planned, steps = plan_steps(p, train.shape[0], probes, eval_full.shape[0], a.time_budget_s)
    print(f"steps: {steps} (planned {planned}), {steps * p['batch'] * p['seq'] / 1e6:.2f}M tokens per model", flush=True)

    res = {"device": device_name(a.device), "preset": a.preset, "config": p, "seed": a.seed,
           "train_windows": int(train.shape[0]), "eval_windows": int(eval_full.shape[0]),
           "tokens_per_step": p["batch"] * p["seq"], "planned_steps": planned, "steps": steps,
           "budget_capped": steps < planned, "time_budget_s": a.time_budget_s, "models": {}}
    for v, m in models.items():
        m.init_weights(seed=a.seed)  # same seed for every variant; shapes differ only where they must
        opt = make_optimizer(m, p["lr"], a.device)
        batches = EpochBatches(train, p["batch"], seed=a.seed)
        r = {"params": m.param_counts(), "kv_bytes_per_token_bf16": m.kv_bytes_per_token(2),
             "recon_intermediate_size": m.config.recon_intermediate_size,
             "train_loss": [], "val_steps": [], "val_loss": []}
        sync(a.device)
        t0, t_eval = time.perf_counter(), 0.0
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, p["lr"])
            r["train_loss"].append(train_step(m, opt, next(batches), a.device, dtype))
            if (step + 1) % p["eval_every"] == 0 or step + 1 == steps:
                te = time.perf_counter()
                r["val_steps"].append(step + 1)
                r["val_loss"].append(evaluate(m, eval_sub, p["batch"], a.device, dtype))
                t_eval += time.perf_counter() - te
                print(f"{v} step {step + 1}/{steps}: train {r['train_loss'][-1]:.4f} val {r['val_loss'][-1]:.4f}",
                      flush=True)
        sync(a.device)
        train_s = time.perf_counter() - t0 - t_eval
        r["train_seconds"] = train_s
        r["tokens_per_s"] = steps * res["tokens_per_step"] / train_s
        r["achieved_tflops"] = r["tokens_per_s"] * flops_per_token(m, p["seq"]) / 1e12
        r["final_val_loss"] = evaluate(m, eval_full, p["batch"], a.device, dtype)
        r["final_val_loss_by_domain"] = {d: evaluate(m, w, p["batch"], a.device, dtype) for d, w in eval_dom.items()}
        print(f"{v}: final val {r['final_val_loss']:.4f} {r['final_val_loss_by_domain']}, "
              f"{r['tokens_per_s'] / 1e3:.0f}k tok/s, {r['achieved_tflops']:.1f} TFLOP/s", flush=True)
        res["models"][v] = r
        m.to("cpu")
    van = res["models"]["vanilla"]["final_val_loss"]
    fk, lite = res["models"]["fusedkv"]["final_val_loss"], res["models"]["lite"]["final_val_loss"]
    res["targets"] = {
        "fusedkv_minus_vanilla": fk - van, "fusedkv_le_vanilla": fk <= van,
        "lite_rel_to_vanilla": (lite - van) / van, "lite_within_1pct": (lite - van) / van <= 0.01,
        "param_rel_diff": {v: r["params"]["total"] / res["models"]["vanilla"]["params"]["total"] - 1
                           for v, r in res["models"].items()},
    }
    name = f"fusedkv_train_{a.preset}_{'cuda' if a.device.startswith('cuda') else 'cpu'}"
    path = write_json(name, res, a.out_dir)
    plot(res, path[:-5] + ".png")
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main()
