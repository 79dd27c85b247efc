"""Offline SCD calibration: paired prefills -> Reuse fits -> layer selection -> Patch aligners.

    python -m sgl_kvxfer.scd.calib --producer smollm2-135m --consumer qa=SPECIALISTS/qa \\
        --consumer code=SPECIALISTS/code --calib task:qa task:code --r-k 16 --r-v 48 \\
        --rank-levels 4:12,8:24 --r-h 96 --patch-budget auto --k-min 2 --out ARTIFACTS

A consumer is NAME=PATH: a model dir, or a peft LoRA adapter dir merged onto --consumer-base
(default: the producer). Stages (wall time of each in OUT/calibration.json):

  load        producer + consumers (our engine's model code, `--merge-lora` semantics)
  collect_kv  paired prefills of the calib sequences (same token ids for every model): per layer
              and kv head, streamed joint moments of [deRoPE(K_A) deRoPE(K_B1) ...] and of V
  fit_reuse   joint subspace + ridge encoder + per-consumer ridge decoders, every layer, at the
              top rank and each nested --rank-levels level
  select      Appendix A on held-out calib items: F(S) = mean answer / continuation log-prob of the
              consumers (mean over consumers) with layers in S restored to each consumer's own
              K/V and the rest Reuse; restore-one, greedy, budget. Also the restore-one profile
              over RAW producer K/V (the DroidSpeak baseline's selection).
  collect_h   second paired pass: input_layernorm outputs at the selected layers
  fit_patch   joint H subspace + ridge encoder, then per consumer an MLP aligner (Adam, early
              stopping on a held-out split; a layer's consumers train side by side), layers in
              greedy order; each layer's turn (fit and training) at most --aligner-time-s. With
              --aligner-joint every layer's H fit comes first, then all aligners of all layers
              train in one stacked pass over the time left (at most --aligner-time-s)
  save        manifest.json, producer.safetensors, consumer_<name>.safetensors
  level_agreement  per nested level, on the held-out selection items with the saved artifacts: the
              share of items whose argmax matches each consumer's own prefill at every
              continuation token (manifest.json's level_agreement, for --scd-min-rank auto);
              then calibration.json

--time-budget-s bounds the whole process (from its start, imports included; a call of calibrate()
from its call) so the artifacts
are always written: the Patch layers still to train share what is left of it less a reserve for
saving (budget.py), and a selected layer the budget leaves no turn for is dropped from the Patch
set (it stays Reuse; calibration.json lists it under patch_dropped, and a warning says so). A
SIGINT during collect_h / fit_patch (a `timeout -s INT` around the run) drops the untrained
layers the same way and saves the rest.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from sgl_kvxfer.scd.artifacts import CODE_SCALES, WIRE_DTYPES, ScdArtifacts
from sgl_kvxfer.scd.calib import stages
from sgl_kvxfer.scd.calib.budget import Budget, process_start


@dataclass(frozen=True)
class CalibConfig:
    producer: str = "smollm2-135m"
    consumers: tuple[str, ...] = ()  # NAME=PATH
    consumer_base: str | None = None
    calib: tuple[str, ...] = ("task:qa", "task:kv", "task:code")  # data.py: task:NAME, a JSONL path, corpus:NAME
    out: str = "scd_artifacts"
    r_k: int = 16
    r_v: int = 48
    r_h: int = 192
    rank_levels: str = ""  # lower nested levels "rk:rv,rk:rv" (ascending) a producer may send instead
    head_mode: str = "joint"  # joint (a layer's heads share one latent of H*r) or per_head
    patch_budget: str = "auto"  # a fixed k, or auto (k* = argmax dF/(c k) over [k_min, k_max])
    k_min: int = 1
    k_max: int = 8
    pool: int = 0  # restore-one candidate pool M (0: max(2 k_max, L/2))
    prefix_len: int = 512
    num_prefixes: int = 192
    batch_size: int = 16
    select_prompts: int = 16
    select_prefix: int = 256
    select_cont: int = 64
    aligner_hidden: int = 512
    aligner_steps: int = 5000  # a cap: training stops when the held-out loss stops improving
    aligner_patience: int = 4  # held-out checks (every 50 steps) without improvement before stopping
    aligner_time_s: float = 0.0  # per patch layer, its consumers' aligners together (0: none)
    time_budget_s: float = 0.0  # the whole run (0: none): the aligners share what the stages before leave
    aligner_lr: float = 1e-3
    aligner_tokens: int = 65536
    aligner_aux: float = 1.0  # weight of the K/V-space term of the aligners' loss (aligner.py)
    aligner_h_weight: float = 1.0  # weight of the hidden-state term
    aligner_batch: int = 2048  # tokens per aligner step
    # every patch layer's aligners in ONE stacked pass sharing the time left (instead of layer by
    # layer, each its share): each layer gets every step of the pass
    aligner_joint: bool = False
    ridge: float = 1e-4
    code_dtype: str = "bfloat16"
    # code columns at unit variance ("unit", calib/fit.py) or at the principal components' own
    # scale ("none"); "auto": unit for int4 codes, none otherwise. On the task suite's generalist
    # bed unit int4 codes raised Reuse only 0.560 -> 0.643 and SCD 0.529 -> 0.663; at int8 the
    # rounding is already negligible and unit codes did not help (scd/README.md)
    code_scale: str = "auto"
    storage_dtype: str = "float32"
    device: str = "auto"
    dtype: str = "auto"  # model dtype: bf16 on CUDA, float32 on CPU
    seed: int = 0
    save_stats: bool = False  # also write reuse_stats.safetensors (moments: rank sweeps refit from it)

    def __post_init__(self):
        if not self.consumers:
            raise ValueError("at least one --consumer NAME=PATH")
        names = [c.split("=", 1)[0] for c in self.consumers]
        if any("=" not in c for c in self.consumers) or len(set(names)) != len(names):
            raise ValueError(f"--consumer takes unique NAME=PATH entries, got {self.consumers}")
        if self.head_mode not in ("joint", "per_head"):
            raise ValueError(f"--head-mode must be joint or per_head, got {self.head_mode!r}")
        if self.patch_budget != "auto" and not self.patch_budget.isdigit():
            raise ValueError(f"--patch-budget is a layer count or 'auto', got {self.patch_budget!r}")
        if min(self.r_k, self.r_v, self.r_h, self.prefix_len, self.num_prefixes, self.batch_size) < 1:
            raise ValueError("ranks, prefix length, prefix count and batch size must be >= 1")
        if self.select_prompts < 1 or self.select_prefix < 2 or self.select_cont < 2:
            raise ValueError("selection needs >= 1 prompt, a prefix >= 2 and a continuation >= 2 tokens")
        try:
            levels = self.levels
        except ValueError:
            raise ValueError(f"--rank-levels takes R_K:R_V pairs, e.g. 4:12,8:24; got {self.rank_levels!r}") from None
        chain = [*levels, (self.r_k, self.r_v)]
        if any(not (1 <= a <= c and 1 <= b <= d) or (a, b) == (c, d) for (a, b), (c, d) in zip(chain, chain[1:])):
            raise ValueError(f"--rank-levels {self.rank_levels!r}: ascending pairs below (--r-k, --r-v)")
        if self.aligner_patience < 0 or not 0 <= self.aligner_time_s < 1e9 or not 0 <= self.time_budget_s < 1e9:
            raise ValueError("--aligner-patience, --aligner-time-s and --time-budget-s must be >= 0 and finite")
        if self.code_dtype not in WIRE_DTYPES or self.storage_dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"--code-dtype: one of {WIRE_DTYPES}; --storage-dtype: bfloat16, float16 or float32")
        if self.code_scale not in (*CODE_SCALES, "auto"):
            raise ValueError(f"--code-scale: one of {', '.join(CODE_SCALES)} or auto; got {self.code_scale!r}")
        if not (0 <= self.aligner_aux < 1e6 and 0 <= self.aligner_h_weight < 1e6) or \
                self.aligner_aux + self.aligner_h_weight <= 0:
            raise ValueError("--aligner-aux and --aligner-h-weight: finite, >= 0, not both 0")
        if not 1 <= self.aligner_batch <= 1 << 20:
            raise ValueError(f"--aligner-batch must be in [1, 2^20], got {self.aligner_batch}")

    @property
    def unit_codes(self) -> bool:
        """Whether this run fits unit-variance code columns (calib/fit.py); auto: int4 codes only."""
        if self.code_scale == "auto":
            return self.code_dtype == "int4"
        return self.code_scale == "unit"

    @property
    def levels(self) -> tuple[tuple[int, int], ...]:
        out = []
        for part in filter(None, (x.strip() for x in self.rank_levels.split(","))):
            a, _, b = part.partition(":")
            out.append((int(a), int(b)))
        return tuple(out)

    @property
    def budget(self) -> int | str:
        return "auto" if self.patch_budget == "auto" else int(self.patch_budget)


class StageTimer:
    def __init__(self):
        self.wall: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        t0 = time.perf_counter()
        yield
        sync()
        self.wall[name] = round(time.perf_counter() - t0, 3)
        print(f"[calibrate] {name}: {self.wall[name]:.2f} s", flush=True)


def calibrate(cfg: CalibConfig, started: float | None = None) -> dict:
    """Runs every stage; returns the calibration report (also written to OUT/calibration.json).
    started: the budget.clock() reading --time-budget-s counts from (default: this call)."""
    timer, t_start = StageTimer(), time.perf_counter()
    budget = Budget(cfg.time_budget_s, cfg.aligner_time_s, started=started)
    torch.manual_seed(cfg.seed)
    with timer("load"):
        env = stages.load_models(cfg)
    with timer("data"):
        fit_chunks, sel_chunks = stages.calib_chunks(cfg, env.tokenizer)
    with timer("collect_kv"):
        moments = stages.collect_kv(cfg, env, fit_chunks)
    with timer("fit_reuse"):
        reuse_all, fit_report = stages.fit_reuse_all(cfg, env, moments)
    with timer("select"):
        selection, droid, heldout = stages.select_layers(cfg, env, reuse_all, sel_chunks)
    order = stages.patch_order(selection)
    patch_tensors, aligner_report, dropped = {}, {}, {}
    if order and budget.layer_share(len(order)) is None:  # no time for even one aligner
        stages.drop_layers(dropped, order, "time")
    elif order:
        try:
            with timer("collect_h"):
                h_data = stages.collect_h(cfg, env, fit_chunks, order)
        except KeyboardInterrupt:  # a `timeout` around the run: save what there is
            stages.drop_layers(dropped, order, "interrupted")
        else:
            with timer("fit_patch"):
                fit = stages.fit_patch_joint if cfg.aligner_joint else stages.fit_patch
                patch_tensors, aligner_report, dropped = fit(cfg, env, h_data, order, budget)
    patch = sorted(x for x in order if x not in dropped)
    left_at_save = budget.left()
    with timer("save"):
        art = stages.assemble(cfg, env, reuse_all, patch, patch_tensors)
        art.save(cfg.out, getattr(torch, cfg.storage_dtype))
        if cfg.save_stats:
            from safetensors.torch import save_file

            save_file({k: v.cpu().contiguous() for k, v in moments.state().items()},
                      os.path.join(cfg.out, "reuse_stats.safetensors"))
    # after the artifacts are on disk, so an interrupt here loses only this measurement
    agreement = None
    try:
        with timer("level_agreement"):  # the artifacts as saved (their stored dtype): what serves
            agreement = stages.level_agreement(env, ScdArtifacts.load(cfg.out), sel_chunks)
        art.manifest = dataclasses.replace(art.manifest, level_agreement=tuple(agreement["agreement"]))
        art.save_manifest(cfg.out)
    except KeyboardInterrupt:
        warnings.warn("interrupted while measuring level agreement: the artifacts are saved without it "
                      "(--scd-min-rank auto will refuse them)")
    m = art.manifest
    report = {
        **stages.provenance(env.device),
        "wall_s": {**timer.wall, "total": round(time.perf_counter() - t_start, 3)},
        "config": dataclasses.asdict(cfg),
        "models": {"producer": m.producer.to_dict(), "consumers": [c.to_dict() for c in m.consumers]},
        "tokens": {"fit_prefixes": len(fit_chunks), "fit_tokens": sum(len(c) for c in fit_chunks),
                   "select_prompts": len(sel_chunks)},
        "patch_layers": list(m.patch_layers), "selection": selection.to_dict(),
        # selected layers left out of the Patch set (they stay Reuse): "time" (the budget left no
        # turn for their aligners) or "interrupted" (SIGINT while they trained)
        "patch_dropped": {str(k): v for k, v in dropped.items()},
        "time_budget": {"total_s": cfg.time_budget_s, "save_reserve_s": budget.reserve_s,
                        "left_before_save_s": None if left_at_save is None else round(left_at_save + budget.reserve_s, 3)},
        "droidspeak_restore_one": {str(k): v for k, v in droid.items()},
        "level_agreement": agreement,
        "reuse_fit_rel_err": fit_report, "heldout_kv_rel_err": heldout, "aligners": aligner_report,
        "bytes_per_token": {"scd": m.bytes_per_token, "raw_bf16": m.raw_kv_bytes_per_token(2)},
        "artifact_bytes": {f: os.path.getsize(os.path.join(cfg.out, f)) for f in sorted(os.listdir(cfg.out))
                           if f.endswith(".safetensors")},
    }
    with open(os.path.join(cfg.out, "calibration.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"[calibrate] patch layers {list(m.patch_layers)}"
          f"{f' (dropped {sorted(dropped)})' if dropped else ''}; {m.bytes_per_token} B/token of codes vs "
          f"{m.raw_kv_bytes_per_token(2)} raw bf16; total {report['wall_s']['total']:.1f} s -> {cfg.out}")
    return report


def parse_args(argv=None) -> CalibConfig:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    fields = {f.name: f for f in dataclasses.fields(CalibConfig)}
    for name, f in fields.items():
        flag = "--" + name.replace("_", "-")
        if name == "consumers":
            ap.add_argument("--consumer", dest="consumers", action="append", required=True, metavar="NAME=PATH")
        elif name == "calib":
            ap.add_argument(flag, nargs="+", default=list(f.default), help="calib JSONL paths or corpus names")
        elif isinstance(f.default, bool):
            ap.add_argument(flag, action="store_true")
        else:
            kind = type(f.default) if f.default is not None else str
            ap.add_argument(flag, type=kind, default=f.default)
    ns = vars(ap.parse_args(argv))
    ns["consumers"], ns["calib"] = tuple(ns["consumers"]), tuple(ns["calib"])
    return CalibConfig(**ns)


def main(argv=None) -> None:
    calibrate(parse_args(argv), started=process_start())  # the budget includes start-up and imports


def parse_consumer_arg(spec: str, producer: str | None = None) -> tuple[str, tuple[str, str | None]]:
    """NAME=PATH (a model dir, or a LoRA adapter dir merged onto `producer`) -> (name, (dir, adapter))."""
    from sgl_kvxfer.models.loader import resolve_model_path

    name, mdir, lora = stages.parse_consumer(spec, resolve_model_path(producer))
    return name, (mdir, lora)


if __name__ == "__main__":
    main()
