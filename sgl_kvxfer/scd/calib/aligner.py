"""Patch aligners g: code z_h [r_h] -> the consumer's normalized pre-attention state [hidden].

g(z) = u W_lin + b_lin + gelu(u W1 + b1) W2 + b2 with u = z / scale (codec.apply_aligner, the
same function serves training and inference). The linear part starts at the closed-form ridge
decoder of the joint H fit and W2 starts at zero, so training (Adam, cosine LR over the steps or,
with a time budget, over whichever of steps and time runs out first) starts from the linear
solution. Loss (normalized MSE, the paper's L2 on H, plus an optional auxiliary term
on what the consumer actually uses, its own K/V projections of h):

    |g(z) - h_B|^2 / var(h_B)  +  aux * |(g(z) - h_B) W_kv^T|^2 / var(h_B W_kv^T)

Training runs until the held-out loss (checked every `eval_every` steps) has not improved for
`patience` checks (early stopping), or `steps` (a cap), or `time_budget_s` (from the call's
start, set-up included; the clock is read every step and a final check taken when it ends the
run); the parameters of the best check are kept and the report says which step that was and
why training stopped.
`train_aligners` trains the aligners of several consumers of one patch layer side by side.
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F


def train_aligner(z: torch.Tensor, target: torch.Tensor, lin_w: torch.Tensor, lin_b: torch.Tensor, width: int,
                  steps: int = 300, lr: float = 1e-3, batch: int = 2048, w_kv: torch.Tensor | None = None,
                  aux: float = 1.0, seed: int = 0, val_frac: float = 0.1, eval_every: int = 50,
                  patience: int = 4, time_budget_s: float = 0.0):
    """z [n, r_h], target [n, hidden] (float32, one device); lin_w [r_h, hidden], lin_b [hidden]:
    the closed-form decoder (h ~ z lin_w + lin_b). w_kv [kv_rows, hidden] or None.
    Returns (params dict of codec.ALIGNER_PARAMS, report)."""
    (params, report), = train_aligners(z, [target], [lin_w], [lin_b], width, steps, lr, batch,
                                       None if w_kv is None else [w_kv], aux, seed, val_frac, eval_every,
                                       patience, time_budget_s)
    return params, report


def _stacked_forward(p: dict[str, torch.Tensor], z: torch.Tensor) -> torch.Tensor:
    """codec.apply_aligner for C aligners at once: params with a leading consumer dim, z [B, r_h]
    shared -> [C, B, hidden]."""
    u = (z / p["scale"]).expand(p["lin_w"].shape[0], -1, -1)
    out = torch.baddbmm(p["lin_b"][:, None], u, p["lin_w"])
    if p["w1"].shape[-1]:
        out = out + torch.baddbmm(p["b2"][:, None], F.gelu(torch.baddbmm(p["b1"][:, None], u, p["w1"])), p["w2"])
    return out


def train_aligners(z: torch.Tensor, targets: list[torch.Tensor], lin_ws: list[torch.Tensor],
                   lin_bs: list[torch.Tensor], width: int, steps: int = 300, lr: float = 1e-3, batch: int = 2048,
                   w_kvs: list[torch.Tensor] | None = None, aux: float = 1.0, seed: int = 0, val_frac: float = 0.1,
                   eval_every: int = 50, patience: int = 4, time_budget_s: float = 0.0):
    """The aligners of C consumers from one code z, trained side by side as one stacked model:
    each consumer's loss depends only on its own parameters and Adam is elementwise, so each
    follows the trajectory it would alone (same split, batches and initialization: one seed), at
    the launch cost of one. Early stopping is per consumer (a stopped one keeps its best check);
    time_budget_s bounds the whole. Returns [(params, report)] per consumer."""
    t0 = time.perf_counter()  # the time budget covers the set-up and the checks too
    dev, n_c = z.device, len(targets)
    g = torch.Generator(device="cpu").manual_seed(seed)
    perm = torch.randperm(z.shape[0], generator=g).to(dev)
    n_val = max(1, int(z.shape[0] * val_frac)) if z.shape[0] > 10 else 0
    val, tr = perm[:n_val], perm[n_val:]
    r_h, hidden = lin_ws[0].shape
    scale = z[tr].std(0).clamp(min=1e-6)
    w1 = torch.randn(r_h, width, generator=g).to(dev) / math.sqrt(r_h)
    p = {"lin_w": torch.stack([scale[:, None] * w for w in lin_ws]), "lin_b": torch.stack(lin_bs).clone(),
         "w1": w1.expand(n_c, -1, -1).clone(), "b1": torch.zeros(n_c, width, device=dev),
         "w2": torch.zeros(n_c, width, hidden, device=dev), "b2": torch.zeros(n_c, hidden, device=dev)}
    for v in p.values():
        v.requires_grad_(True)
    p["scale"] = scale
    tgt = torch.stack(targets)  # [C, n, hidden]
    t_var = tgt[:, tr].var(1).sum(-1).clamp(min=1e-12)  # [C]
    wkv = torch.stack(w_kvs) if w_kvs is not None and aux else None  # [C, kv_rows, hidden]
    kv_var = (tgt[:, tr] @ wkv.transpose(1, 2)).var(1).sum(-1).clamp(min=1e-12) if wkv is not None else None

    def loss_fn(idx):  # [C]
        err = _stacked_forward(p, z[idx]) - tgt[:, idx]
        loss = err.pow(2).sum(-1).mean(-1) / t_var
        if wkv is not None:
            loss = loss + aux * (err @ wkv.transpose(1, 2)).pow(2).sum(-1).mean(-1) / kv_var
        return loss

    def val_loss() -> list[float]:
        with torch.no_grad():
            return loss_fn(val if n_val else tr).tolist()

    train_keys = [k for k in p if k != "scale"]
    opt = torch.optim.Adam([p[k] for k in train_keys], lr=lr)

    def set_lr(s: int) -> None:
        """Cosine from lr to 0.05 lr over the run: its progress is the larger of steps done and,
        with a time budget, time spent (a run the clock ends still anneals, whatever the GPU's speed)."""
        frac = s / max(1, steps)
        if time_budget_s:
            frac = max(frac, (time.perf_counter() - t0) / time_budget_s)
        for group in opt.param_groups:
            group["lr"] = lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    start = val_loss()
    best = list(start)
    best_p = {k: v.detach().clone() for k, v in p.items()}
    best_step, stale, stopped = [0] * n_c, [0] * n_c, [None] * n_c
    steps_run, step = [0] * n_c, 0
    for step in range(1, steps + 1):
        idx = tr[torch.randint(0, tr.numel(), (min(batch, tr.numel()),), generator=g).to(dev)]
        loss = loss_fn(idx).sum()  # consumers' parameters are disjoint: each gets its own gradient
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        set_lr(step)
        # the clock is read every step (the budget ends within a step and one held-out check of
        # it; on CUDA the check's .tolist() waits for the queued steps, so the next read is true)
        out_of_time = bool(time_budget_s) and time.perf_counter() - t0 > time_budget_s
        if step % eval_every == 0 or step == steps or out_of_time:
            cur = val_loss()
            for i in range(n_c):
                if stopped[i]:
                    continue
                steps_run[i] = step
                if cur[i] < best[i] * (1 - 1e-4):
                    best[i], best_step[i], stale[i] = cur[i], step, 0
                    for k in train_keys:
                        best_p[k][i] = p[k][i].detach()
                else:
                    stale[i] += 1
                if patience and stale[i] >= patience:
                    stopped[i] = "patience"
            if all(stopped):
                break
            if out_of_time:
                stopped = [x or "time" for x in stopped]
                break
    out = []
    for i in range(n_c):
        params = {k: best_p[k] if k == "scale" else best_p[k][i].clone() for k in ("scale", *train_keys)}
        report = {"val_loss_linear": round(start[i], 6), "val_loss_best": round(best[i], 6),
                  "best_step": best_step[i], "steps_run": steps_run[i] if steps else 0,
                  "stopped": stopped[i] or "max_steps", "train_tokens": int(tr.numel()), "val_tokens": int(n_val),
                  "lr_last": opt.param_groups[0]["lr"] / lr}
        out.append((params, report))
    return out
