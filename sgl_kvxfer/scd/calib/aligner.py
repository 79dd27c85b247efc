"""Patch aligners g: code z_h [r_h] -> the consumer's normalized pre-attention state [hidden].

g(z) = u W_lin + b_lin + gelu(u W1 + b1) W2 + b2 with u = z / scale (codec.apply_aligner, the
same function serves training and inference). The linear part starts at the closed-form ridge
decoder of the joint H fit and W2 starts at zero, so training (Adam, cosine LR over the steps or,
with a time budget, over whichever of steps and time runs out first) starts from the linear
solution. Loss (normalized MSE, the paper's L2 on H, plus an auxiliary term on what the
consumer actually uses, its own K/V projections of h):

    h_weight * |g(z) - h_B|^2 / var(h_B)  +  aux * |(g(z) - h_B) W_kv^T|^2 / var(h_B W_kv^T)

The second term is the error of the regenerated K/V exactly as the engine applies them: RoPE
rotates each key pair by an angle of its position only, an orthogonal map, so it leaves the L2
error of K unchanged and the loss needs no positions. h_weight < 1 spends the aligner's capacity
on the directions W_k and W_v read rather than on the rest of h.

Training runs until the held-out loss (checked every `eval_every` steps) has not improved for
`patience` checks (early stopping), or `steps` (a cap), or `time_budget_s` (from the call's
start, set-up included; the clock is read every step and a final check taken when it ends the
run); the parameters of the best check are kept and the report says which step that was and
why training stopped.
`train_aligners` trains the aligners of several consumers of one patch layer side by side, or
of several patch layers at once (one code per item); each item is independent of the others.
Batches are drawn on the device (no host round trip per step); on CUDA the matmuls of training
use TF32 (the aligners' inputs are bf16-rounded codes, far coarser than TF32's mantissa).
"""
from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.nn.functional as F


def train_aligner(z: torch.Tensor, target: torch.Tensor, lin_w: torch.Tensor, lin_b: torch.Tensor, width: int,
                  steps: int = 300, lr: float = 1e-3, batch: int = 2048, w_kv: torch.Tensor | None = None,
                  aux: float = 1.0, seed: int = 0, val_frac: float = 0.1, eval_every: int = 50,
                  patience: int = 4, time_budget_s: float = 0.0, h_weight: float = 1.0):
    """z [n, r_h], target [n, hidden] (float32, one device); lin_w [r_h, hidden], lin_b [hidden]:
    the closed-form decoder (h ~ z lin_w + lin_b). w_kv [kv_rows, hidden] or None.
    Returns (params dict of codec.ALIGNER_PARAMS, report)."""
    (params, report), = train_aligners(z, [target], [lin_w], [lin_b], width, steps, lr, batch,
                                       None if w_kv is None else [w_kv], aux, seed, val_frac, eval_every,
                                       patience, time_budget_s, h_weight)
    return params, report


def _stacked_forward(p: dict[str, torch.Tensor], z: torch.Tensor) -> torch.Tensor:
    """codec.apply_aligner for C aligners at once: params with a leading item dim, z [C, B, r_h]
    (one code per item) -> [C, B, hidden]."""
    u = z / p["scale"][:, None]
    out = torch.baddbmm(p["lin_b"][:, None], u, p["lin_w"])
    if p["w1"].shape[-1]:
        out = out + torch.baddbmm(p["b2"][:, None], F.gelu(torch.baddbmm(p["b1"][:, None], u, p["w1"])), p["w2"])
    return out


def train_aligners(z: torch.Tensor | list[torch.Tensor], targets: list[torch.Tensor], lin_ws: list[torch.Tensor],
                   lin_bs: list[torch.Tensor], width: int, steps: int = 300, lr: float = 1e-3, batch: int = 2048,
                   w_kvs: list[torch.Tensor] | None = None, aux: float = 1.0, seed: int = 0, val_frac: float = 0.1,
                   eval_every: int = 50, patience: int = 4, time_budget_s: float = 0.0, h_weight: float = 1.0,
                   init: list[dict[str, torch.Tensor]] | None = None):
    """C aligners trained side by side as one stacked model: z [n, r_h] is the code every item
    reads (the consumers of one patch layer), or a list of C codes [n, r_h] (items of several
    patch layers: rows are the same tokens). Each item's loss depends only on its own parameters
    and Adam is elementwise, so each follows the trajectory it would alone (same split, batches
    and initialization: one seed), at the launch cost of one. Early stopping is per item (a
    stopped one keeps its best check); time_budget_s bounds the whole. init: per item, trained
    parameters (codec.ALIGNER_PARAMS, scale included) to resume from instead of the linear start
    (lin_ws / lin_bs are then unused); the report's val_loss_linear is then the resumed loss.
    Returns [(params, report)] per item."""
    t0 = time.perf_counter()  # the time budget covers the set-up and the checks too
    n_c = len(targets)
    zs = torch.stack(z) if isinstance(z, (list, tuple)) else z.expand(n_c, -1, -1)  # [C, n, r_h]
    if zs.shape[0] != n_c:
        raise ValueError(f"{zs.shape[0]} codes for {n_c} aligners")
    dev, n = zs.device, zs.shape[1]
    g = torch.Generator(device="cpu").manual_seed(seed)
    perm = torch.randperm(n, generator=g).to(dev)
    n_val = max(1, int(n * val_frac)) if n > 10 else 0
    val, tr = perm[:n_val], perm[n_val:]
    r_h, hidden = lin_ws[0].shape
    w1 = torch.randn(r_h, width, generator=g).to(dev) / math.sqrt(r_h)  # drawn either way: same batches after
    # batches drawn where the data is: a host-side draw copied over each step would make every
    # step wait for the one before it (the copy from pageable memory synchronizes)
    gd = torch.Generator(device=dev).manual_seed(seed)
    if init is not None:
        if len(init) != n_c or any(q["w1"].shape != (r_h, width) for q in init):
            raise ValueError(f"init: {n_c} aligners of width {width} expected")
        p = {k: torch.stack([q[k].to(dev).float() for q in init]).clone() for k in ("lin_w", "lin_b", "w1", "b1",
                                                                                   "w2", "b2")}
        scale = torch.stack([q["scale"].to(dev).float() for q in init])
    else:
        scale = zs[:, tr].std(1).clamp(min=1e-6)  # [C, r_h]
        p = {"lin_w": torch.stack([s[:, None] * w for s, w in zip(scale, lin_ws)]), "lin_b": torch.stack(lin_bs).clone(),
             "w1": w1.expand(n_c, -1, -1).clone(), "b1": torch.zeros(n_c, width, device=dev),
             "w2": torch.zeros(n_c, width, hidden, device=dev), "b2": torch.zeros(n_c, hidden, device=dev)}
    for v in p.values():
        v.requires_grad_(True)
    p["scale"] = scale
    tgt = torch.stack(targets).float()  # [C, n, hidden]
    # per item: a [C, n_train, hidden] gather of every item at once would double the data's memory
    t_var = torch.stack([tgt[i, tr].var(0).sum() for i in range(n_c)]).clamp(min=1e-12)  # [C]
    wkv = torch.stack(w_kvs).float() if w_kvs is not None and aux else None  # [C, kv_rows, hidden]
    kv_var = None if wkv is None else torch.stack(
        [(tgt[i, tr] @ wkv[i].T).var(0).sum() for i in range(n_c)]).clamp(min=1e-12)

    def loss_fn(idx):  # [C]
        err = _stacked_forward(p, zs[:, idx]) - tgt[:, idx]
        loss = h_weight * err.pow(2).sum(-1).mean(-1) / t_var
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

    tf32 = (torch.backends.cuda.matmul, "allow_tf32", dev.type == "cuda")
    with _flag(*tf32):
        return _train(p, train_keys, opt, loss_fn, val_loss, set_lr, tr, gd, dev, n_c, n_val, steps, batch,
                      eval_every, patience, time_budget_s, t0, lr)


@contextlib.contextmanager
def _flag(obj, name: str, on: bool):
    old = getattr(obj, name)
    setattr(obj, name, on or old)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _train(p, train_keys, opt, loss_fn, val_loss, set_lr, tr, gd, dev, n_c, n_val, steps, batch, eval_every,
           patience, time_budget_s, t0, lr):
    start = val_loss()
    best = list(start)
    best_p = {k: v.detach().clone() for k, v in p.items()}
    best_step, stale, stopped = [0] * n_c, [0] * n_c, [None] * n_c
    steps_run, step = [0] * n_c, 0
    for step in range(1, steps + 1):
        idx = tr[torch.randint(0, tr.numel(), (min(batch, tr.numel()),), generator=gd, device=dev)]
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
        params = {k: best_p[k][i].clone() for k in ("scale", *train_keys)}
        report = {"val_loss_linear": round(start[i], 6), "val_loss_best": round(best[i], 6),
                  "best_step": best_step[i], "steps_run": steps_run[i] if steps else 0,
                  "stopped": stopped[i] or "max_steps", "train_tokens": int(tr.numel()), "val_tokens": int(n_val),
                  "lr_last": opt.param_groups[0]["lr"] / lr}
        out.append((params, report))
    return out
