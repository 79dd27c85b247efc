"""SCD artifacts: a JSON manifest naming the model pair(s), plus the fitted tensors.

Directory layout (`ScdArtifacts.save` / `load`):

    manifest.json                 ScdManifest (pair identities, shapes, RoPE, layer route, ranks)
    producer.safetensors          what the producer needs: encoders and means
    consumer_<name>.safetensors   what consumer <name> needs: decoders, means, aligners
    calibration.json              (calibrate only) per-stage wall time, profiles, errors

Tensor names (l = layer index, H = kv heads, D = head_dim, r = rank, m = aligner width), for
head_mode "joint" (one latent of H*r numbers per layer, fitted across the layer's heads) and
"per_head" (one latent of r numbers per kv head, the paper's per-head reading):

                 joint                     per_head
    producer   k_enc.l [H*D, H*r_k]      [H, D, r_k]     k_mu.l [H, D]  (v_* likewise)   (reuse l)
               h_enc.l [hidden, r_h]     h_mu.l [hidden]                                  (patch l)
    consumer   k_dec.l [H*r_k, H*D]      [H, r_k, D]     k_mu.l [H, D]  (v_* likewise)   (reuse l)
               k_dec@r.l [H*r, H*D]      [H, r, D]       for each lower nested rank r of rank_levels
               a_scale.l [r_h]  a_lin_w.l [r_h, hidden]  a_lin_b.l [hidden]
               a_w1.l [r_h, m]  a_b1.l [m]  a_w2.l [m, hidden]  a_b2.l [hidden]              (patch l)

Nested ranks (`rank_levels`): the code at a lower level (r_k', r_v') is the first H*r' columns
(joint) or first r' per head of the top code, so the producer encodes once and any level's
code is a prefix; each consumer holds one decoder per level (calib/fit.py).

One producer, N consumers: every consumer decodes the SAME codes (one encoder per layer, fitted
on the joint subspace of the producer and all consumers), so a prefill is encoded once.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import torch

from sgl_kvxfer.scd.identity import WILDCARD, ModelIdentity, as_identity, config_hash
from sgl_kvxfer.mem_cache.scd_quant import WIRE_BITS, field_bytes

CODE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# every wire dtype of the codes: the float ones, and the quantised ones (mem_cache/scd_quant.py: integers plus
# one bfloat16 scale per token and field; the codecs hand them over as float32 on the wire grid)
WIRE_DTYPES = (*CODE_DTYPES, *WIRE_BITS)
HEAD_MODES = ("joint", "per_head")
CODE_SCALES = ("none", "unit")
MANIFEST = "manifest.json"
PRODUCER_FILE = "producer.safetensors"
VERSION = 1


class ScdPairError(ValueError):
    """The models do not match the pair the artifacts were calibrated for."""


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def consumer_file(name: str) -> str:
    return f"consumer_{name}.safetensors"


@dataclass(frozen=True)
class ScdManifest:
    producer: ModelIdentity
    consumers: tuple[ModelIdentity, ...]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    reuse_layers: tuple[int, ...]
    patch_layers: tuple[int, ...]
    r_k: int
    r_v: int
    r_h: int
    dtype: str = "bfloat16"  # the codes' dtype on the wire (WIRE_DTYPES)
    aligner_hidden: int = 0  # m (0: linear aligners)
    # "joint": a layer's code [T, H, r] is ONE latent of H*r numbers fitted across its heads (same
    # bytes as per-head codes, never a worse fit); "per_head": one latent per head
    head_mode: str = "joint"
    version: int = VERSION
    # lower nested (r_k, r_v) levels a producer may send instead of the top (r_k, r_v); ascending
    rank_levels: tuple[tuple[int, int], ...] = ()
    # per level of `levels` (ascending, the top last): the calibration's held-out share of items
    # whose teacher-forced continuation argmax matches the consumer's own prefill at every token
    # (mean over consumers; calib/stages.level_agreement); () when not measured.
    # `--scd-min-rank auto` reads it
    level_agreement: tuple[float, ...] = ()
    # "unit": every Reuse / Patch code column scaled to unit variance on the calibration data
    # (calib/fit.py `unit_codes`, for a quantised wire); "none": the principal components'
    # own scale. Informs refits (the quality harness's Reuse-only variant); the codecs read only
    # the matrices
    code_scale: str = "none"

    def __post_init__(self):
        names = [c.name for c in self.consumers]
        if not names:
            raise ValueError("an SCD manifest needs at least one consumer")
        if len(set(names)) != len(names) or any(not n or "/" in n or "." in n for n in names):
            raise ValueError(f"consumer names must be unique, non-empty, without '/' or '.': {names}")
        layers = sorted(self.reuse_layers + self.patch_layers)
        if layers != list(range(self.num_layers)):
            raise ValueError(f"reuse_layers {self.reuse_layers} and patch_layers {self.patch_layers} must "
                             f"partition range({self.num_layers})")
        if not (1 <= self.r_k <= self.head_dim and 1 <= self.r_v <= self.head_dim):
            raise ValueError(f"r_k, r_v must be in [1, head_dim={self.head_dim}], got {self.r_k}, {self.r_v}")
        if self.patch_layers and not 1 <= self.r_h <= self.hidden_size:
            raise ValueError(f"r_h must be in [1, hidden_size={self.hidden_size}], got {self.r_h}")
        if self.head_mode not in HEAD_MODES:
            raise ValueError(f"head_mode must be one of {HEAD_MODES}, got {self.head_mode!r}")
        if self.dtype not in WIRE_DTYPES:
            raise ValueError(f"dtype must be one of {WIRE_DTYPES}, got {self.dtype!r}")
        prev = (0, 0)
        for a, b in self.rank_levels:
            if not (1 <= a <= self.r_k and 1 <= b <= self.r_v) or (a, b) == (self.r_k, self.r_v) \
                    or a < prev[0] or b < prev[1] or (a, b) == prev:
                raise ValueError(f"rank_levels {self.rank_levels}: ascending (r_k, r_v) pairs below "
                                 f"({self.r_k}, {self.r_v}), each rank at most the next one's")
            prev = (a, b)
        if self.level_agreement and (len(self.level_agreement) != len(self.levels)
                                     or not all(0.0 <= a <= 1.0 for a in self.level_agreement)):
            raise ValueError(f"level_agreement {self.level_agreement}: one share in [0, 1] per level of {self.levels}")
        if self.code_scale not in CODE_SCALES:
            raise ValueError(f"code_scale must be one of {CODE_SCALES}, got {self.code_scale!r}")
        if self.version != VERSION:
            raise ValueError(f"artifacts version {self.version}, this code reads version {VERSION}")

    # ------------------------------------------------------------------ derived
    @property
    def consumer_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.consumers)

    @property
    def code_dtype(self) -> torch.dtype:
        """The dtype of the codes the codecs hand over (float32 for a quantised wire dtype: its
        values on the wire grid)."""
        return CODE_DTYPES.get(self.dtype, torch.float32)

    @property
    def wire_bits(self) -> int:
        """Bits per code number of a quantised wire dtype; 0 for a float one."""
        return WIRE_BITS.get(self.dtype, 0)

    def layer_kind(self, layer: int) -> str:
        """"reuse" or "patch"."""
        if layer in self.patch_layers:
            return "patch"
        if layer in self.reuse_layers:
            return "reuse"
        raise IndexError(f"layer {layer} out of range({self.num_layers})")

    @property
    def levels(self) -> tuple[tuple[int, int], ...]:
        """Every (r_k, r_v) a producer may send, ascending; the last is the top (r_k, r_v)."""
        return (*self.rank_levels, (self.r_k, self.r_v))

    def code_layout(self, level: tuple[int, int] | None = None) -> list[tuple[int, str, tuple[int, ...]]]:
        """Per token, in wire order: (layer, "k" | "v" | "h", per-token shape). Reuse layers send
        k [H, r_k] and v [H, r_v] (at `level`, default the top); patch layers send h [r_h]."""
        r_k, r_v = level or (self.r_k, self.r_v)
        out = []
        for layer in range(self.num_layers):
            if layer in self.patch_layers:
                out.append((layer, "h", (self.r_h,)))
            else:
                out += [(layer, "k", (self.num_kv_heads, r_k)), (layer, "v", (self.num_kv_heads, r_v))]
        return out

    def bytes_per_token_at(self, level: tuple[int, int] | None = None) -> int:
        """Bytes of codes per token (all layers) at `level` (default the top)."""
        r_k, r_v = level or (self.r_k, self.r_v)
        if self.wire_bits:  # per field: its integers and one bfloat16 scale
            return sum(field_bytes(_prod(shape), self.wire_bits) for _, _, shape in self.code_layout(level))
        elems = len(self.reuse_layers) * self.num_kv_heads * (r_k + r_v) + len(self.patch_layers) * self.r_h
        return elems * self.code_dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Bytes of codes per token (all layers) at the top level."""
        return self.bytes_per_token_at()

    def raw_kv_bytes_per_token(self, itemsize: int = 2) -> int:
        return self.num_layers * self.num_kv_heads * 2 * self.head_dim * itemsize

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["producer"] = self.producer.to_dict()
        d["consumers"] = [c.to_dict() for c in self.consumers]
        d["bytes_per_token"] = self.bytes_per_token
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ScdManifest":
        d = dict(d)
        d.pop("bytes_per_token", None)
        d["producer"] = ModelIdentity.from_dict(d["producer"])
        d["consumers"] = tuple(ModelIdentity.from_dict(c) for c in d["consumers"])
        for key in ("reuse_layers", "patch_layers"):
            d[key] = tuple(int(x) for x in d[key])
        d["rank_levels"] = tuple((int(a), int(b)) for a, b in d.get("rank_levels", ()))
        d["level_agreement"] = tuple(float(a) for a in d.get("level_agreement", ()))
        return cls(**d)


class ScdArtifacts:
    """Manifest + tensors ("producer/<name>" and "<consumer>/<name>" keys, float32 or the
    saved dtype). Load only the side a process needs: `load(dir, producer=False,
    consumers=["code"])` on a consumer."""

    def __init__(self, manifest: ScdManifest, tensors: dict[str, torch.Tensor]):
        self.manifest = manifest
        self.tensors = tensors

    def producer_tensor(self, name: str) -> torch.Tensor:
        return self._get(f"producer/{name}")

    def consumer_tensor(self, consumer: str, name: str) -> torch.Tensor:
        if consumer not in self.manifest.consumer_names:
            raise KeyError(f"unknown consumer {consumer!r}; artifacts name {self.manifest.consumer_names}")
        return self._get(f"{consumer}/{name}")

    def _get(self, key: str) -> torch.Tensor:
        if key not in self.tensors:
            raise KeyError(f"SCD artifacts hold no tensor {key!r} (loaded without that side?)")
        return self.tensors[key]

    # ------------------------------------------------------------------ files
    def save(self, out_dir: str, storage_dtype: torch.dtype | None = None) -> None:
        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        groups: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in self.tensors.items():
            side, name = key.split("/", 1)
            t = t.detach().to("cpu")
            groups.setdefault(side, {})[name] = (t.to(storage_dtype) if storage_dtype else t).contiguous()
        for side, tensors in groups.items():
            fname = PRODUCER_FILE if side == "producer" else consumer_file(side)
            save_file(tensors, os.path.join(out_dir, fname), metadata={"scd_version": str(VERSION)})
        self.save_manifest(out_dir)

    def save_manifest(self, out_dir: str) -> None:
        """manifest.json alone (written through a temporary file: a reader never sees half of it)."""
        path = os.path.join(out_dir, MANIFEST)
        with open(path + ".tmp", "w") as f:
            json.dump(self.manifest.to_dict(), f, indent=2)
        os.replace(path + ".tmp", path)

    @classmethod
    def load(cls, art_dir: str, producer: bool = True, consumers: list[str] | None = None,
             device: str | torch.device = "cpu") -> "ScdArtifacts":
        """consumers None: all of them; [] for a producer-only load."""
        from safetensors.torch import load_file

        path = os.path.join(art_dir, MANIFEST)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no SCD manifest at {path} (run python -m sgl_kvxfer.scd.calib)")
        with open(path) as f:
            manifest = ScdManifest.from_dict(json.load(f))
        names = manifest.consumer_names if consumers is None else tuple(consumers)
        for n in names:
            if n not in manifest.consumer_names:
                raise KeyError(f"unknown consumer {n!r}; {art_dir} names {manifest.consumer_names}")
        tensors = {}
        files = ([("producer", PRODUCER_FILE)] if producer else []) + [(n, consumer_file(n)) for n in names]
        for side, fname in files:
            for name, t in load_file(os.path.join(art_dir, fname), device=str(device)).items():
                tensors[f"{side}/{name}"] = t.float()
        return cls(manifest, tensors)

    # ------------------------------------------------------------------ pair check
    def check_pair(self, producer=None, consumer=None) -> str | None:
        """Check the producer and/or consumer against the manifest; returns the consumer's name.
        Each side: a model dir, (model dir, LoRA adapter dir or None), a ModelIdentity, or a
        config (ModelArchConfig / HF dict: only its architecture is checked). Raises ScdPairError
        naming what differs."""
        m = self.manifest
        if producer is not None:
            got = as_identity(producer, "producer")
            if not got.matches(m.producer):
                raise ScdPairError(_mismatch("producer", got, [m.producer]))
        if consumer is None:
            return None
        got = as_identity(consumer)
        for c in m.consumers:
            if got.matches(c):
                return c.name
        raise ScdPairError(_mismatch("consumer", got, list(m.consumers)))


def _mismatch(side: str, got: ModelIdentity, expected: list[ModelIdentity]) -> str:
    want = "; ".join(f"{e.name or side}: config {e.config_hash[:12]} weights {e.weight_hash[:12]} ({e.source})"
                     for e in expected)
    what = "architecture (config hash)" if all(got.config_hash != e.config_hash for e in expected) else "weights"
    return (f"SCD artifacts do not fit this {side}: its {what} differ. Got config {got.config_hash[:12]} "
            f"weights {got.weight_hash[:12]} ({got.source}); the artifacts were calibrated for {want}. "
            f"Re-run python -m sgl_kvxfer.scd.calib for this pair.")


def make_random_artifacts(arch_config, consumers, r_k: int, r_v: int, r_h: int, patch_layers,
                          seed: int = 0, aligner_hidden: int = 64, dtype: str = "bfloat16",
                          head_mode: str = "joint", rank_levels=()) -> ScdArtifacts:
    """Random artifacts of the right shapes for `arch_config` (a ModelArchConfig): for tests and
    timing-only benchmarks (e.g. the Llama-3-8B shape). Identities carry the real config hash and
    the wildcard weight hash, so any weights of that architecture pass `check_pair`.
    consumers: names, or a count (names c0, c1, ...)."""
    names = [f"c{i}" for i in range(consumers)] if isinstance(consumers, int) else list(consumers)
    a = arch_config
    L, H, D, hid = a.num_hidden_layers, a.num_key_value_heads, a.head_dim, a.hidden_size
    patch = tuple(sorted(int(x) for x in patch_layers))
    chash = config_hash(a)
    manifest = ScdManifest(
        producer=ModelIdentity("producer", chash, WILDCARD, "random"),
        consumers=tuple(ModelIdentity(n, chash, WILDCARD, "random") for n in names),
        num_layers=L, num_kv_heads=H, head_dim=D, hidden_size=hid, rope_theta=a.rope_theta,
        rope_scaling=a.rope_scaling, max_position_embeddings=a.max_position_embeddings,
        reuse_layers=tuple(x for x in range(L) if x not in patch), patch_layers=patch,
        r_k=r_k, r_v=r_v, r_h=r_h, dtype=dtype, aligner_hidden=aligner_hidden, head_mode=head_mode,
        rank_levels=tuple((int(a), int(b)) for a, b in rank_levels))
    g = torch.Generator().manual_seed(seed)
    nested = {"k": sorted({a for a, _ in manifest.rank_levels if a < r_k}),
              "v": sorted({b for _, b in manifest.rank_levels if b < r_v})}

    def orth(rows, cols):  # orthonormal columns (rows >= cols) or rows
        q, _ = torch.linalg.qr(torch.randn(max(rows, cols), min(rows, cols), generator=g))
        return q if rows >= cols else q.T

    t: dict[str, torch.Tensor] = {}
    for layer in manifest.reuse_layers:
        for kind, r in (("k", r_k), ("v", r_v)):
            joint = head_mode == "joint"
            t[f"producer/{kind}_enc.{layer}"] = orth(H * D, H * r) if joint else torch.stack([orth(D, r) for _ in range(H)])
            t[f"producer/{kind}_mu.{layer}"] = torch.zeros(H, D)
            for n in names:
                t[f"{n}/{kind}_dec.{layer}"] = orth(H * r, H * D) if joint else torch.stack([orth(r, D) for _ in range(H)])
                t[f"{n}/{kind}_mu.{layer}"] = torch.zeros(H, D)
                for lo in nested[kind]:
                    t[f"{n}/{kind}_dec@{lo}.{layer}"] = (orth(H * lo, H * D) if joint else
                                                        torch.stack([orth(lo, D) for _ in range(H)]))
    for layer in patch:
        t[f"producer/h_enc.{layer}"] = orth(hid, r_h)
        t[f"producer/h_mu.{layer}"] = torch.zeros(hid)
        for n in names:
            t.update(random_aligner(n, layer, r_h, hid, aligner_hidden, g))
    return ScdArtifacts(manifest, t)


def random_aligner(consumer: str, layer: int, r_h: int, hidden: int, m: int, g: torch.Generator) -> dict:
    p = f"{consumer}/a_"
    return {f"{p}scale.{layer}": torch.ones(r_h), f"{p}lin_w.{layer}": torch.randn(r_h, hidden, generator=g) / r_h ** 0.5,
            f"{p}lin_b.{layer}": torch.zeros(hidden), f"{p}w1.{layer}": torch.randn(r_h, m, generator=g) / r_h ** 0.5,
            f"{p}b1.{layer}": torch.zeros(m), f"{p}w2.{layer}": torch.randn(m, hidden, generator=g) * 0.01,
            f"{p}b2.{layer}": torch.zeros(hidden)}
