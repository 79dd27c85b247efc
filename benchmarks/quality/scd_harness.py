"""SCD quality harness internals: models + artifacts, per-method consumer caches, QA and PPL passes.

Split-inference protocol (one function per method in sgl_kvxfer/scd/methods.py): the producer
prefills a prompt minus its last token; each method turns that prefill into the consumer's
prefix cache; the consumer runs the last prompt token itself and decodes greedily (QA) or scores
a teacher-forced continuation (PPL, KL, TV against the oracle's distribution). "oracle" is the
consumer's own prefill of the same tokens. Offline forwards (sgl_kvxfer/scd/forward.py) over
the engine's model code; the codecs are the serving ones (ScdEncoder -> wire dtype -> ScdDecoder).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from sgl_kvxfer.scd import ScdArtifacts, ScdDecoder, ScdEncoder, kv_projections
from sgl_kvxfer.scd import methods as M
from sgl_kvxfer.scd.forward import LlamaRunner, left_pad

ALL_METHODS = ("oracle", "raw", "int4", "reuse", "droidspeak", "scd")


@dataclass
class Consumer:
    name: str
    runner: LlamaRunner
    proj: list
    dec: ScdDecoder  # full SCD
    dec_reuse: ScdDecoder | None  # Reuse-only (all layers), when the stats were saved


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
        self.reuse_art = self.refit(m.r_k, m.r_v, all_layers=True) if self.stats else None
        self.enc_reuse = ScdEncoder(self.reuse_art) if self.reuse_art else None
        self.consumers: list[Consumer] = []
        for name in m.consumer_names:
            mdir, lora = consumers.get(name) or _split_source(next(c.source for c in m.consumers if c.name == name))
            if self.art.check_pair(consumer=(mdir, lora)) != name:
                raise ValueError(f"{mdir} + {lora} is not consumer {name}")
            cm, _ = load_model(mdir, "auto", dtype, device, 0, merge_lora=lora)
            self.consumers.append(Consumer(name, LlamaRunner(cm), kv_projections(cm), ScdDecoder(self.art, name),
                                           ScdDecoder(self.reuse_art, name) if self.reuse_art else None))
        k = len(m.patch_layers) if droid_k is None else droid_k
        prof = {int(l): v for l, v in self.calib["droidspeak_restore_one"].items()}
        self.droid_layers = tuple(sorted(sorted(prof, key=lambda l: (-prof[l], l))[:k]))
        self.methods = [x for x in ALL_METHODS if x != "reuse" or self.reuse_art]

    # ------------------------------------------------------------------ artifacts variants
    def _load_stats(self):
        path = os.path.join(self.art_dir, "reuse_stats.safetensors")
        if not os.path.isfile(path):
            return None
        from safetensors.torch import load_file

        from sgl_kvxfer.scd.build import ReuseMoments

        return ReuseMoments.from_state(load_file(path))

    def refit(self, r_k: int, r_v: int, all_layers: bool = False) -> ScdArtifacts:
        """Artifacts at ranks (r_k, r_v) refitted from the saved moments; all_layers: Reuse-only
        (no patch layers), else the calibrated patch layers and aligners are kept."""
        import dataclasses

        from sgl_kvxfer.scd.build import fit_reuse

        m = self.m
        patch = () if all_layers else m.patch_layers
        layers = [x for x in range(m.num_layers) if x not in patch]
        tensors, _ = fit_reuse(self.stats, layers, r_k, r_v, list(m.consumer_names), self.ridge)
        keep = {k: v for k, v in self.art.tensors.items() if not all_layers and _layer(k) in patch}
        man = dataclasses.replace(m, reuse_layers=tuple(layers), patch_layers=tuple(patch), r_k=r_k, r_v=r_v)
        return ScdArtifacts(man, {**{k: v.to(self.device) for k, v in tensors.items()}, **keep})

    # ------------------------------------------------------------------ bytes
    def bytes_per_token(self) -> dict[str, int]:
        from sgl_kvxfer.kernels.tier_codec import TIER_INT4, payload_bytes

        m = self.m
        raw_layer = m.num_kv_heads * 2 * m.head_dim * 2
        out = {"oracle": 0, "raw": m.num_layers * raw_layer,
               "int4": m.num_layers * m.num_kv_heads * 2 * payload_bytes(TIER_INT4, m.head_dim, min(32, m.head_dim)),
               "droidspeak": (m.num_layers - len(self.droid_layers)) * raw_layer
               + len(M.layer_runs(self.droid_layers)) * m.hidden_size * 2,
               "scd": m.bytes_per_token}
        if self.reuse_art:
            out["reuse"] = self.reuse_art.manifest.bytes_per_token
        return out

    # ------------------------------------------------------------------ caches
    def state(self, prefixes: list[list[int]]):
        ids, valid, pos = left_pad(prefixes, 0, self.device)
        starts = tuple(a for a, _ in M.layer_runs(self.droid_layers))
        return M.producer_state(self.producer, ids, pos, valid, h_layers=self.m.patch_layers, resid_layers=starts), ids

    def cache(self, method: str, state, ids, c: Consumer, enc=None, dec=None):
        if method == "oracle":
            return c.runner.prefill_cache(ids, state.positions, state.valid)[0]
        if method == "raw":
            return M.raw_cache(state)
        if method == "int4":
            return M.int4_cache(state)
        if method == "droidspeak":
            return M.droidspeak_cache(state, c.runner, self.droid_layers)
        if method == "reuse":
            return M.scd_cache(state, self.enc_reuse, c.dec_reuse, c.proj, self.dtype)
        if method == "scd":
            return M.scd_cache(state, enc or self.enc, dec or c.dec, c.proj, self.dtype)
        raise ValueError(method)

    # ------------------------------------------------------------------ passes
    def qa_ids(self, items) -> list[list[int]]:
        out = []
        for it in items:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": it.prompt()}], tokenize=False,
                                                      add_generation_prompt=True)
            out.append(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return out

    def answer(self, prompts: list[list[int]], methods, max_new: int, batch: int, variant=None, progress=None):
        """Greedy answers: {(consumer, method): [text per prompt]} in prompt order."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        res: dict[tuple[str, str], list[str]] = {}
        for s in range(0, len(order), batch):
            idx = order[s:s + batch]
            state, ids = self.state([prompts[i][:-1] for i in idx])
            last = torch.tensor([prompts[i][-1] for i in idx], device=self.device)
            first_pos = torch.tensor([len(prompts[i]) - 1 for i in idx], device=self.device)
            for c in self.consumers:
                for meth in methods:
                    enc, dec = variant(c) if (variant and meth == "scd") else (None, None)
                    cache = self.cache(meth, state, ids, c, enc, dec)
                    gen = c.runner.greedy(cache, last, first_pos, max_new, self.stop_ids)
                    out = res.setdefault((c.name, meth), [""] * len(prompts))
                    for i, g in zip(idx, gen):
                        out[i] = self.tokenizer.decode(g, skip_special_tokens=True)
            if progress:
                progress(len(idx))
        return res

    def score(self, windows: list[list[int]], prefix: int, methods, batch: int, progress=None):
        """Teacher-forced continuation of windows[:, prefix:] over each method's cache of
        windows[:, :prefix]. Returns {(consumer, method): {"nll_sum", "kl_sum", "tv_sum", "tokens"}}."""
        acc: dict[tuple[str, str], dict[str, float]] = {}
        for s in range(0, len(windows), batch):
            w = torch.tensor(windows[s:s + batch], dtype=torch.long, device=self.device)
            state, ids = self.state(w[:, :prefix].tolist())
            start = torch.full((w.shape[0],), prefix, device=self.device)
            for c in self.consumers:
                lp_o, tgt = M.continuation_logprob(c.runner, self.cache("oracle", state, ids, c), w[:, prefix:], start)
                p_o = lp_o.exp()
                for meth in methods:
                    lp = lp_o if meth == "oracle" else M.continuation_logprob(
                        c.runner, self.cache(meth, state, ids, c), w[:, prefix:], start)[0]
                    a = acc.setdefault((c.name, meth), {"nll_sum": 0.0, "kl_sum": 0.0, "tv_sum": 0.0, "tokens": 0})
                    a["nll_sum"] -= float(lp.gather(-1, tgt[..., None]).sum())
                    a["kl_sum"] += float((p_o * (lp_o - lp)).sum())
                    a["tv_sum"] += float(0.5 * (p_o - lp.exp()).abs().sum())
                    a["tokens"] += tgt.numel()
            if progress:
                progress(w.shape[0])
        return acc


def _layer(key: str) -> int:
    return int(key.rsplit(".", 1)[1])


def _split_source(source: str) -> tuple[str, str | None]:
    if "+" in source:
        mdir, lora = source.split("+", 1)
        return mdir, lora
    return source, None
