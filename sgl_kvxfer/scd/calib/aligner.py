"""Patch aligners g: code z_h [r_h] -> the consumer's normalized pre-attention state [hidden].

g(z) = u W_lin + b_lin + gelu(u W1 + b1) W2 + b2 with u = z / scale (codec.apply_aligner, the
same function serves training and inference). The linear part starts at the closed-form ridge
decoder of the joint H fit and W2 starts at zero, so training (Adam, cosine LR) starts from the
linear solution. Loss (normalized MSE, the paper's L2 on H, plus an optional auxiliary term
on what the consumer actually uses, its own K/V projections of h):

    |g(z) - h_B|^2 / var(h_B)  +  aux * |(g(z) - h_B) W_kv^T|^2 / var(h_B W_kv^T)

Training runs until the held-out loss (checked every `eval_every` steps) has not improved for
`patience` checks (early stopping), or `steps` (a cap), or `time_budget_s`; the parameters of
the best check are kept and the report says which step that was and why training stopped.
"""
from __future__ import annotations

import math
import time

import torch

from sgl_kvxfer.scd.codec import apply_aligner


def train_aligner(z: torch.Tensor, target: torch.Tensor, lin_w: torch.Tensor, lin_b: torch.Tensor, width: int,
                  steps: int = 300, lr: float = 1e-3, batch: int = 2048, w_kv: torch.Tensor | None = None,
                  aux: float = 1.0, seed: int = 0, val_frac: float = 0.1, eval_every: int = 50,
                  patience: int = 4, time_budget_s: float = 0.0):
    """z [n, r_h], target [n, hidden] (float32, one device); lin_w [r_h, hidden], lin_b [hidden]:
    the closed-form decoder (h ~ z lin_w + lin_b). w_kv [kv_rows, hidden] or None.
    Returns (params dict of codec.ALIGNER_PARAMS, report)."""
    dev = z.device
    g = torch.Generator(device="cpu").manual_seed(seed)
    perm = torch.randperm(z.shape[0], generator=g).to(dev)
    n_val = max(1, int(z.shape[0] * val_frac)) if z.shape[0] > 10 else 0
    val, tr = perm[:n_val], perm[n_val:]
    r_h, hidden = lin_w.shape
    scale = z[tr].std(0).clamp(min=1e-6)
    p = {"scale": scale,
         "lin_w": (scale[:, None] * lin_w).clone(), "lin_b": lin_b.clone(),
         "w1": torch.randn(r_h, width, generator=g).to(dev) / math.sqrt(r_h),
         "b1": torch.zeros(width, device=dev),
         "w2": torch.zeros(width, hidden, device=dev), "b2": torch.zeros(hidden, device=dev)}
    train_keys = [k for k in p if k != "scale"]
    for k in train_keys:
        p[k].requires_grad_(True)
    t_var = target[tr].var(0).sum().clamp(min=1e-12)
    kv_var = (target[tr] @ w_kv.T).var(0).sum().clamp(min=1e-12) if w_kv is not None else None

    def loss_fn(idx):
        err = apply_aligner(p, z[idx]) - target[idx]
        loss = err.pow(2).sum(-1).mean() / t_var
        if w_kv is not None and aux:
            loss = loss + aux * (err @ w_kv.T).pow(2).sum(-1).mean() / kv_var
        return loss

    def val_loss():
        with torch.no_grad():
            return float(loss_fn(val if n_val else tr))

    opt = torch.optim.Adam([p[k] for k in train_keys], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * s / max(1, steps))))
    best = start = val_loss()
    best_p = {k: v.detach().clone() for k, v in p.items()}
    best_step, stale, stopped, t0 = 0, 0, "max_steps", time.perf_counter()
    for step in range(1, steps + 1):
        idx = tr[torch.randint(0, tr.numel(), (min(batch, tr.numel()),), generator=g).to(dev)]
        loss = loss_fn(idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % eval_every == 0 or step == steps:
            cur = val_loss()
            if cur < best * (1 - 1e-4):
                best, best_step, stale = cur, step, 0
                best_p = {k: v.detach().clone() for k, v in p.items()}
            else:
                stale += 1
            if patience and stale >= patience:
                stopped = "patience"
                break
            if time_budget_s and time.perf_counter() - t0 > time_budget_s:
                stopped = "time"
                break
    report = {"val_loss_linear": round(start, 6), "val_loss_best": round(best, 6), "best_step": best_step,
              "steps_run": step if steps else 0, "stopped": stopped, "train_tokens": int(tr.numel()),
              "val_tokens": int(n_val)}
    return best_p, report
