"""From-scratch training of one cross-layer layout at one seed (the paper's comparison, small).

A run is a `RunSpec`: a layout of model.py (vanilla, fusedkv, lite, yoco, cla2), a seed, and for
fusedkv the fusion weights' init (models/fusedkv_math.INITS) and learning-rate multiplier. Every
sharing layout stores KV for half the layers (equal KV bytes) and gets the dropped k_proj / v_proj
parameters back as wider MLPs in the layers that store none (`matched_recon_intermediate`), so all
runs have the vanilla model's parameter count within a few hundred. Runs of one comparison see the
same windows in the same order (the data order's seed is fixed; the run's seed sets the weights).

AdamW as the paper (beta2 0.95, weight decay 0.1 on matrices, clip 1.0), linear warm-up over 10%
then cosine to 10%; bf16 autocast on CUDA. Validation loss on a fixed subset of the eval split
every `eval_every` steps, on the whole eval split per domain at the end.
scripts/fusedkv/compare_scratch.py runs the grid (layouts x seeds) and plots the spread.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass

import torch

from sgl_kvxfer.fusedkv.data import EpochBatches
from sgl_kvxfer.fusedkv.model import LAYOUTS, LM, LMConfig, lm_loss, matched_recon_intermediate
from sgl_kvxfer.models.fusedkv_math import INITS

DATA_SEED = 0
PRESETS = {
    # ~19M parameters (6.4M without the tied embedding), MHA 4 x 64: on an H100 shared by three
    # workers, ~50 ms a step each (the 49152-way logits dominate), ~20 s a run. min_steps: the
    # fewest a time budget may cut a run to (compare_scratch.plan_steps)
    "small": dict(hidden=256, layers=8, heads=4, kv_heads=4, head_dim=64, inter=704, seq=512, batch=32,
                  steps=400, min_steps=200, lr=2e-3, eval_points=10, eval_windows=32),
    # CPU rehearsal (seconds): the pipeline, not the result
    "toy": dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, inter=128, seq=64, batch=4, steps=8,
                min_steps=4, lr=3e-3, eval_points=2, eval_windows=4),
}


@dataclass(frozen=True)
class RunSpec:
    layout: str
    seed: int = 0
    fusion_init: str = "equivalent"  # fusedkv only
    fusion_lr_mult: float = 1.0  # fusedkv only

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.fusion_init not in INITS:
            raise ValueError(f"fusion_init must be one of {INITS}, got {self.fusion_init!r}")
        if not (math.isfinite(self.fusion_lr_mult) and self.fusion_lr_mult > 0):
            raise ValueError(f"fusion_lr_mult must be finite and > 0, got {self.fusion_lr_mult}")

    @property
    def name(self) -> str:
        """The run group's name (seed aside): the layout, plus fusedkv's non-default settings."""
        if self.layout != "fusedkv":
            return self.layout
        extra = ([f"init={self.fusion_init}"] if self.fusion_init != "equivalent" else []) + \
                ([f"fusion_lr=x{self.fusion_lr_mult:g}"] if self.fusion_lr_mult != 1.0 else [])
        return "fusedkv" + (f"[{','.join(extra)}]" if extra else "")

    @classmethod
    def parse(cls, text: str, seed: int) -> "RunSpec":
        """'fusedkv[init=lite,fusion_lr=x10]' or a plain layout name -> RunSpec."""
        layout, _, rest = text.partition("[")
        kw = {}
        for item in filter(None, rest.rstrip("]").split(",")):
            key, _, value = item.partition("=")
            if key == "init":
                kw["fusion_init"] = value
            elif key == "fusion_lr":
                kw["fusion_lr_mult"] = float(value.lstrip("x"))
            else:
                raise ValueError(f"unknown run option {key!r} in {text!r} (init=, fusion_lr=x)")
        return cls(layout=layout, seed=seed, **kw)


def base_config(p: dict, vocab: int) -> LMConfig:
    return LMConfig(vocab_size=vocab, hidden_size=p["hidden"], num_layers=p["layers"], num_heads=p["heads"],
                    num_kv_heads=p["kv_heads"], head_dim=p["head_dim"], intermediate_size=p["inter"])


def build(spec: RunSpec, p: dict, vocab: int) -> LM:
    base = base_config(p, vocab)
    kw = {"init": spec.fusion_init, "init_seed": spec.seed} if spec.layout == "fusedkv" else {}
    m = LM(base.with_layout(spec.layout, matched_recon_intermediate(base, spec.layout), **kw))
    m.init_weights(seed=spec.seed)
    return m


def autocast_for(device: str):
    if device.startswith("cuda"):
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def make_optimizer(m: LM, spec: RunSpec, lr: float, device: str):
    named = list(m.named_parameters())
    decay = [p for n, p in named if p.dim() == 2]
    fusion = [p for n, p in named if ".kv_fusion." in n]
    other = [p for n, p in named if p.dim() != 2 and ".kv_fusion." not in n]  # norms
    groups = [{"params": decay, "weight_decay": 0.1, "lr_mult": 1.0},
              {"params": other, "weight_decay": 0.0, "lr_mult": 1.0}]
    if fusion:
        groups.append({"params": fusion, "weight_decay": 0.0, "lr_mult": spec.fusion_lr_mult})
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.startswith("cuda"))


def lr_at(step: int, steps: int, lr: float) -> float:
    warm = max(1, steps // 10)
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def _sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train_step(m, opt, batch, device, autocast) -> float:
    batch = batch.to(device, non_blocking=True)
    with autocast():
        loss = lm_loss(m(batch[:, :-1]), batch[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


@torch.no_grad()
def evaluate(m, windows, batch_size, device, autocast) -> float:
    m.eval()
    total, n = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        b = windows[i:i + batch_size].to(device)
        with autocast():
            loss = lm_loss(m(b[:, :-1]), b[:, 1:])
        total += loss.item() * b.shape[0]
        n += b.shape[0]
    m.train()
    return total / n


def probe_step_s(p: dict, vocab: int, train: torch.Tensor, device: str, steps: int = 5) -> float:
    """Seconds per training step of the vanilla model (after two warm-up steps)."""
    spec = RunSpec("vanilla")
    m = build(spec, p, vocab).to(device).train()
    opt = make_optimizer(m, spec, 1e-9, device)
    batches, autocast = EpochBatches(train, p["batch"], seed=99), autocast_for(device)
    for _ in range(2):
        train_step(m, opt, next(batches), device, autocast)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step(m, opt, next(batches), device, autocast)
    _sync(device)
    return (time.perf_counter() - t0) / steps


def train_run(spec: RunSpec, p: dict, vocab: int, steps: int, train: torch.Tensor, eval_sub: torch.Tensor,
              eval_domains: dict[str, torch.Tensor], device: str) -> dict:
    """One run to `steps` steps; its curves, final losses, parameter counts and speed."""
    autocast = autocast_for(device)
    m = build(spec, p, vocab).to(device).train()
    opt = make_optimizer(m, spec, p["lr"], device)
    batches = EpochBatches(train, p["batch"], seed=DATA_SEED)
    every = max(1, steps // p["eval_points"])
    r = {"spec": asdict(spec), "name": spec.name, "params": m.param_counts(),
         "kv_bytes_per_token_bf16": m.kv_bytes_per_token(2), "recon_intermediate_size": m.config.recon_intermediate_size,
         "steps": steps, "train_loss": [], "val_steps": [], "val_loss": []}
    if spec.layout == "fusedkv":
        r["fusion_mean_abs_init"] = fusion_stats(m)
    _sync(device)
    t0, t_eval = time.perf_counter(), 0.0
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, p["lr"]) * g["lr_mult"]
        r["train_loss"].append(train_step(m, opt, next(batches), device, autocast))
        if (step + 1) % every == 0 or step + 1 == steps:
            te = time.perf_counter()
            r["val_steps"].append(step + 1)
            r["val_loss"].append(evaluate(m, eval_sub, p["batch"], device, autocast))
            t_eval += time.perf_counter() - te
    _sync(device)
    r["train_s"] = time.perf_counter() - t0 - t_eval
    r["tokens"] = steps * p["batch"] * p["seq"]
    r["final_val_loss_by_domain"] = {d: evaluate(m, w, p["batch"], device, autocast) for d, w in eval_domains.items()}
    n = {d: w.shape[0] for d, w in eval_domains.items()}
    r["final_val_loss"] = sum(r["final_val_loss_by_domain"][d] * n[d] for d in n) / sum(n.values())
    if spec.layout == "fusedkv":
        r["fusion_mean_abs"] = fusion_stats(m)
    return r


def fusion_stats(m: LM) -> dict:
    """Mean |weight| per reconstruction layer and source, keys and values: where the fusion looks."""
    fw = [(blk.self_attn.kv_fusion.key_pair_weight.detach().float().abs().mean((1, 2)).tolist(),
           blk.self_attn.kv_fusion.value_weight.detach().float().abs().mean((1, 2)).tolist())
          for blk in m.model.layers if hasattr(blk.self_attn, "kv_fusion")]
    return {"key": [k for k, _ in fw], "value": [v for _, v in fw]}
