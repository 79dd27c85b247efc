"""Retrofit FusedKV onto a pretrained Llama (SmolLM2-135M-Instruct): least squares, then tuning.

    python benchmarks/fusedkv/retrofit.py --device cuda                       # GPU (preset "full")
    python benchmarks/fusedkv/retrofit.py --preset toy --device cpu           # CPU smoke run
    python benchmarks/fusedkv/build_model.py --weights <out>/fusedkv_retrofit_weights_<tag>.safetensors --out DIR

Steps, each scored by perplexity on held-out windows of the eval split (prose + code) against
the original model on the same windows:
  0. the original (vanilla) model;
  1. FusedKV-Lite as is (K from the last storage layer, V from layer 0; no weights, no tuning);
  2. FusedKV with least-squares fusion weights: the original model's post-RoPE K/V of calib
     windows, per reconstruction layer i a fit of (K_i, V_i) from (K_0, V_0, K_n-1, V_n-1)
     under the RoPE pair constraint (fusedkv_math.FusionLstsq);
  3. stage A: the fusion weights alone, tuned by distillation (KL to the original's next-token
     distribution on train windows; no CE, so the student approaches the original instead of
     adapting to the domain);
  4. stage B: LoRA on every linear layer + fusion weights + RMSNorm weights, the same loss.
Reconstruction layers lose k_proj / v_proj. Time bound: stage step counts are capped from
probed step times so that the run fits --time-budget-s. Output (all small): the JSON + PNG of
the PPL curve, the greedy answers of original and converted on a few chat prompts, and
fusedkv_retrofit_weights_<tag>.safetensors (fusion + norms + LoRA, bf16 LoRA), from which
build_model.py rebuilds the model dir locally. The run also rebuilds it here and re-scores
it through build_model.load_lm (`reloaded_ppl`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from build_model import build_converted, fingerprint, load_base, load_lm  # noqa: E402
from common.report import device_name, write_json  # noqa: E402
from data import DEFAULT_DIR, EpochBatches, load_split, mixed_chunks  # noqa: E402
from model import LM, LMConfig, apply_lora, greedy, lora_state  # noqa: E402

from sgl_kvxfer.models.fusedkv_math import CONFIG_KEY, FusedKVConfig, FusionLstsq  # noqa: E402

PRESETS = {
    "full": dict(seq=512, batch=16, calib_windows=128, eval_windows=96, steps_a=120, steps_b=480, eval_every=40,
                 lr_a=5e-3, lr_b=8e-4, lr_b_other=1e-3, rank=16, alpha=32, max_new=48, probe_steps=3),
    "toy": dict(seq=32, batch=2, calib_windows=2, eval_windows=2, steps_a=2, steps_b=2, eval_every=1,
                lr_a=5e-3, lr_b=4e-4, lr_b_other=1e-3, rank=4, alpha=8, max_new=4, probe_steps=1,
                max_train_windows=16),
}
PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
           "Explain in two sentences why the sky is blue.", "List three uses of a hash map."]


def autocast(device, dtype):
    return torch.autocast("cuda", dtype=dtype) if device.startswith("cuda") and dtype else torch.autocast("cpu", enabled=False)


@torch.no_grad()
def perplexity(m: LM, windows: torch.Tensor, batch: int, device: str, dtype) -> float:
    m.eval()
    nll, n = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        b = windows[i:i + batch].to(device)
        with autocast(device, dtype):
            logits = m(b[:, :-1])
        nll += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1), reduction="sum").item()
        n += b[:, 1:].numel()
    return math.exp(nll / n)


def student_from(teacher_sd: dict, base_cfg: LMConfig, fk: FusedKVConfig, device) -> LM:
    """A FusedKV / Lite LM with the original's weights (reconstruction layers' k/v dropped)."""
    m = LM(base_cfg.with_fusedkv(fk))
    own = m.state_dict()
    missing = m.load_state_dict({k: v for k, v in teacher_sd.items() if k in own}, strict=False).missing_keys
    assert all(".kv_fusion." in k for k in missing), missing
    return m.to(device)


@torch.no_grad()
def lstsq_init(teacher: LM, student: LM, calib: torch.Tensor, batch: int, device, dtype) -> dict:
    """Fit every reconstruction layer's fusion weights on the teacher's calib KV; returns fit
    residuals (relative squared error of K and V per layer, from the fitted weights)."""
    fk = student.config.fusedkv
    s0, s1 = fk.source_layers
    fits = {i: FusionLstsq() for i in fk.reconstruction_layers}
    for j in range(0, calib.shape[0], batch):
        b = calib[j:j + batch, :-1].to(device)
        with autocast(device, dtype):
            _, kv = teacher(b, return_kv=True)
        flat = {l: (k.float().flatten(0, 1), v.float().flatten(0, 1)) for l, (k, v) in kv.items()}
        for i, fit in fits.items():
            fit.update(flat[s0][0], flat[s1][0], flat[i][0], flat[s0][1], flat[s1][1], flat[i][1])
    resid = {}
    b = calib[:batch, :-1].to(device)
    with autocast(device, dtype):
        _, kv = teacher(b, return_kv=True)
    for i, fit in fits.items():
        kp, vw = fit.solve()
        fusion = student.model.layers[i].self_attn.kv_fusion
        fusion.key_pair_weight.copy_(kp.to(device))
        fusion.value_weight.copy_(vw.to(device))
        k, v = fusion(kv[s0][0].float(), kv[s1][0].float(), kv[s0][1].float(), kv[s1][1].float())
        rel = lambda x, y: float((x - y).pow(2).sum() / y.pow(2).sum().clamp_min(1e-30))  # noqa: E731
        resid[i] = {"k_rel_sq_err": rel(k, kv[i][0].float()), "v_rel_sq_err": rel(v, kv[i][1].float())}
    return resid


def kl_loss(student_logits, teacher_logits) -> torch.Tensor:
    """mean over tokens of KL(teacher || student), fp32."""
    t = F.log_softmax(teacher_logits.float(), -1)
    s = F.log_softmax(student_logits.float(), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


def run_stage(name, student, teacher, params_groups, steps, batches, evals, p, device, dtype, curve, t_limit):
    """Distillation steps with cosine LR; PPL into `curve` every eval_every steps. Stops early
    (recording it) when the wall clock passes t_limit."""
    opt = torch.optim.AdamW(params_groups, betas=(0.9, 0.95), weight_decay=0.0)
    base_lrs = [g["lr"] for g in opt.param_groups]
    student.train()
    done = 0
    for step in range(steps):
        if time.perf_counter() > t_limit:
            print(f"{name}: time limit after {step} steps", flush=True)
            break
        f = 0.1 + 0.45 * (1 + math.cos(math.pi * step / max(1, steps)))
        for g, lr in zip(opt.param_groups, base_lrs):
            g["lr"] = lr * min(1.0, (step + 1) / max(1, steps // 10)) * f
        b = next(batches).to(device)
        with torch.no_grad(), autocast(device, dtype):
            t_logits = teacher(b[:, :-1])
        with autocast(device, dtype):
            loss = kl_loss(student(b[:, :-1]), t_logits)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([q for g in params_groups for q in g["params"]], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        if done % p["eval_every"] == 0 or done == steps:
            ppl = perplexity(student, evals, p["batch"], device, dtype)
            curve.append({"stage": name, "step": done, "kl": loss.item(), "ppl": ppl})
            student.train()
            print(f"{name} step {done}/{steps}: kl {loss.item():.4f} ppl {ppl:.3f}", flush=True)
    student.eval()
    return done


def probe_step_s(student, teacher, params, batches, p, device, dtype) -> float:
    """Seconds per distillation step (after one warm-up), with a throwaway optimizer on copies."""
    saved = [q.detach().clone() for q in params]
    opt = torch.optim.AdamW(params, lr=0.0)
    times = []
    for i in range(1 + p["probe_steps"]):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        b = next(batches).to(device)
        with torch.no_grad(), autocast(device, dtype):
            tl = teacher(b[:, :-1])
        with autocast(device, dtype):
            kl_loss(student(b[:, :-1]), tl).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    with torch.no_grad():
        for q, s in zip(params, saved):
            q.copy_(s)
    return sum(times[1:]) / max(1, len(times) - 1)


def answers(model_dir: str, models: dict, prompts, max_new: int, device) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    eos = tuple(t for t in (tok.eos_token_id,) if t is not None)
    out = []
    for prompt in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        row = {"prompt": prompt}
        for tag, m in models.items():
            row[tag] = tok.decode(greedy(m, ids, max_new, eos), skip_special_tokens=True)
        out.append(row)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full")
    ap.add_argument("--model", default=None, help="base model dir (default: the embedded SmolLM2)")
    ap.add_argument("--data-dir", default=DEFAULT_DIR)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="CUDA autocast dtype")
    ap.add_argument("--time-budget-s", type=float, default=200.0, help="whole run (0: no cap)")
    ap.add_argument("--num-storage-layers", type=int, default=None, help="default: half the layers")
    ap.add_argument("--no-answers", action="store_true", help="skip the greedy answers (no tokenizer needed)")
    ap.add_argument("--out-dir", default=None)
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    p = dict(PRESETS[a.preset])
    dev, dtype = a.device, (torch.bfloat16 if a.dtype == "bfloat16" else None)
    if a.model is None:
        from sgl_kvxfer.models.loader import resolve_model_path

        a.model = resolve_model_path(None)
    hf_cfg, base_sd = load_base(a.model)
    base_fp = fingerprint(base_sd)
    base_cfg = LMConfig.from_hf_dict({k: v for k, v in hf_cfg.items() if k != CONFIG_KEY})
    teacher = load_lm(a.model, dev)
    teacher.requires_grad_(False)
    teacher_sd = {k: v for k, v in teacher.state_dict().items()}
    L = base_cfg.num_layers
    fk = FusedKVConfig(num_hidden_layers=L, num_storage_layers=a.num_storage_layers, init="lite")

    evals = mixed_chunks(load_split(a.data_dir, "eval"), p["seq"], p["eval_windows"])
    calib = mixed_chunks(load_split(a.data_dir, "calib"), p["seq"], p["calib_windows"])
    train = mixed_chunks(load_split(a.data_dir, "train"), p["seq"], p.get("max_train_windows"))
    res = {"device": device_name(dev), "preset": a.preset, "config": p, "base_model": a.model,
           "base_fingerprint": base_fp, "fusedkv": fk.to_dict(), "eval_tokens": int(evals[:, 1:].numel()),
           "calib_tokens": int(calib[:, :-1].numel()), "time_budget_s": a.time_budget_s}
    curve = []
    res["original_ppl"] = ppl0 = perplexity(teacher, evals, p["batch"], dev, dtype)
    curve.append({"stage": "original", "step": 0, "ppl": ppl0})
    lite = student_from(teacher_sd, base_cfg, FusedKVConfig(num_hidden_layers=L, variant="lite",
                                                            num_storage_layers=a.num_storage_layers), dev)
    res["lite_ppl"] = perplexity(lite, evals, p["batch"], dev, dtype)
    curve.append({"stage": "lite", "step": 0, "ppl": res["lite_ppl"]})
    del lite
    student = student_from(teacher_sd, base_cfg, fk, dev)
    res["lstsq_residuals"] = lstsq_init(teacher, student, calib, p["batch"], dev, dtype)
    res["lstsq_ppl"] = perplexity(student, evals, p["batch"], dev, dtype)
    curve.append({"stage": "lstsq", "step": 0, "ppl": res["lstsq_ppl"]})
    print(f"original {ppl0:.3f}  lite {res['lite_ppl']:.3f}  lstsq {res['lstsq_ppl']:.3f}", flush=True)

    # ---- stage A: fusion weights alone; stage B: LoRA + fusion + norms ------------------------
    batches = EpochBatches(train, p["batch"], seed=0)
    student.requires_grad_(False)
    fusion = [q for n, q in student.named_parameters() if ".kv_fusion." in n]
    for q in fusion:
        q.requires_grad_(True)
    t_a = probe_step_s(student, teacher, fusion, batches, p, dev, dtype)
    lora_paths = apply_lora(student, p["rank"], p["alpha"])
    student.to(dev)
    lora = [q for n, q in student.named_parameters() if ".lora_" in n]
    norms = [q for n, q in student.named_parameters() if n.endswith("norm.weight")]
    for q in norms:
        q.requires_grad_(True)
    t_b = probe_step_s(student, teacher, lora + fusion + norms, batches, p, dev, dtype)
    t_eval = time.perf_counter()
    perplexity(student, evals, p["batch"], dev, dtype)
    t_eval = time.perf_counter() - t_eval
    elapsed = time.perf_counter() - t_start
    reserve = 4 * t_eval + 20.0 + (0 if a.no_answers else 8 * p["max_new"] * 0.02)  # rebuild, reload, answers
    steps_a, steps_b = p["steps_a"], p["steps_b"]
    if a.time_budget_s:
        left = a.time_budget_s - elapsed - reserve
        cost = steps_a * (t_a + t_eval / p["eval_every"]) + steps_b * (t_b + t_eval / p["eval_every"])
        if cost > left:
            f = max(left, 0) / cost
            steps_a, steps_b = max(1, int(steps_a * f)), max(1, int(steps_b * f))
    res.update(step_s_a=t_a, step_s_b=t_b, eval_s=t_eval, planned_steps=[p["steps_a"], p["steps_b"]],
               steps=[steps_a, steps_b], lora_modules=len(lora_paths))
    print(f"stage A {steps_a} steps x {t_a:.3f}s, stage B {steps_b} x {t_b:.3f}s", flush=True)
    t_limit = t_start + (a.time_budget_s - reserve if a.time_budget_s else 1e12)
    # stage A with the LoRA factors in place (B = 0: the same function as without them), frozen
    for q in lora + norms:
        q.requires_grad_(False)
    done_a = run_stage("A", student, teacher, [{"params": fusion, "lr": p["lr_a"]}], steps_a, batches, evals,
                       p, dev, dtype, curve, t_limit)
    for q in lora + norms:
        q.requires_grad_(True)
    done_b = run_stage("B", student, teacher, [{"params": lora, "lr": p["lr_b"]},
                                               {"params": fusion + norms, "lr": p["lr_b_other"]}],
                       steps_b, batches, evals, p, dev, dtype, curve, t_limit)
    res["steps_done"] = [done_a, done_b]
    res["curve"] = curve
    res["final_ppl"] = perplexity(student, evals, p["batch"], dev, dtype)
    res["final_ppl_rel"] = res["final_ppl"] / ppl0 - 1
    res["target_within_3pct"] = res["final_ppl_rel"] <= 0.03

    # ---- the small file, the rebuilt model dir, answers ------------------------------------------
    from safetensors.torch import save_file

    small = {n: q.detach().float().cpu().contiguous() for n, q in student.named_parameters()
             if ".kv_fusion." in n or n.endswith("norm.weight")}
    small.update({k: v.to(torch.bfloat16).cpu().contiguous() for k, v in lora_state(student).items()})
    tag = f"{a.preset}_{'cuda' if dev.startswith('cuda') else 'cpu'}"
    out_dir = a.out_dir or os.path.join(os.path.dirname(HERE), "results")
    os.makedirs(out_dir, exist_ok=True)
    wpath = os.path.join(out_dir, f"fusedkv_retrofit_weights_{tag}.safetensors")
    save_file(small, wpath, metadata={CONFIG_KEY: json.dumps(fk.to_dict()), "lora_scale": str(p["alpha"] / p["rank"]),
                                      "lora_rank": str(p["rank"]), "base_fingerprint": base_fp,
                                      "base_model": os.path.basename(os.path.normpath(a.model))})
    res["weights_file"] = os.path.basename(wpath)
    res["weights_file_bytes"] = os.path.getsize(wpath)
    tmp = tempfile.mkdtemp(prefix="fusedkv_converted_")
    try:
        conv_dir = build_converted(wpath, os.path.join(tmp, "model"), a.model)
        converted = load_lm(conv_dir, dev)
        res["reloaded_ppl"] = perplexity(converted, evals, p["batch"], dev, dtype)
        print(f"final {res['final_ppl']:.3f} ({100 * res['final_ppl_rel']:+.2f}% vs original), "
              f"rebuilt dir {res['reloaded_ppl']:.3f}", flush=True)
        if not a.no_answers:
            res["answers"] = answers(a.model, {"original": teacher, "fusedkv": converted}, PROMPTS, p["max_new"], dev)
            for r in res["answers"]:
                print(json.dumps(r, ensure_ascii=False), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["wall_s"] = time.perf_counter() - t_start
    path = write_json(f"fusedkv_retrofit_{tag}", res, out_dir)
    plot(res, path[:-5] + ".png")
    print(f"wrote {path} and {wpath}")
    return res


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ppl0 = res["original_ppl"]
    pts = [c for c in res["curve"] if c["stage"] in ("A", "B")]
    na = max([c["step"] for c in pts if c["stage"] == "A"], default=0)
    xs = [c["step"] + (na if c["stage"] == "B" else 0) for c in pts]
    ax.plot([0] + xs, [res["lstsq_ppl"]] + [c["ppl"] for c in pts], marker=".", label="FusedKV (lstsq init, A: fusion, B: +LoRA)")
    ax.axhline(ppl0, color="k", ls="--", label=f"original {ppl0:.2f}")
    ax.axhline(1.03 * ppl0, color="g", ls=":", label="original +3%")
    ax.axhline(res["lite_ppl"], color="r", ls=":", label=f"Lite, untuned {res['lite_ppl']:.1f}")
    if na:
        ax.axvline(na, color="gray", alpha=0.4)
    ax.set_yscale("log")
    ax.set(xlabel="tuning step", ylabel="held-out PPL (log)",
           title=f"SmolLM2 -> FusedKV retrofit, {res['device']}: final {res['final_ppl']:.2f} "
                 f"({100 * res['final_ppl_rel']:+.1f}%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
