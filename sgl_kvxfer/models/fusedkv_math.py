"""FusedKV math (../shared/papers/fusedkv-cross-layer-fusion.txt): config, fusion, init, fitting.

Pure torch, no engine imports: the model variants, the layer-mapped pool and the offline
package (sgl_kvxfer/fusedkv/: training, retrofit, converter) build on this file. The fusion
itself, `fuse_kv`, is the attention kernels' reference and lives beside them
(kernels/reference.py).

Layers (0-based here; the paper counts from 1, so its "layer 1" and "layer n" are our
`source_layers = (0, n - 1)`):

    layer   0 .. n-1        storage layers: compute and store their own post-RoPE K and V
    layer   n .. L-1        reconstruction layers: compute only q; K and V come from the
                            caches of the two source layers s0 = source_layers[0] (bottom)
                            and s1 = source_layers[1] (last storage layer by default)

    FusedKV (paper Eq. 4-5), per reconstruction layer i, elementwise over [Hkv, D]:
        K_i = a_i0 * K_s0 + a_i1 * K_s1          (post-RoPE keys)
        V_i = b_i0 * V_s0 + b_i1 * V_s1
    FusedKV-Lite (paper Eq. 6): K_i = K_s1, V_i = V_s0, no weights.

RoPE pair constraint (paper section 2.4 / appendix A.4). A key weight w applied to a rotated
key gives scores with a (m - n) term scaled by (w_c + w_c')/2 and an absolute (m + n) term
scaled by (w_c - w_c')/2, for the two channels c, c' of one rotary pair; the absolute term
vanishes iff w_c == w_c'. The paper writes pairs as (2j, 2j+1) (interleaved RoPE); our models
rotate halves (layers/rope.py: channel j pairs with j + D/2), so the stored key parameter holds
ONE weight per pair, [.., D/2], and `expand_key_weight` writes it to both channels of its pair.
The constraint is structural: no stored state can break it. Values carry no rotation, so value
weights are free per channel.

Checkpoint tensors of a FusedKV model (safetensors, float32), per reconstruction layer i:

    model.layers.{i}.self_attn.kv_fusion.key_pair_weight   [2, Hkv, D/2]   [0]: s0, [1]: s1
    model.layers.{i}.self_attn.kv_fusion.value_weight      [2, Hkv, D]     [0]: s0, [1]: s1

and NO k/v projection rows for reconstruction layers (their `q_proj` and `o_proj` stay; the
engine's fused qkv_proj of such a layer is q only). Lite has no fusion tensors.

The `fusedkv` section of config.json (absent: a vanilla model):

    "fusedkv": {
        "variant": "fusedkv",        # "fusedkv" | "lite"
        "num_storage_layers": 15,    # default num_hidden_layers // 2 (the bottom half)
        "source_layers": [0, 14],    # 0-based (bottom, last storage); default [0, n - 1]
        "init": "equivalent",        # weights used when the checkpoint has none (see INITS)
        "init_seed": 0
    }
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from sgl_kvxfer.kernels.reference import fuse_kv  # noqa: F401  (the reference fusion the kernels follow)

VARIANTS = ("fusedkv", "lite")
# equivalent: the paper's best (Table 5), standard FusedKV initialized to equal the iterative
#             fusion with N(0, 1) auxiliary weights at step 0 (appendix A.3)
# normal:     every weight N(0, 1) (appendix A.3, "Normal Initialization")
# lite:       a_i1 = b_i0 = 1, a_i0 = b_i1 = 0: starts as FusedKV-Lite (not in the paper)
INITS = ("equivalent", "normal", "lite")
ROPE_LAYOUTS = ("half", "interleaved")  # half: our models (HF Llama); interleaved: the paper's
CONFIG_KEY = "fusedkv"
KEY_PARAM, VALUE_PARAM = "key_pair_weight", "value_weight"


@dataclass(frozen=True)
class FusedKVConfig:
    """Which layers store KV and how the others rebuild it. Immutable; built from config.json."""

    num_hidden_layers: int
    variant: str = "fusedkv"
    num_storage_layers: int | None = None  # None: num_hidden_layers // 2
    source_layers: tuple[int, int] | None = None  # None: (0, num_storage_layers - 1)
    init: str = "equivalent"
    init_seed: int = 0

    def __post_init__(self):
        L = self.num_hidden_layers
        if L < 2:
            raise ValueError(f"fusedkv needs at least 2 layers (num_hidden_layers={L})")
        if self.variant not in VARIANTS:
            raise ValueError(f"fusedkv.variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.init not in INITS:
            raise ValueError(f"fusedkv.init must be one of {INITS}, got {self.init!r}")
        n = L // 2 if self.num_storage_layers is None else self.num_storage_layers
        if not isinstance(n, int) or not 1 <= n < L:
            raise ValueError(
                f"fusedkv.num_storage_layers must be an int in [1, {L - 1}] (at least one storage "
                f"and one reconstruction layer), got {n!r}")
        object.__setattr__(self, "num_storage_layers", n)
        src = (0, n - 1) if self.source_layers is None else tuple(self.source_layers)
        if len(src) != 2 or not all(isinstance(s, int) and 0 <= s < n for s in src):
            raise ValueError(
                f"fusedkv.source_layers must be two 0-based storage layer indices in [0, {n - 1}] "
                f"(bottom, last storage), got {self.source_layers!r}")
        object.__setattr__(self, "source_layers", src)

    # ---- parsing ---------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict) -> "FusedKVConfig | None":
        """The `fusedkv` section of a config.json dict, or None for a vanilla model."""
        section = d.get(CONFIG_KEY)
        if section is None:
            return None
        if not isinstance(section, dict):
            raise ValueError(f"config.json '{CONFIG_KEY}' must be an object, got {type(section).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)} - {"num_hidden_layers"}
        unknown = sorted(set(section) - fields)
        if unknown:
            raise ValueError(f"unknown keys in config.json '{CONFIG_KEY}': {unknown}; known: {sorted(fields)}")
        kw = dict(section)
        if kw.get("source_layers") is not None:
            kw["source_layers"] = tuple(kw["source_layers"])
        return cls(num_hidden_layers=int(d["num_hidden_layers"]), **kw)

    def to_dict(self) -> dict:
        """The config.json section (explicit values, so the file says what runs)."""
        return {"variant": self.variant, "num_storage_layers": self.num_storage_layers,
                "source_layers": list(self.source_layers), "init": self.init, "init_seed": self.init_seed}

    # ---- layer map -------------------------------------------------------------------------
    @property
    def storage_layers(self) -> range:
        return range(self.num_storage_layers)

    @property
    def reconstruction_layers(self) -> range:
        return range(self.num_storage_layers, self.num_hidden_layers)

    @property
    def kv_layer_fraction(self) -> float:
        """Stored KV bytes relative to a vanilla model of the same shape."""
        return self.num_storage_layers / self.num_hidden_layers

    def is_storage(self, layer: int) -> bool:
        return 0 <= layer < self.num_storage_layers

    def kv_sources(self, layer: int) -> tuple[int, int]:
        """(layer whose K cache, layer whose V cache) a Lite or storage layer attends over.
        For FusedKV reconstruction layers both caches of both source layers are read."""
        if self.is_storage(layer):
            return layer, layer
        if self.variant != "lite":
            raise ValueError(f"layer {layer} of a FusedKV model fuses two sources: use source_layers")
        return self.source_layers[1], self.source_layers[0]

    @property
    def has_fusion_weights(self) -> bool:
        return self.variant == "fusedkv"


# ---- parameters ---------------------------------------------------------------------------
def fusion_param_names(layer: int) -> tuple[str, str]:
    """Checkpoint names of one reconstruction layer's (key pair weights, value weights)."""
    prefix = f"model.layers.{layer}.self_attn.kv_fusion."
    return prefix + KEY_PARAM, prefix + VALUE_PARAM


def fusion_param_shapes(num_kv_heads: int, head_dim: int) -> tuple[tuple, tuple]:
    return (2, num_kv_heads, head_dim // 2), (2, num_kv_heads, head_dim)


def expand_key_weight(pair_weight: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """[..., D/2] one weight per rotary pair -> [..., D] per channel (both channels of a pair
    equal). half: channel j and j + D/2 (ours); interleaved: 2j and 2j + 1 (the paper's)."""
    if layout == "half":
        return torch.cat([pair_weight, pair_weight], dim=-1)
    if layout == "interleaved":
        return pair_weight.repeat_interleave(2, dim=-1)
    raise ValueError(f"rope layout must be one of {ROPE_LAYOUTS}, got {layout!r}")


class KVFusion(nn.Module):
    """One reconstruction layer's learnable weights (FusedKV). Parameter names and shapes are
    the checkpoint's (`fusion_param_names`) under the `kv_fusion` submodule of self_attn."""

    def __init__(self, num_kv_heads: int, head_dim: int, rope_layout: str = "half"):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even, got {head_dim}")
        ks, vs = fusion_param_shapes(num_kv_heads, head_dim)
        self.rope_layout = rope_layout
        self.key_pair_weight = nn.Parameter(torch.zeros(ks))
        self.value_weight = nn.Parameter(torch.zeros(vs))

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(key [2, Hkv, D], value [2, Hkv, D]) per channel, float32."""
        return expand_key_weight(self.key_pair_weight.float(), self.rope_layout), self.value_weight.float()

    def forward(self, k0, k1, v0, v1):
        """[..., Hkv, D] each -> (K, V) in the input dtype; `fuse_kv`, differentiable."""
        return fuse_kv(k0, k1, v0, v1, *self.weights())


# ---- initialization -----------------------------------------------------------------------
def init_fusion_weights(cfg: FusedKVConfig, num_kv_heads: int, head_dim: int,
                        generator: torch.Generator | None = None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{reconstruction layer: (key_pair_weight [2, Hkv, D/2], value_weight [2, Hkv, D])} float32
    per `cfg.init` (CPU; seeded by cfg.init_seed unless a generator is given). Empty for Lite."""
    if not cfg.has_fusion_weights:
        return {}
    g = generator or torch.Generator().manual_seed(cfg.init_seed)
    ks, vs = fusion_param_shapes(num_kv_heads, head_dim)
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    if cfg.init == "normal":
        for i in cfg.reconstruction_layers:
            out[i] = torch.randn(ks, generator=g), torch.randn(vs, generator=g)
    elif cfg.init == "lite":
        for i in cfg.reconstruction_layers:
            k, v = torch.zeros(ks), torch.zeros(vs)
            k[1], v[0] = 1.0, 1.0
            out[i] = k, v
    else:  # equivalent (appendix A.3): unroll the iterative fusion
        #   K_{n}   = a'_{n,0} K_s0 + a'_{n,1} K_s1          (first reconstruction layer n)
        #   K_i     = a'_{i,prev} K_{i-1} + a'_{i,1} K_s1    (i > n; keys lean on s1)
        #   V_i     = b'_{i,prev} V_{i-1} + b'_{i,0} V_s0    (i > n; values lean on s0)
        # so (coef of s0, coef of s1) of layer i follow from layer i-1's by one multiply-add.
        kc = vc = None
        for i in cfg.reconstruction_layers:
            if kc is None:
                kc = torch.randn(ks, generator=g)
                vc = torch.randn(vs, generator=g)
            else:
                a_prev, a_new = torch.randn(ks[1:], generator=g), torch.randn(ks[1:], generator=g)
                b_prev, b_new = torch.randn(vs[1:], generator=g), torch.randn(vs[1:], generator=g)
                kc = torch.stack([a_prev * kc[0], a_prev * kc[1] + a_new])
                vc = torch.stack([b_prev * vc[0] + b_new, b_prev * vc[1]])
            out[i] = kc.clone(), vc.clone()
    return out


class FusionLstsq:
    """Streaming least-squares fit of one reconstruction layer's weights: `update` with batches
    of calibration KV, then `solve`. Keeps only the 2x2 normal equations (5 float64 sums per
    key pair and per value channel), so calibration never holds all tokens.

    k*, v* [T, Hkv, D] (post-RoPE keys). Keys: per (head, rotary pair), one (a0, a1) over the
    pair's two channels and all tokens (the constrained fit, not a per-channel fit averaged
    afterwards); values: per (head, channel). Solved with a relative ridge (`ridge` x trace / 2)
    so dead channels stay finite."""

    def __init__(self, rope_layout: str = "half", ridge: float = 1e-6):
        if rope_layout not in ROPE_LAYOUTS:
            raise ValueError(f"rope layout must be one of {ROPE_LAYOUTS}, got {rope_layout!r}")
        self.rope_layout, self.ridge = rope_layout, ridge
        self.k_stats = self.v_stats = None  # [5, Hkv, D/2] / [5, Hkv, D]: g00 g01 g11 r0 r1

    def _pairs(self, x):  # [T, Hkv, D] -> [2T, Hkv, D/2]: a pair's two channels as two samples
        x = x.double()
        D = x.shape[-1]
        if self.rope_layout == "half":
            return torch.cat([x[..., : D // 2], x[..., D // 2:]], dim=0)
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=0)

    @staticmethod
    def _stats(x0, x1, y):  # samples on dim 0
        return torch.stack([(x0 * x0).sum(0), (x0 * x1).sum(0), (x1 * x1).sum(0), (x0 * y).sum(0), (x1 * y).sum(0)])

    def update(self, k0, k1, k_target, v0, v1, v_target) -> None:
        if not (k0.shape == k1.shape == k_target.shape == v0.shape == v1.shape == v_target.shape) or k0.dim() != 3:
            raise ValueError(f"all inputs must be [T, Hkv, D] of one shape, got {tuple(k0.shape)} ...")
        ks = self._stats(self._pairs(k0), self._pairs(k1), self._pairs(k_target))
        vs = self._stats(v0.double(), v1.double(), v_target.double())
        self.k_stats = ks if self.k_stats is None else self.k_stats + ks
        self.v_stats = vs if self.v_stats is None else self.v_stats + vs

    def _solve(self, st):
        g00, g01, g11, r0, r1 = st
        lam = self.ridge * (g00 + g11).clamp_min(1e-30) / 2
        g00, g11 = g00 + lam, g11 + lam
        det = g00 * g11 - g01 * g01
        return torch.stack([(g11 * r0 - g01 * r1) / det, (g00 * r1 - g01 * r0) / det]).float()

    def solve(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (key_pair_weight [2, Hkv, D/2], value_weight [2, Hkv, D]) float32."""
        if self.k_stats is None:
            raise ValueError("FusionLstsq.solve before any update")
        return self._solve(self.k_stats), self._solve(self.v_stats)


def fit_fusion_weights_lstsq(k0: torch.Tensor, k1: torch.Tensor, k_target: torch.Tensor,
                             v0: torch.Tensor, v1: torch.Tensor, v_target: torch.Tensor,
                             rope_layout: str = "half", ridge: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """One-shot `FusionLstsq`: (key_pair_weight [2, Hkv, D/2], value_weight [2, Hkv, D])."""
    fit = FusionLstsq(rope_layout, ridge)
    fit.update(k0, k1, k_target, v0, v1, v_target)
    return fit.solve()


def check_fusion_tensors(cfg: FusedKVConfig, tensors: dict[str, torch.Tensor],
                         num_kv_heads: int, head_dim: int) -> None:
    """Raise with the offending name if a checkpoint's fusion tensors are missing, misshaped
    or present where they must not be (a Lite model, a storage layer)."""
    ks, vs = fusion_param_shapes(num_kv_heads, head_dim)
    present = {n for n in tensors if ".kv_fusion." in n}
    expected: dict[str, tuple] = {}
    if cfg.has_fusion_weights:
        for i in cfg.reconstruction_layers:
            kn, vn = fusion_param_names(i)
            expected[kn], expected[vn] = ks, vs
    for name, shape in expected.items():
        if name not in tensors:
            raise ValueError(f"FusedKV checkpoint lacks {name} {shape}")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{name}: shape {tuple(tensors[name].shape)}, expected {shape}")
    extra = sorted(present - set(expected))
    if extra:
        raise ValueError(f"unexpected fusion tensors for variant {cfg.variant!r} with "
                         f"{cfg.num_storage_layers} storage layers: {extra[:4]}")
