"""Perplexity per domain, the retrofit's PPL-vs-GPU-minutes curve, and its extrapolation.

Extrapolation: over the curve's points after warm-up, the excess log-perplexity over the teacher,
e(t) = log(PPL(t) / PPL_teacher), is fitted as a power law of training minutes,
log e = log A - alpha log t (least squares in log-log). The budget that reaches a target ratio r
(1.03: +3%) is then t* = (A / log r)^(1 / alpha). It assumes the fitted trend continues, which the
data also bounds (more epochs over the same tokens); it says nothing when the curve is not falling.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch: int, autocast) -> float:
    """exp(mean NLL) of windows [N, T + 1] (input + shifted target)."""
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    nll, n = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        b = windows[i:i + batch].to(dev)
        with autocast():
            logits = model(b[:, :-1])
        nll += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1), reduction="sum").item()
        n += b[:, 1:].numel()
    model.train(was_training)
    return math.exp(nll / n)


def domain_ppl(model, evals: dict[str, torch.Tensor], batch: int, autocast) -> dict[str, float]:
    return {d: perplexity(model, w, batch, autocast) for d, w in evals.items()}


def fit_power_law(minutes: list[float], excess: list[float]) -> tuple[float, float] | None:
    """(A, alpha) of excess = A * minutes^-alpha by least squares in log-log; None when fewer than
    3 usable points or when the fit does not fall (alpha <= 0)."""
    pts = [(math.log(t), math.log(e)) for t, e in zip(minutes, excess) if t > 0 and e > 0]
    if len(pts) < 3:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    if slope >= 0:
        return None
    return math.exp(my - slope * mx), -slope


# A fitted budget past this many GPU-minutes (about two years) is reported as out of reach.
MAX_EXTRAPOLATED_MINUTES = 1e6


def extrapolate(curve: list[dict], teacher: dict[str, float], targets: dict[str, float],
                skip_minutes: float = 0.0) -> dict:
    """Per domain: the fitted power law over the curve's points past skip_minutes and the minutes at
    which it reaches PPL <= target x teacher (None where it does not fall, or the target is met, or
    the fit puts it past MAX_EXTRAPOLATED_MINUTES, which then sets "beyond_minutes")."""
    out = {}
    for d, ratio in targets.items():
        pts = [(c["gpu_min"], math.log(c["ppl"][d] / teacher[d])) for c in curve
               if c["gpu_min"] > skip_minutes and d in c["ppl"]]
        fit = fit_power_law([t for t, _ in pts], [e for _, e in pts])
        row = {"target_ratio": ratio, "points": len(pts), "fit": None, "minutes_to_target": None}
        if pts and pts[-1][1] <= math.log(ratio):
            row["met_at_min"] = pts[-1][0]
        if fit is not None:
            A, alpha = fit
            row["fit"] = {"A": A, "alpha": alpha}
            # In log space: a shallow fit (alpha near 0) puts the target past any float; such a
            # budget is reported as unreachable (None) rather than overflowing.
            log_minutes = (math.log(A) - math.log(math.log(ratio))) / alpha
            if log_minutes <= math.log(MAX_EXTRAPOLATED_MINUTES):
                row["minutes_to_target"] = math.exp(log_minutes)
            else:
                row["beyond_minutes"] = MAX_EXTRAPOLATED_MINUTES
        out[d] = row
    return out


def plot(report: dict, path: str) -> None:
    """PPL / teacher PPL per domain against training GPU-minutes, targets and the fitted trend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    curve, teacher = report["curve"], report["teacher_ppl"]
    for i, d in enumerate(sorted(teacher)):
        xs = [c["gpu_min"] for c in curve if d in c["ppl"]]
        ys = [c["ppl"][d] / teacher[d] for c in curve if d in c["ppl"]]
        ax.plot(xs, ys, "o-", color=f"C{i}", label=f"{d} (teacher PPL {teacher[d]:.2f})")
        ex = report.get("extrapolation", {}).get(d, {})
        if ex.get("fit") and xs:
            A, alpha = ex["fit"]["A"], ex["fit"]["alpha"]
            t_end = max(xs[-1], min(ex["minutes_to_target"] or xs[-1], 100 * xs[-1]))
            ts = [xs[-1] * (t_end / xs[-1]) ** (k / 40) for k in range(41)]
            ax.plot(ts, [math.exp(A * t ** -alpha) for t in ts], "--", color=f"C{i}", alpha=0.6,
                    label=f"{d}: fitted trend" + (f", target at {ex['minutes_to_target']:.0f} min"
                                                  if ex["minutes_to_target"] else ""))
        ax.axhline(report["targets"][d], color=f"C{i}", ls=":", alpha=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(xlabel="training GPU-minutes (evaluation excluded)", ylabel="PPL / teacher PPL",
           title=f"{report['variant']} retrofit of {report['model_name']}, {report['device']}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
