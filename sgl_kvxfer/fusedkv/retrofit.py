"""Retrofit FusedKV / FusedKV-Lite onto a pretrained Llama-family model by distillation.

The student starts as the teacher (the original model) with its top half's k_proj / v_proj
removed, and learns to reproduce the teacher within a budget of training seconds (the clock
counts training work only, evaluation excluded):

    sources  `sources="search"`: the storage layers whose K/V best explain the top half's, by
             least squares over every pair (distill.source_search); "paper": (0, n - 1)
    init     FusedKV, `init="closed_form"` (default; closed_form.py): the key weights by a
             RoPE-aware least-squares fit whose per-pair rotation goes into q_proj, the value
             weights by alternating least squares, then each reconstruction layer's o_proj
             regressed onto the teacher's attention output; `"channel_lstsq"`: the fusion weights
             alone, per channel (distill.lstsq_fusion_init). Lite has no weights
    local    `local_frac` of the budget: attention-output matching, every reconstruction layer
             against the teacher's attention output from the teacher's input (q_proj, o_proj,
             fusion weights; distill.AttentionMatcher)
    distill  the rest: KL(teacher || student) on next-token distributions + hidden_weight x the
             relative error of every layer's residual stream, AdamW over every weight
             (train_scope "all"), all but the token embedding and output head ("blocks"), the
             attention projections and fusion weights ("attn"), or the reconstruction layers
             and final norm only ("top"); the
             step count is planned from measured step times, linear warm-up then cosine to
             min_lr_frac; fusion weights at their own learning rate; optional regularizers
             against fitting the training windows: `anchor_decay` (a pull towards the phase's
             starting weights) and `ema` (an average of the weights, evaluated and kept).
             `compile`: the blocks and the losses under torch.compile for this phase
             (model.compile_blocks); the compile time counts in the budget (the first step's
             time, `distill_first_step_s`)

Perplexity per eval domain is measured at `eval_points` points along the way: the curve of PPL
against training GPU-minutes, with the power-law extrapolation of curve.py. No cross-entropy on
the training text: fitting the domain could push the student's PPL below the teacher's, which
would say nothing about how faithful the conversion is.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch

from sgl_kvxfer.fusedkv import curve as curves
from sgl_kvxfer.fusedkv.closed_form import closed_form_init
from sgl_kvxfer.fusedkv.checkpoint import load_lm
from sgl_kvxfer.fusedkv.data import EpochBatches, ShiftedWindows, Tokenized, chunks, mixed_chunks
from sgl_kvxfer.fusedkv.distill import AttentionMatcher, distill_loss, lstsq_fusion_init, source_search
from sgl_kvxfer.fusedkv.model import LM, compile_blocks
from sgl_kvxfer.fusedkv.runctl import Progress, StopOnInterrupt, TrainClock
from sgl_kvxfer.models.fusedkv_math import CONFIG_KEY

TARGETS = {"prose": 1.03, "code": 1.05}  # PPL ratio to the teacher per domain; other domains: 1.03
# what the distill phase trains (trainable()): every weight; every weight but the token
# embedding (tied to the output head in SmolLM2: the largest matrix, and its rows of tokens the
# training windows hold get updates that rows of other tokens do not); the attention projections
# and fusion weights only; the reconstruction layers and the final norm only
SCOPES = ("all", "blocks", "attn", "top")
SOURCES = ("search", "paper")
INITS = ("closed_form", "channel_lstsq")
REPLAN_STEP = 25  # the distill step count is planned after the probe steps and again here


@dataclass(frozen=True)
class RetrofitConfig:
    variant: str = "fusedkv"  # fusedkv | lite
    num_storage_layers: int | None = None  # None: half the layers
    sources: str = "search"
    init: str = "closed_form"  # FusedKV's start (INITS)
    budget_s: float = 1200.0  # training seconds (init + local + distill), evaluation excluded
    seq: int = 512
    batch: int = 16
    lr: float = 2e-4  # peak, pretrained weights
    lr_fusion: float = 1e-2  # fusion weights (O(1) values, a handful of them)
    warmup_frac: float = 0.05
    min_lr_frac: float = 0.1
    local_frac: float = 0.2
    local_lr: float = 5e-4  # peak; cosine to a tenth over the local phase
    hidden_weight: float = 0.5
    train_scope: str = "all"
    eval_windows: int = 32  # per domain
    # held-out windows' length (None: seq). Longer than seq, the PPL covers positions the training
    # windows never reach: the fit is to the distances trained at
    eval_seq: int | None = None
    eval_points: int = 12
    calib_windows: int = 64
    max_train_windows: int | None = None
    probe_steps: int = 3
    compile: bool = False  # torch.compile the blocks and losses for the distill phase (model.compile_blocks)
    # each pass over the training text cuts its windows at a fresh offset (data.ShiftedWindows);
    # not with max_train_windows (a capped set of windows stays that set)
    shift_windows: bool = False
    # distill phase, regularizers against fitting the training windows (0: off).
    # anchor_decay: after each step every pretrained weight moves towards its value at the start of
    # the phase by lr * anchor_decay of the gap (decoupled, like AdamW's weight decay, but towards
    # the starting weights rather than zero). ema: an exponential moving average of the trained
    # weights (decay min(ema, (1 + t) / (10 + t)) at step t) is what the curve evaluates and what
    # the converter saves
    anchor_decay: float = 0.0
    ema: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if self.variant not in ("fusedkv", "lite"):
            raise ValueError(f"variant must be fusedkv or lite, got {self.variant!r}")
        if self.sources not in SOURCES:
            raise ValueError(f"sources must be one of {SOURCES}, got {self.sources!r}")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        if self.train_scope not in SCOPES:
            raise ValueError(f"train_scope must be one of {SCOPES}, got {self.train_scope!r}")
        if not (math.isfinite(self.budget_s) and self.budget_s >= 0):
            raise ValueError(f"budget_s must be finite and >= 0, got {self.budget_s}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be finite and > 0, got {self.lr}")
        if not 0 <= self.local_frac < 1 or not 0 <= self.warmup_frac < 1:
            raise ValueError("local_frac and warmup_frac must be in [0, 1)")
        for name in ("seq", "batch", "eval_windows", "eval_points", "calib_windows", "probe_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_seq is not None and self.eval_seq < 1:
            raise ValueError(f"eval_seq must be >= 1, got {self.eval_seq}")
        if not (math.isfinite(self.anchor_decay) and self.anchor_decay >= 0):
            raise ValueError(f"anchor_decay must be finite and >= 0, got {self.anchor_decay}")
        if not 0 <= self.ema < 1:
            raise ValueError(f"ema must be in [0, 1), got {self.ema}")
        if self.shift_windows and self.max_train_windows is not None:
            raise ValueError("shift_windows cuts whole domains: it does not combine with max_train_windows")


def autocast_for(device: str):
    if device.startswith("cuda"):
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def student_from(teacher: LM, cfg: RetrofitConfig, sources: tuple[int, int] | None = None) -> LM:
    """A FusedKV / Lite LM holding the teacher's weights (the top half's k/v projections dropped);
    FusedKV's fusion weights start as Lite (K from source 1, V from source 0)."""
    m = LM(teacher.config.with_layout(cfg.variant, num_storage_layers=cfg.num_storage_layers, init="lite",
                                      source_layers=sources))
    m.init_weights()  # fusion weights per init; every other weight is overwritten next
    own = m.state_dict()
    missing = m.load_state_dict({k: v for k, v in teacher.state_dict().items() if k in own}, strict=False).missing_keys
    if any(".kv_fusion." not in k for k in missing):
        raise ValueError(f"teacher lacks student weights: {missing[:4]}")
    return m.to(next(teacher.parameters()).device)


def spaced(windows: torch.Tensor, n: int) -> torch.Tensor:
    """n windows spread evenly over the split (every document region, not only its start)."""
    if windows.shape[0] <= n:
        return windows
    return windows[torch.linspace(0, windows.shape[0] - 1, n).round().long()]


def _lr_factor(step: int, steps: int, warmup: int, floor: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def _in_scope(name: str, scope: str, top: set[int]) -> bool:
    """Whether parameter `name` of a student trains under `scope` (SCOPES)."""
    if scope == "all":
        return True
    if scope == "blocks":
        return not (name.startswith("model.embed_tokens.") or name.startswith("lm_head."))
    if scope == "attn":
        return ".self_attn." in name or ".kv_fusion." in name
    if scope == "top":
        return name == "model.norm.weight" or (name.startswith("model.layers.") and int(name.split(".")[2]) in top)
    raise ValueError(f"train scope must be one of {SCOPES}, got {scope!r}")


def trainable(student: LM, scope: str) -> tuple[list, list]:
    """(matrices + norms, fusion weights) to train under `scope`; every other weight is frozen."""
    top = {i for i in range(student.config.num_layers) if not student.config.stores(i)}
    main, fusion = [], []
    for name, p in student.named_parameters():
        if not _in_scope(name, scope, top):
            p.requires_grad_(False)
            continue
        p.requires_grad_(True)
        (fusion if ".kv_fusion." in name else main).append(p)
    return main, fusion


class DistillStep:
    """One distillation step of `student` towards `teacher` on a batch of windows: the loss under
    autocast, backward, gradient clipping at 1.0, AdamW (fused on CUDA) over the weights of
    cfg.train_scope, fusion weights at cfg.lr_fusion; then cfg.anchor_decay's pull towards the
    starting weights and cfg.ema's average (RetrofitConfig). The caller sets the learning rates of
    `opt.param_groups` before each call; `averaged()` puts the average in the student for a while,
    `settle()` for good."""

    def __init__(self, student: LM, teacher: LM, cfg: RetrofitConfig, device: str):
        self.student, self.teacher, self.cfg = student, teacher, cfg
        self.autocast = autocast_for(device)
        self.params = trainable(student, cfg.train_scope)
        main, fusion = self.params
        groups = [{"params": main, "lr": cfg.lr}] + ([{"params": fusion, "lr": cfg.lr_fusion}] if fusion else [])
        self.opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=0.0, fused=device.startswith("cuda"))
        self.anchor = [p.detach().clone() for p in main] if cfg.anchor_decay else None
        self.average = [p.detach().clone() for p in main + fusion] if cfg.ema else None
        self.steps = 0

    def __call__(self, ids: torch.Tensor) -> dict:
        """ids [B, T] on the device -> {"kl", "hidden"} (detached)."""
        with self.autocast():
            loss, parts = distill_loss(self.student, self.teacher, ids, self.cfg.hidden_weight, compiled=self.cfg.compile)
        loss.backward()
        main, fusion = self.params
        torch.nn.utils.clip_grad_norm_(main + fusion, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            if self.anchor is not None:
                pull = min(1.0, self.opt.param_groups[0]["lr"] * self.cfg.anchor_decay)
                torch._foreach_lerp_(main, self.anchor, pull)
            if self.average is not None:
                decay = min(self.cfg.ema, (1 + self.steps) / (10 + self.steps))
                torch._foreach_lerp_(self.average, main + fusion, 1.0 - decay)
        self.steps += 1
        return parts

    @contextlib.contextmanager
    def averaged(self):
        """The student holds the averaged weights inside the block (no average: as it is)."""
        if self.average is None:
            yield
            return
        params = self.params[0] + self.params[1]
        with torch.no_grad():
            trained = [p.detach().clone() for p in params]
            torch._foreach_copy_(params, self.average)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, trained)

    def settle(self) -> None:
        """The averaged weights become the student's for good (a no-op without cfg.ema)."""
        if self.average is not None:
            with torch.no_grad():
                torch._foreach_copy_(self.params[0] + self.params[1], self.average)


def run_retrofit(model_dir: str, data: Tokenized, cfg: RetrofitConfig, device: str,
                 progress: bool = True) -> tuple[LM, dict]:
    """Convert model_dir's model (see the module docstring); returns (student, report)."""
    torch.manual_seed(cfg.seed)
    t_wall = time.perf_counter()
    autocast = autocast_for(device)
    with open(os.path.join(model_dir, "config.json")) as f:
        hf_cfg = json.load(f)
    if CONFIG_KEY in hf_cfg:
        raise SystemExit(f"{model_dir} is already a FusedKV model (its config.json has a '{CONFIG_KEY}' section)")
    teacher = load_lm(model_dir, device)
    teacher.requires_grad_(False)
    eval_seq = cfg.eval_seq or cfg.seq
    evals = {d: spaced(chunks(t, eval_seq), cfg.eval_windows) for d, t in data.split("eval").items()}
    # evaluation batches hold about as many tokens as a training batch (logits of longer windows)
    eval_batch = max(1, cfg.batch * cfg.seq // eval_seq)
    calib_split = data.split("calib") if data.domains("calib") else data.split("train")
    calib = mixed_chunks(calib_split, cfg.seq, cfg.calib_windows)
    train = mixed_chunks(data.split("train"), cfg.seq, cfg.max_train_windows)
    targets = {d: TARGETS.get(d, 1.03) for d in evals}
    report = {"variant": cfg.variant, "config": asdict(cfg), "targets": targets,
              "eval_tokens": {d: int(w[:, 1:].numel()) for d, w in evals.items()},
              "train_tokens": int(train[:, 1:].numel()), "calib_tokens": int(calib[:, 1:].numel())}
    report["eval_seq"] = eval_seq
    report["teacher_ppl"] = curves.domain_ppl(teacher, evals, eval_batch, autocast)
    # the same number of windows from the training text: the converted model's PPL ratio there
    # against the held-out one says how much of what is left is fitting the training windows
    seen = {d: spaced(chunks(t, cfg.seq), cfg.eval_windows) for d, t in data.split("train").items()}
    report["train_split_ppl"] = {"original": curves.domain_ppl(teacher, seen, cfg.batch, autocast)}
    clock, points, eval_s = TrainClock(device), [], 0.0
    stop = StopOnInterrupt()
    n = cfg.num_storage_layers or teacher.config.num_layers // 2
    sources = None
    if cfg.sources == "search":
        with clock:
            found = source_search(teacher, calib, cfg.batch, autocast, n, cfg.variant)
        sources = tuple(found["sources"])
        report["source_search"] = found
    student = student_from(teacher, cfg, sources)
    report["fusedkv"] = student.config.fusedkv.to_dict()
    bar = Progress(cfg.budget_s, progress)

    def point(phase: str, step: int, **extra) -> None:
        nonlocal eval_s
        t0 = time.perf_counter()
        ppl = curves.domain_ppl(student, evals, eval_batch, autocast)
        eval_s += time.perf_counter() - t0
        points.append({"phase": phase, "step": step, "gpu_s": clock.s, "gpu_min": clock.s / 60, "ppl": ppl, **extra})
        rel = ", ".join(f"{d} {p:.3f} ({100 * (p / report['teacher_ppl'][d] - 1):+.1f}%)" for d, p in ppl.items())
        bar.write(f"[{clock.s:7.1f} s] {phase} step {step}: PPL {rel}")

    if cfg.variant == "fusedkv":
        with clock:
            fit = closed_form_init if cfg.init == "closed_form" else lstsq_fusion_init
            report["init_residuals"] = fit(teacher, student, calib, cfg.batch, autocast)
    bar.update(clock.s)
    point("init", 0)
    batches = EpochBatches(ShiftedWindows(data.split("train"), cfg.seq) if cfg.shift_windows else train, cfg.batch,
                           seed=cfg.seed)

    # ---- local: attention-output matching ---------------------------------------------------
    local_steps = 0
    if cfg.local_frac > 0 and clock.s < cfg.budget_s:
        matcher = AttentionMatcher(teacher, student)
        student.requires_grad_(False)
        mats, fusion = matcher.parameters()
        for p in mats + fusion:
            p.requires_grad_(True)
        groups = [{"params": mats, "lr": cfg.local_lr}] + ([{"params": fusion, "lr": cfg.lr_fusion}] if fusion else [])
        opt = torch.optim.Adam(groups)
        base = [g["lr"] for g in opt.param_groups]
        start = clock.s
        end = min(cfg.budget_s, start + cfg.local_frac * cfg.budget_s)
        while clock.s < end and not stop.requested:
            with clock:
                done = (clock.s - start) / max(end - start, 1e-9)
                for g, lr in zip(opt.param_groups, base):
                    g["lr"] = lr * min(1.0, (local_steps + 1) / 10) * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))
                with autocast():
                    loss = matcher.loss(next(batches).to(device)[:, :-1])
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            local_steps += 1
            bar.update(clock.s, local=loss.item())
        matcher.close()
        report["local_final_rel_err"] = loss.item()
        point("local", local_steps)

    # ---- distill: KL + hidden-state matching -------------------------------------------------
    if cfg.compile:  # after the local phase: its hooks on the teacher's attention stay in eager code
        compile_blocks(student)
        compile_blocks(teacher)
    step_fn = DistillStep(student, teacher, cfg, device)
    opt = step_fn.opt
    base = [g["lr"] for g in opt.param_groups]
    student.train()
    step, planned, every, t_start, t_warm, t_one = 0, None, None, clock.s, None, None
    kl = hid = float("nan")

    def replan(step_s: float) -> None:
        nonlocal planned, every
        planned = step + max(0, int((cfg.budget_s - clock.s) / step_s))
        every = max(1, planned // cfg.eval_points)
        report["distill_step_s"] = step_s

    def lr_factor() -> float:
        if planned is None:  # the probe steps: the start of a warm-up
            return (step + 1) / 100
        warm = max(cfg.probe_steps + 1, int(cfg.warmup_frac * planned))
        return _lr_factor(step, planned, warm, cfg.min_lr_frac)

    while clock.s < cfg.budget_s and (planned is None or step < planned) and not stop.requested:
        with clock:
            for g, lr in zip(opt.param_groups, base):
                g["lr"] = lr * lr_factor()
            parts = step_fn(next(batches).to(device)[:, :-1])
        step += 1
        if step == 1:  # with compile_blocks this step holds the compile time: no plan from it
            t_one = clock.s
            report["distill_first_step_s"] = t_one - t_start
        kl, hid = parts["kl"].item(), parts["hidden"].item()
        bar.update(clock.s, kl=kl, hidden=hid)
        if step == cfg.probe_steps:  # plan from the probe steps after the first, then from warm steps only
            t_warm = clock.s
            replan((clock.s - t_one) / (step - 1) if step > 1 else clock.s - t_start)
        elif step == REPLAN_STEP and t_warm is not None:
            replan((clock.s - t_warm) / (step - cfg.probe_steps))
        if every and (step % every == 0) and step < planned:
            with step_fn.averaged():
                point("distill", step, kl=kl, hidden=hid, epochs=batches.epochs)
    step_fn.settle()
    student.eval()
    bar.close()
    stop.restore()
    report["interrupted"] = stop.requested
    report["distill_steps"], report["distill_planned_steps"], report["local_steps"] = step, planned, local_steps
    report["tokens_seen"] = int((local_steps + step) * cfg.batch * cfg.seq)
    report["epochs"] = batches.epochs
    point("final", step, kl=kl, hidden=hid, epochs=batches.epochs)
    report["curve"] = points
    report["final_ppl"] = points[-1]["ppl"]
    report["final_rel"] = {d: p / report["teacher_ppl"][d] - 1 for d, p in report["final_ppl"].items()}
    t0 = time.perf_counter()
    tsp = report["train_split_ppl"]
    tsp["converted"] = curves.domain_ppl(student, seen, cfg.batch, autocast)
    tsp["rel"] = {d: p / tsp["original"][d] - 1 for d, p in tsp["converted"].items()}
    eval_s += time.perf_counter() - t0
    report["meets_targets"] = {d: report["final_ppl"][d] <= targets[d] * report["teacher_ppl"][d] for d in targets}
    warm = max(1, int(cfg.warmup_frac * (planned or 1)))
    skip = next((p["gpu_min"] for p in points if p["phase"] == "distill" and p["step"] >= warm), 0.0)
    report["extrapolation"] = curves.extrapolate([p for p in points if p["phase"] != "init"], report["teacher_ppl"],
                                                 targets, skip_minutes=skip * 0.999)
    report["train_gpu_s"], report["eval_s"], report["wall_s"] = clock.s, eval_s, time.perf_counter() - t_wall
    return student, report
