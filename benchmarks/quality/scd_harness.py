"""SCD quality harness internals: models + artifacts, per-method consumer caches, task answers,
fidelity against the oracle, timings.

Split-inference protocol (one function per method in sgl_kvxfer/scd/calib/methods.py): the
producer (the base model) prefills a prompt minus its last token; each method turns that
prefill into the consumer's prefix cache; the consumer runs the last prompt token itself and
decodes greedily (task score) or scores the gold answer teacher-forced (KL and top-1 agreement
against the oracle's distribution on the answer tokens). "oracle" is the consumer's own prefill
of the same tokens, "base" the producer answering on its own. The codecs are the serving ones
(ScdEncoder -> wire dtype -> ScdDecoder), at any nested rank level of the artifacts; "scd:int4",
"reuse:int8" (CODE_QUANT) are the same fits with their codes quantised on the wire (mem_cache/scd_quant.py).

Diagnostics (DIAGNOSTICS: not wire methods, no bytes per token) bound one part of SCD:
"scd-oracle-patch" is SCD's Reuse layers with its Patch layers replaced by the consumer's own
K/V (the oracle's), as if the aligners were perfect. Near the oracle: the aligners are what SCD
loses; far below it: the Reuse layers or the choice of Patch layers are.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass

import torch

from sgl_kvxfer import tasks
from sgl_kvxfer.scd import ScdArtifacts, ScdDecoder, ScdEncoder, kv_projections
from sgl_kvxfer.scd.calib import methods as M
from sgl_kvxfer.scd.calib.forward import LlamaRunner, left_pad

METHODS = ("oracle", "base", "raw", "int8", "int4", "reuse", "droidspeak", "scd")
# SCD and Reuse-only with their codes at a quantised wire dtype: method "scd:int4", "reuse:int8", ...
CODE_QUANT = ("int8", "int4")
DIAGNOSTICS = {"scd-oracle-patch": "SCD with its Patch layers restored to the consumer's own K/V (perfect aligners)"}


@dataclass
class Consumer:
    name: str
    runner: LlamaRunner
    proj: list
    dec: ScdDecoder
    dec_reuse: ScdDecoder | None  # Reuse-only (every layer), refitted from the saved moments


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Harness:
    def __init__(self, art_dir: str, producer: str | None, consumers: dict[str, tuple[str, str | None]],
                 device: str, dtype: torch.dtype, droid_k: int | None = None):
        from sgl_kvxfer.models.loader import load_model, load_tokenizer, resolve_model_path, resolve_tokenizer_path

        self.art_dir, self.device, self.dtype = art_dir, device, dtype
        self.art = ScdArtifacts.load(art_dir, device=device)
        m = self.m = self.art.manifest
        with open(os.path.join(art_dir, "calibration.json")) as f:
            self.calib = json.load(f)
        self.ridge = self.calib["config"]["ridge"]  # refits use the calibration's regularization
        prod_dir = resolve_model_path(producer or m.producer.source)
        self.art.check_pair(producer=prod_dir)
        model, self.arch = load_model(prod_dir, "auto", dtype, device, 0)
        self.producer = LlamaRunner(model)
        self.tokenizer = load_tokenizer(resolve_tokenizer_path(prod_dir))
        self.stop_ids = tuple({*self.arch.eos_token_ids, self.tokenizer.eos_token_id} - {None})
        self.enc = ScdEncoder(self.art)
        self.stats = self._load_stats()
        self.reuse_art = self.refit(all_layers=True) if self.stats else None
        self.enc_reuse = ScdEncoder(self.reuse_art) if self.reuse_art else None
        # the same fits with the codes quantised on the wire: only the encoder's rounding differs
        # (the decoders read float codes of any dtype), and the manifest's bytes per token
        self.quant = {}
        for q in CODE_QUANT:
            for meth, art in (("scd", self.art), ("reuse", self.reuse_art)):
                if art is not None:
                    self.quant[f"{meth}:{q}"] = ScdArtifacts(dataclasses.replace(art.manifest, dtype=q), art.tensors)
        self.enc_quant = {k: ScdEncoder(a) for k, a in self.quant.items()}
        self.consumers: dict[str, Consumer] = {}
        for name in m.consumer_names:
            mdir, lora = consumers.get(name) or _split_source(next(c.source for c in m.consumers if c.name == name))
            if self.art.check_pair(consumer=(mdir, lora)) != name:
                raise ValueError(f"{mdir} + {lora} is not consumer {name}")
            cm, _ = load_model(mdir, "auto", dtype, device, 0, merge_lora=lora)
            self.consumers[name] = Consumer(name, LlamaRunner(cm), kv_projections(cm), ScdDecoder(self.art, name),
                                            ScdDecoder(self.reuse_art, name) if self.reuse_art else None)
        k = len(m.patch_layers) if droid_k is None else droid_k
        prof = {int(l): v for l, v in self.calib["droidspeak_restore_one"].items()}
        self.droid_layers = tuple(sorted(sorted(prof, key=lambda l: (-prof[l], l))[:k]))
        self.methods = [x for x in METHODS if x != "reuse" or self.reuse_art]
        self.diagnostics = list(DIAGNOSTICS)

    # ------------------------------------------------------------------ artifacts variants
    def _load_stats(self):
        path = os.path.join(self.art_dir, "reuse_stats.safetensors")
        if not os.path.isfile(path):
            return None
        from safetensors.torch import load_file

        from sgl_kvxfer.scd.calib.build import ReuseMoments

        # on the device: the refits' eigendecompositions run where the moments are (fit.py)
        return ReuseMoments.from_state(load_file(path, device=str(self.device)), self.m.num_kv_heads,
                                       self.m.head_mode)

    def refit(self, all_layers: bool = False) -> ScdArtifacts:
        """Reuse refitted from the saved moments at the artifacts' levels; all_layers: Reuse-only
        (no patch layers), else the calibrated patch layers and aligners are kept."""
        from sgl_kvxfer.scd.calib.build import fit_reuse

        m = self.m
        patch = () if all_layers else m.patch_layers
        layers = [x for x in range(m.num_layers) if x not in patch]
        tensors, _ = fit_reuse(self.stats, layers, m.r_k, m.r_v, list(m.consumer_names), self.ridge, m.rank_levels,
                               unit_codes=m.code_scale == "unit")
        keep = {k: v for k, v in self.art.tensors.items() if not all_layers and _layer(k) in patch}
        man = dataclasses.replace(m, reuse_layers=tuple(layers), patch_layers=tuple(patch))
        return ScdArtifacts(man, {**{k: v.to(self.device) for k, v in tensors.items()}, **keep})

    # ------------------------------------------------------------------ bytes
    def bytes_per_token(self, level=None) -> dict[str, int]:
        from sgl_kvxfer.kernels.tier_codec import TIER_INT4, TIER_INT8, payload_bytes

        m = self.m
        raw_layer = m.num_kv_heads * 2 * m.head_dim * 2
        g = min(32, m.head_dim)
        out = {"oracle": 0, "base": 0, "raw": m.num_layers * raw_layer,
               "int8": m.num_layers * m.num_kv_heads * 2 * payload_bytes(TIER_INT8, m.head_dim, g),
               "int4": m.num_layers * m.num_kv_heads * 2 * payload_bytes(TIER_INT4, m.head_dim, g),
               "droidspeak": (m.num_layers - len(self.droid_layers)) * raw_layer
               + len(M.layer_runs(self.droid_layers)) * m.hidden_size * 2,
               "scd": m.bytes_per_token_at(level)}
        if self.reuse_art:
            out["reuse"] = self.reuse_art.manifest.bytes_per_token_at(level)
        out.update({k: a.manifest.bytes_per_token_at(level) for k, a in self.quant.items()})
        return out

    # ------------------------------------------------------------------ caches
    def state(self, prefixes: list[list[int]]):
        ids, valid, pos = left_pad(prefixes, 0, self.device)
        starts = tuple(a for a, _ in M.layer_runs(self.droid_layers))
        return M.producer_state(self.producer, ids, pos, valid, h_layers=self.m.patch_layers, resid_layers=starts), ids

    def cache(self, method: str, state, ids, c: Consumer, level=None):
        if method == "oracle":
            return c.runner.prefill_cache(ids, state.positions, state.valid)[0]
        if method in ("raw", "base"):
            return M.raw_cache(state)
        if method in ("int8", "int4"):
            return M.quant_cache(state, 8 if method == "int8" else 4)
        if method == "droidspeak":
            return M.droidspeak_cache(state, c.runner, self.droid_layers)
        if method == "reuse":
            return M.scd_cache(state, self.enc_reuse, c.dec_reuse, c.proj, self.dtype, level)
        if method == "scd":
            return M.scd_cache(state, self.enc, c.dec, c.proj, self.dtype, level)
        if method in self.enc_quant:  # "scd:int4", "reuse:int8", ...
            dec = c.dec if method.startswith("scd:") else c.dec_reuse
            return M.scd_cache(state, self.enc_quant[method], dec, c.proj, self.dtype, level)
        if method == "scd-oracle-patch":  # its rebuild time includes the consumer's prefill: not a speed
            own = c.runner.prefill_cache(ids, state.positions, state.valid)[0]
            return M.scd_cache(state, self.enc, c.dec, c.proj, self.dtype, level, patch_kv=own)
        raise ValueError(method)

    # ------------------------------------------------------------------ one consumer's evaluation
    def evaluate(self, c: Consumer, examples, variants, batch: int, progress=None) -> dict:
        """variants: [(label, method, level)]. Per variant: per-item scores, predictions, KL and
        top-1 agreement vs the oracle on the gold answer tokens, rebuild seconds and tokens."""
        pairs = [tasks.train_ids(self.tokenizer, ex) for ex in examples]
        prompts = [ids[:n] for ids, n in pairs]
        answers = [ids[n:] for ids, n in pairs]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out = {label: {"scores": [None] * len(examples), "preds": [""] * len(examples), "kl_sum": 0.0,
                       "top1_sum": 0.0, "tokens": 0, "rebuild_s": 0.0, "prefix_tokens": 0} for label, _, _ in variants}
        max_new = max(tasks.get_task(ex.task).max_answer_tokens for ex in examples)
        for s in range(0, len(order), batch):
            idx = order[s:s + batch]
            state, ids = self.state([prompts[i][:-1] for i in idx])
            last = torch.tensor([prompts[i][-1] for i in idx], device=self.device)
            first_pos = state.valid.sum(1)
            cont = [[prompts[i][-1]] + answers[i] for i in idx]
            width = max(len(x) for x in cont)
            cont_ids = torch.zeros(len(idx), width, dtype=torch.long)
            mask = torch.zeros(len(idx), width - 1, dtype=torch.bool)
            for r, x in enumerate(cont):
                cont_ids[r, :len(x)] = torch.tensor(x)
                mask[r, :len(x) - 1] = True
            cont_ids, mask = cont_ids.to(self.device), mask.to(self.device)
            lp_o = None
            for label, meth, level in [v for v in variants if v[1] == "oracle"] + [v for v in variants if v[1] != "oracle"]:
                runner = self.producer if meth == "base" else c.runner
                sync(self.device)
                t0 = time.perf_counter()
                cache = self.cache(meth, state, ids, c, level)
                sync(self.device)
                o = out[label]
                o["rebuild_s"] += time.perf_counter() - t0
                o["prefix_tokens"] += int(state.valid.sum())
                for r, g in zip(idx, runner.greedy(cache, last, first_pos, max_new, self.stop_ids)):
                    o["preds"][r] = self.tokenizer.decode(g, skip_special_tokens=True)
                    o["scores"][r] = tasks.score(examples[r], o["preds"][r])
                lp, tgt = M.continuation_logprob(runner, cache, cont_ids, first_pos)
                if lp_o is None and meth == "oracle":
                    lp_o = lp
                if lp_o is not None:
                    kl = (lp_o.exp() * (lp_o - lp)).sum(-1)
                    o["kl_sum"] += float(kl[mask].sum())
                    o["top1_sum"] += float((lp.argmax(-1) == lp_o.argmax(-1))[mask].sum())
                    o["tokens"] += int(mask.sum())
                del cache
            if progress:
                progress(len(idx))
        return out

    # ------------------------------------------------------------------ single-request timings
    @torch.no_grad()
    def timings(self, c: Consumer, prompt: list[int], variants, repeats: int = 5) -> dict:
        """Median seconds, batch 1: the producer's prefill of prompt[:-1], each variant's rebuild,
        and the consumer's first step (the last prompt token over the rebuilt cache)."""
        def timed(fn):
            ts = []
            for _ in range(repeats + 1):  # the first run warms up
                sync(self.device)
                t0 = time.perf_counter()
                r = fn()
                sync(self.device)
                ts.append(time.perf_counter() - t0)
            return sorted(ts[1:])[len(ts[1:]) // 2], r

        prefill_s, (state, ids) = timed(lambda: self.state([prompt[:-1]]))
        last = torch.tensor([prompt[-1]], device=self.device)
        pos = state.valid.sum(1)
        res = {"prefill_s": prefill_s, "tokens": len(prompt), "rebuild_s": {}, "first_step_s": None}
        for label, meth, level in variants:
            if meth in ("base",):
                continue
            res["rebuild_s"][label], cache = timed(lambda: self.cache(meth, state, ids, c, level))
            if res["first_step_s"] is None:
                res["first_step_s"], _ = timed(lambda: c.runner.greedy(cache, last, pos, 1))
        return res


def drift(h: Harness, c: Consumer, prompts: list[list[int]], batch: int) -> dict:
    """Per layer: mean cosine of the base's and the specialist's K (and V) vectors on the same
    tokens, their relative L2 distance; and KL(specialist || base) of the next-token
    distributions over the prompts' tokens."""
    L = h.m.num_layers
    acc = {"k_cos": [0.0] * L, "v_cos": [0.0] * L, "k_rel": [0.0] * L, "v_rel": [0.0] * L}
    n_vec, kl_sum, n_tok = 0, 0.0, 0
    for s in range(0, len(prompts), batch):
        ids, valid, pos = left_pad(prompts[s:s + batch], 0, h.device)
        a = h.producer.forward(ids, pos, valid, kv_layers=range(L), logits="all")
        b = c.runner.forward(ids, pos, valid, kv_layers=range(L), logits="all")
        for layer in range(L):
            for kind in ("k", "v"):
                x = getattr(a, kind)[layer][valid].float().flatten(0, 1)
                y = getattr(b, kind)[layer][valid].float().flatten(0, 1)
                acc[f"{kind}_cos"][layer] += float(torch.nn.functional.cosine_similarity(x, y, dim=-1).sum())
                acc[f"{kind}_rel"][layer] += float((x - y).norm(dim=-1).sum())
                acc.setdefault(f"{kind}_norm", [0.0] * L)[layer] += float(y.norm(dim=-1).sum())
        n_vec += int(valid.sum()) * h.m.num_kv_heads
        lp_a, lp_b = torch.log_softmax(a.logits.float(), -1), torch.log_softmax(b.logits.float(), -1)
        kl_sum += float((lp_b.exp() * (lp_b - lp_a)).sum(-1)[valid].sum())
        n_tok += int(valid.sum())
    out = {k: [round(v / n_vec, 5) for v in acc[k]] for k in ("k_cos", "v_cos")}
    for kind in ("k", "v"):
        out[f"{kind}_rel"] = [round(acc[f"{kind}_rel"][i] / max(1e-30, acc[f"{kind}_norm"][i]), 5) for i in range(L)]
    out["kl_specialist_vs_base"] = kl_sum / max(1, n_tok)
    out["tokens"] = n_tok
    return out


def _layer(key: str) -> int:
    return int(key.rsplit(".", 1)[1])


def _split_source(source: str) -> tuple[str, str | None]:
    if "+" in source:
        mdir, lora = source.split("+", 1)
        return mdir, lora
    return source, None
