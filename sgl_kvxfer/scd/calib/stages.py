"""The stages of `calibrate` (see its docstring); each takes the CalibConfig and the loaded models."""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

import torch
from tqdm import tqdm

from sgl_kvxfer.scd.calib import methods
from sgl_kvxfer.scd.calib.aligner import train_aligners
from sgl_kvxfer.scd.artifacts import CODE_DTYPES, ScdArtifacts, ScdManifest
from sgl_kvxfer.mem_cache.scd_quant import WIRE_BITS, fake_quant
from sgl_kvxfer.scd.calib.budget import Budget
from sgl_kvxfer.scd.calib.build import ReuseMoments, fit_reuse, patch_tensors
from sgl_kvxfer.scd.codec import ScdDecoder, ScdEncoder, kv_projections
from sgl_kvxfer.scd.calib.fit import JointMoments, fit_joint
from sgl_kvxfer.scd.calib.forward import LlamaRunner, left_pad
from sgl_kvxfer.scd.identity import ModelIdentity, identify
from sgl_kvxfer.scd.rotary import KeyRotary
from sgl_kvxfer.scd.calib.select import select_patch_layers


@dataclass
class Models:
    device: str
    arch: object
    tokenizer: object
    producer: LlamaRunner
    consumers: dict[str, LlamaRunner]
    identities: dict[str, ModelIdentity]  # "producer" and each consumer name
    projections: dict[str, list]  # consumer -> per-layer KVProjection


def parse_consumer(spec: str, base: str) -> tuple[str, str, str | None]:
    """NAME=PATH -> (name, model dir, adapter dir or None)."""
    from sgl_kvxfer.models.loader import resolve_model_path

    name, path = spec.split("=", 1)
    path = os.path.abspath(os.path.expanduser(path))  # the manifest records it as the consumer's source
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        return name, base, path
    return name, resolve_model_path(path), None


def load_models(cfg) -> Models:
    from sgl_kvxfer.models.loader import load_model, load_tokenizer, resolve_model_path, resolve_tokenizer_path

    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "float32": torch.float32}[cfg.dtype]
    prod_dir = resolve_model_path(cfg.producer)
    base = resolve_model_path(cfg.consumer_base) if cfg.consumer_base else prod_dir
    model, arch = load_model(prod_dir, "auto", dtype, device, cfg.seed)
    consumers, idents, projs = {}, {"producer": identify(prod_dir, name="producer")}, {}
    for spec in cfg.consumers:
        name, mdir, lora = parse_consumer(spec, base)
        cm, carch = load_model(mdir, "auto", dtype, device, cfg.seed, merge_lora=lora)
        if (carch.num_hidden_layers, carch.num_key_value_heads, carch.head_dim, carch.hidden_size) != (
                arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, arch.hidden_size):
            raise ValueError(f"consumer {name} ({mdir}) does not share the producer's architecture")
        consumers[name] = LlamaRunner(cm)
        idents[name] = identify(mdir, lora, name=name)
        projs[name] = kv_projections(cm)
    tok = load_tokenizer(resolve_tokenizer_path(prod_dir))
    return Models(device, arch, tok, LlamaRunner(model), consumers, idents, projs)


def calib_chunks(cfg, tokenizer):
    """(fit sequences, selection (prefix, continuation) pairs): data.calib_data over cfg.calib."""
    from sgl_kvxfer.scd.calib.data import calib_data

    return calib_data(cfg.calib, tokenizer, cfg.num_prefixes, cfg.prefix_len, cfg.select_prompts, cfg.select_prefix,
                      cfg.select_cont, cfg.seed)


def _batches(seqs, bs, device):
    """Left-padded batches of similar lengths: (ids, positions, valid) [B, S]."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for i in range(0, len(order), bs):
        ids, valid, pos = left_pad([seqs[j] for j in order[i:i + bs]], 0, device)
        yield ids, pos, valid


def collect_kv(cfg, env: Models, chunks) -> ReuseMoments:
    a = env.arch
    L, rot = a.num_hidden_layers, KeyRotary.from_arch(a)
    moments = ReuseMoments(L, a.num_key_value_heads, a.head_dim, len(env.consumers), env.device, cfg.head_mode)
    runners = [env.producer, *env.consumers.values()]
    for ids, pos, valid in tqdm(list(_batches(chunks, cfg.batch_size, env.device)), desc="collect K/V", unit="batch"):
        taps = [r.forward(ids, pos, valid, kv_layers=range(L)) for r in runners]
        flat_pos = pos[valid]
        for layer in range(L):
            ks = [rot.derope(t.k[layer][valid], flat_pos) for t in taps]
            vs = [t.v[layer][valid].float() for t in taps]
            moments.update(layer, ks, vs)
    return moments


def manifest_for(cfg, env: Models, patch) -> ScdManifest:
    a = env.arch
    return ScdManifest(
        producer=env.identities["producer"], consumers=tuple(env.identities[n] for n in env.consumers),
        num_layers=a.num_hidden_layers, num_kv_heads=a.num_key_value_heads, head_dim=a.head_dim,
        hidden_size=a.hidden_size, rope_theta=a.rope_theta, rope_scaling=a.rope_scaling,
        max_position_embeddings=a.max_position_embeddings,
        reuse_layers=tuple(x for x in range(a.num_hidden_layers) if x not in patch), patch_layers=tuple(sorted(patch)),
        r_k=cfg.r_k, r_v=cfg.r_v, r_h=cfg.r_h, dtype=cfg.code_dtype, aligner_hidden=cfg.aligner_hidden,
        head_mode=cfg.head_mode, rank_levels=cfg.levels, code_scale="unit" if cfg.unit_codes else "none")


def fit_reuse_all(cfg, env: Models, moments) -> tuple[ScdArtifacts, dict]:
    """Reuse fits of EVERY layer (the all-Reuse baseline that selection starts from)."""
    tensors, report = fit_reuse(moments, range(env.arch.num_hidden_layers), cfg.r_k, cfg.r_v,
                                list(env.consumers), cfg.ridge, cfg.levels, unit_codes=cfg.unit_codes)
    return ScdArtifacts(manifest_for(cfg, env, ()), {k: v.to(env.device) for k, v in tensors.items()}), report


def selection_batch(pairs, device):
    """(prefix ids, positions, valid) left-padded, continuation ids right-padded [B, C] with its
    mask of scored targets [B, C - 1], and each row's continuation start position [B]."""
    ids, valid, pos = left_pad([p for p, _ in pairs], 0, device)
    c = max(len(x) for _, x in pairs)
    cont = torch.zeros(len(pairs), c, dtype=torch.long)
    mask = torch.zeros(len(pairs), c - 1, dtype=torch.bool)
    for i, (_, x) in enumerate(pairs):
        cont[i, :len(x)] = torch.tensor(x)
        mask[i, :len(x) - 1] = True
    start = valid.sum(1)
    return ids, pos, valid, cont.to(device), mask.to(device), start


def select_layers(cfg, env: Models, reuse_all: ScdArtifacts, pairs):
    ids, pos, valid, cont, mask, start = selection_batch(pairs, env.device)
    state = methods.producer_state(env.producer, ids, pos, valid)
    enc = ScdEncoder(reuse_all)
    oracle, reuse, heldout = {}, {}, {}
    for name, runner in env.consumers.items():
        oracle[name], _ = runner.prefill_cache(ids, pos, valid)
        reuse[name] = methods.scd_cache(state, enc, ScdDecoder(reuse_all, name), env.projections[name], runner.dtype)
        heldout[name] = {f"{m}_{kv}": [round(_rel(getattr(c, kv)[i][valid], getattr(oracle[name], kv)[i][valid]), 6)
                                       for i in range(env.arch.num_hidden_layers)]
                         for m, c in (("reuse", reuse[name]), ("raw", state.cache)) for kv in ("k", "v")}

    def metric(base_of):
        def F(s):
            vals = []
            for name, runner in env.consumers.items():
                cache = methods.with_layers(base_of(name), oracle[name], s)
                lp, tgt = methods.continuation_logprob(runner, cache, cont, start)
                vals.append(float(lp.gather(-1, tgt[..., None])[..., 0][mask].mean()))
            return sum(vals) / len(vals)
        return F

    bar = tqdm(desc="select (F evaluations)", unit="eval")
    sel = select_patch_layers(metric(lambda n: reuse[n]), env.arch.num_hidden_layers, cfg.budget,
                              cfg.pool or None, cfg.k_min, cfg.k_max, progress=lambda _: bar.update())
    raw_F = metric(lambda n: state.cache)
    raw0 = raw_F(())
    droid = {layer: raw_F({layer}) - raw0 for layer in range(env.arch.num_hidden_layers)}
    bar.update(env.arch.num_hidden_layers + 1)
    bar.close()
    sel.extra["F_raw_empty"] = raw0
    sel.extra["F_oracle"] = metric(lambda n: oracle[n])(())
    return sel, droid, heldout


def _rel(x, ref) -> float:
    return float((x.float() - ref.float()).pow(2).sum() / ref.float().pow(2).sum().clamp(min=1e-30))


def collect_h(cfg, env: Models, chunks, patch):
    """Per patch layer: joint moments of [h_A h_B1 ...] over all tokens, and a random subset of
    at most aligner_tokens rows of each model's h (for the aligners)."""
    n_models = 1 + len(env.consumers)
    runners = [env.producer, *env.consumers.values()]
    batches = list(_batches(chunks, cfg.batch_size, env.device))
    per_batch = -(-cfg.aligner_tokens // len(batches))
    g = torch.Generator(device="cpu").manual_seed(cfg.seed)
    moments = {layer: JointMoments(1, env.arch.hidden_size, n_models, env.device) for layer in patch}
    samples = {layer: [[] for _ in range(n_models)] for layer in patch}
    for ids, pos, valid in tqdm(batches, desc="collect h_norm", unit="batch"):
        taps = [r.forward(ids, pos, valid, h_layers=patch, end=max(patch) + 1) for r in runners]
        n = int(valid.sum())
        keep = torch.randperm(n, generator=g)[:per_batch].to(env.device)
        for layer in patch:
            hs = [t.h[layer][valid] for t in taps]
            moments[layer].update(torch.cat(hs, -1)[None])
            for i, h in enumerate(hs):
                samples[layer][i].append(h[keep])
    return moments, {layer: [torch.cat(s) for s in per] for layer, per in samples.items()}


def patch_order(selection) -> list[int]:
    """The selected Patch layers, most valuable first (the greedy order): when time runs out, the
    layers dropped are the last of it."""
    order = [layer for layer, _ in selection.greedy if layer in selection.layers]
    return order + [layer for layer in selection.layers if layer not in order]


def drop_layers(dropped: dict, layers, reason: str) -> None:
    for layer in layers:
        dropped[layer] = reason
    if layers:
        warnings.warn(f"Patch layers {list(layers)} dropped ({reason}): no aligner trained, they stay Reuse",
                      RuntimeWarning, stacklevel=2)


def fit_patch(cfg, env: Models, h_data, order, budget: Budget):
    """Per layer in `order`: joint H fit + every consumer's aligner, within the layer's share of
    the budget (Budget.layer_share: the whole turn, fit included). A layer the budget leaves no
    time for, or that a SIGINT (a `timeout` around the run) catches, is dropped: it stays Reuse.
    Returns (tensors of the trained layers, per-consumer report, {dropped layer: reason})."""
    moments, samples = h_data
    out, report, dropped = {}, {}, {}
    names = list(env.consumers)
    bar = tqdm(total=len(order), desc="train aligners (all consumers per layer)", unit="layer")
    for j, layer in enumerate(order):
        share = budget.layer_share(len(order) - j)
        if share is None:
            drop_layers(dropped, order[j:], "time")
            break
        turn_end = budget.now() + share if share else None
        try:
            fit, z, w_kvs = _layer_code(cfg, env, moments, samples, layer)
            trained = train_aligners(z, [samples[layer][1 + i] for i in range(len(names))],
                                     [fit.dec[i][0].to(z.device) for i in range(len(names))],
                                     [fit.mu_b[i][0].to(z.device) for i in range(len(names))], cfg.aligner_hidden,
                                     cfg.aligner_steps, cfg.aligner_lr, cfg.aligner_batch, w_kvs=w_kvs,
                                     aux=cfg.aligner_aux, seed=cfg.seed + layer, patience=cfg.aligner_patience,
                                     time_budget_s=max(1e-6, turn_end - budget.now()) if turn_end else 0.0,
                                     h_weight=cfg.aligner_h_weight)
        except KeyboardInterrupt:
            drop_layers(dropped, order[j:], "interrupted")
            break
        aligners = {}
        for i, (name, (params, rep)) in enumerate(zip(names, trained)):
            aligners[name] = params
            report.setdefault(name, {})[str(layer)] = {**rep, "h_fit_rel_err": round(float(fit.rel_err[i][0]), 6),
                                                       "turn_s": round(share, 3)}
        bar.update()
        out.update(patch_tensors(layer, fit, aligners))
    bar.close()
    return out, report, dropped


def wire_codes(z: torch.Tensor, code_dtype: str) -> torch.Tensor:
    """Codes [T, r] as the consumer receives them (the wire dtype's rounding), float32."""
    bits = WIRE_BITS.get(code_dtype)
    return fake_quant(z, bits) if bits else z.to(CODE_DTYPES[code_dtype]).float()


def h_codes(h_a: torch.Tensor, mu: torch.Tensor, enc: torch.Tensor, code_dtype: str) -> torch.Tensor:
    """A Patch layer's H codes of the producer's states h_a [T, hidden] as the consumer receives
    them (centred, encoded, rounded to the wire dtype), float32."""
    return wire_codes((h_a.float() - mu.to(h_a.device)) @ enc.to(h_a.device), code_dtype)


def _layer_code(cfg, env: Models, moments, samples, layer: int):
    """A patch layer's joint H fit, the producer's codes of its sampled tokens (as received) and
    each consumer's stacked [W_k; W_v]."""
    fit = fit_joint(moments[layer], cfg.r_h, cfg.ridge, unit_codes=cfg.unit_codes)
    h_a = samples[layer][0].float()
    z = h_codes(h_a, fit.mu_a[0], fit.enc[0], cfg.code_dtype)
    return fit, z, [kv_rows(env, n, layer) for n in env.consumers]


def kv_rows(env: Models, consumer: str, layer: int) -> torch.Tensor:
    """A consumer's stacked [W_k; W_v] of a layer (float32): the rows the aligners' K/V loss reads."""
    proj = env.projections[consumer][layer]
    return torch.cat([proj.w_k, proj.w_v]).float()


def fit_patch_joint(cfg, env: Models, h_data, order, budget: Budget):
    """fit_patch with every layer's aligners in ONE stacked pass (items: layer x consumer): the
    H fits first, then training over what is left of the budget (capped at --aligner-time-s), so
    every layer gets every step instead of a 1/len(order) share of the time. A SIGINT drops every
    layer (none has finished). Same returns as fit_patch."""
    moments, samples = h_data
    names = list(env.consumers)
    report, dropped = {}, {}
    share = budget.layer_share(1)
    if share is None:
        drop_layers(dropped, order, "time")
        return {}, report, dropped
    end = budget.now() + share if share else None
    fits, zs, targets, lin_ws, lin_bs, w_kvs = {}, [], [], [], [], []
    try:
        for layer in order:
            fit, z, wk = _layer_code(cfg, env, moments, samples, layer)
            fits[layer] = fit
            for i in range(len(names)):
                zs.append(z)
                targets.append(samples[layer][1 + i])
                lin_ws.append(fit.dec[i][0].to(z.device))
                lin_bs.append(fit.mu_b[i][0].to(z.device))
                w_kvs.append(wk[i])
        left = max(1e-6, end - budget.now()) if end else 0.0
        trained = train_aligners(zs, targets, lin_ws, lin_bs, cfg.aligner_hidden, cfg.aligner_steps, cfg.aligner_lr,
                                 cfg.aligner_batch, w_kvs=w_kvs, aux=cfg.aligner_aux, seed=cfg.seed,
                                 patience=cfg.aligner_patience, time_budget_s=left, h_weight=cfg.aligner_h_weight)
    except KeyboardInterrupt:
        drop_layers(dropped, order, "interrupted")
        return {}, report, dropped
    out = {}
    for j, layer in enumerate(order):
        aligners = {}
        for i, name in enumerate(names):
            params, rep = trained[j * len(names) + i]
            aligners[name] = params
            report.setdefault(name, {})[str(layer)] = {**rep, "h_fit_rel_err": round(float(fits[layer].rel_err[i][0]), 6),
                                                       "turn_s": round(share, 3), "joint": True}
        out.update(patch_tensors(layer, fits[layer], aligners))
    return out, report, dropped


def assemble(cfg, env: Models, reuse_all: ScdArtifacts, patch, patch_t) -> ScdArtifacts:
    keep = {k: v for k, v in reuse_all.tensors.items() if int(k.rsplit(".", 1)[1]) not in patch}
    return ScdArtifacts(manifest_for(cfg, env, patch), {**keep, **patch_t})


def level_agreement(env: Models, art: ScdArtifacts, pairs) -> dict:
    """How near each level's codes bring a consumer to its own prefill, on the held-out selection
    items with the given artifacts (Reuse at the level, Patch through the trained aligners): per
    level (ascending, the top last), the share of items whose teacher-forced argmax equals the
    oracle's (the consumer over its own K/V) at every continuation token: an exact-match proxy
    (`agreement`, which the producer's `--scd-min-rank auto` floor reads,
    rank_policy.quality_floor); the same per token (`token_agreement`: a per-token share hides
    how answers fail as a whole), and the mean log-prob of the true continuation; means over
    consumers."""
    m = art.manifest
    ids, pos, valid, cont, mask, start = selection_batch(pairs, env.device)
    state = methods.producer_state(env.producer, ids, pos, valid, h_layers=m.patch_layers)
    enc = ScdEncoder(art, env.device)
    keys = ("agreement", "token_agreement", "logprob")
    sums = {k: [0.0] * len(m.levels) for k in keys}
    per_consumer = {}
    for name, runner in env.consumers.items():
        oracle, _ = runner.prefill_cache(ids, pos, valid)
        lp_o, tgt = methods.continuation_logprob(runner, oracle, cont, start)
        want = lp_o.argmax(-1)
        dec = ScdDecoder(art, name, env.device)
        rows = per_consumer[name] = {"oracle_logprob": round(float(lp_o.gather(-1, tgt[..., None])[..., 0][mask].mean()), 6)}
        for i, lv in enumerate(m.levels):
            cache = methods.scd_cache(state, enc, dec, env.projections[name], runner.dtype, level=lv)
            lp, _ = methods.continuation_logprob(runner, cache, cont, start)
            same = (lp.argmax(-1) == want) | ~mask  # unscored positions count as agreeing
            vals = {"agreement": float(same.all(-1).float().mean()),
                    "token_agreement": float(same[mask].float().mean()),
                    "logprob": float(lp.gather(-1, tgt[..., None])[..., 0][mask].mean())}
            rows["{}:{}".format(*lv)] = {k: round(v, 6) for k, v in vals.items()}
            for k in keys:
                sums[k][i] += vals[k]
    n = len(env.consumers)
    return {"levels": [list(lv) for lv in m.levels], **{k: [round(v / n, 6) for v in sums[k]] for k in keys},
            "items": len(pairs), "tokens": int(mask.sum()), "per_consumer": per_consumer}


def provenance(device: str, module: str = "sgl_kvxfer.scd.calib", argv: list[str] | None = None) -> dict:
    """device, commit and the command line as `python -m MODULE ARGS`: the arguments main() parsed
    (argv), else the process's own (a library call inside another program names its arguments)."""
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(0)
    else:
        import platform

        name = f"{platform.processor() or 'cpu'} ({os.cpu_count()} cores)"
    from sgl_kvxfer.utils.provenance import source_commit

    return {"device": name, "commit": source_commit(), "command": " ".join([f"python -m {module}", *(sys.argv[1:] if argv is None else argv)])}
