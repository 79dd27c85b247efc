"""Per-layer budgets (`--kv-layer-budget profile`): the int4 store's bytes moved across layers by
measured sensitivity, within the total the uniform budget spends.

The profile (JSON, written offline by `python -m sgl_kvxfer.spectrum_calib.layer_profile`) holds,
for a model, two one-layer-at-a-time sweeps over a baseline with every context token at the low
tier (codec int4, sinks fp16):

    gain_up[l]    = KL(base) - KL(layer l restored to fp16)       the restore-one profile
    loss_down[l]  = KL(layer l lowered to int2c) - KL(base)      int2c: 2-bit, keys per channel

KL is the mean per-token KL(p_fp16 || p) of the continuation's next-token distributions. The
allocation picks one format per layer for the int4 store from

    int2c (lower)  <  int4 (the codec, uniform)  <  int8 (upgrade; int8 stands in for fp16: its
                                                       round trip keeps cosine >= 0.9999)

greedily by gain per byte, at equal bytes:

    balance = extra bytes: what the uniform plan at budget b spends on int8 tokens above int4,
              per int4-store token (so the resident total does not change)
    upgrades, best gain_up / byte first; each is paid from the balance, else by the cheapest
    lowerings (loss_down / byte ascending) while gain_up > the loss they add; a layer is moved
    at most once. Layers with gain_up <= 0 never upgrade.

The token policy then runs under the byte layout those formats give (byte_budget.fit_byte_budget),
so the resident bytes stay within b whatever the allocation.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from sgl_kvxfer.spectrum.formats import IntFormat, StoreFormats

LAYER_BUDGET_CHOICES = ("uniform", "profile")
LOW, UP, DOWN = IntFormat(4), IntFormat(8), IntFormat(2, "channel")


@dataclass(frozen=True)
class LayerProfile:
    num_layers: int
    gain_up: tuple[float, ...]
    loss_down: tuple[float, ...]
    base_kl: float = 0.0
    metric: str = "kl"
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if len(self.gain_up) != self.num_layers or len(self.loss_down) != self.num_layers:
            raise ValueError(f"a profile needs one gain and one loss per layer ({self.num_layers}), got "
                             f"{len(self.gain_up)} and {len(self.loss_down)}")
        for x in (*self.gain_up, *self.loss_down, self.base_kl):
            if not isinstance(x, (int, float)) or x != x or abs(x) == float("inf"):
                raise ValueError(f"profile values must be finite numbers, got {x!r}")

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({**asdict(self), "gain_up": list(self.gain_up), "loss_down": list(self.loss_down)}, f, indent=1)

    @classmethod
    def load(cls, path: str) -> "LayerProfile":
        with open(path) as f:
            d = json.load(f)
        if not isinstance(d, dict):
            raise ValueError(f"{path}: a layer profile is a JSON object")
        try:
            return cls(int(d["num_layers"]), tuple(float(x) for x in d["gain_up"]),
                       tuple(float(x) for x in d["loss_down"]), float(d.get("base_kl", 0.0)),
                       str(d.get("metric", "kl")), dict(d.get("meta", {})))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a layer profile ({exc})") from None


@dataclass(frozen=True)
class LayerAllocation:
    formats: tuple[IntFormat, ...]  # the int4 store's format per layer
    upgraded: tuple[int, ...]
    lowered: tuple[int, ...]
    predicted_gain: float           # sum gain_up - sum loss_down of the moves (nats / token)
    bytes_delta: float              # int4-store bytes per token the moves add (<= the balance)


def _vec_bytes(fmt: IntFormat, head_dim: int, group: int, page: int) -> float:
    return sum(fmt.head_bytes(head_dim, group, page))


def allocate(profile: LayerProfile, extra_bytes: float, num_kv_heads: int, head_dim: int, group_size: int,
             page_size: int) -> LayerAllocation:
    """Greedy allocation of the int4 store's per-layer formats (module docstring). extra_bytes:
    bytes per int4-store token the uniform plan spends above all-int4 (>= 0)."""
    L = profile.num_layers
    lo = _vec_bytes(LOW, head_dim, group_size, page_size) * num_kv_heads
    up_cost = _vec_bytes(UP, head_dim, group_size, page_size) * num_kv_heads - lo
    down_save = lo - _vec_bytes(DOWN, head_dim, group_size, page_size) * num_kv_heads
    ups = sorted((l for l in range(L) if profile.gain_up[l] > 0), key=lambda l: -profile.gain_up[l])
    downs = sorted(range(L), key=lambda l: profile.loss_down[l])
    balance, gain, chosen_up, chosen_down = max(extra_bytes, 0.0), 0.0, [], []
    for layer in ups:
        if layer in chosen_down:
            continue
        need, funds = up_cost - balance, []
        pool = [d for d in downs if d != layer and d not in chosen_down and d not in chosen_up]
        while need > 1e-9 and pool:
            funds.append(pool.pop(0))
            need -= down_save
        if need > 1e-9:
            break  # nothing left to lower: no later upgrade can be paid either
        cost = sum(max(profile.loss_down[d], 0.0) for d in funds)
        if profile.gain_up[layer] <= cost:
            break  # upgrades come best first and lowerings cheapest first: later pairs are worse
        chosen_up.append(layer)
        chosen_down += funds
        balance += len(funds) * down_save - up_cost
        gain += profile.gain_up[layer] - cost
    formats = tuple(UP if l in chosen_up else DOWN if l in chosen_down else LOW for l in range(L))
    delta = len(chosen_up) * up_cost - len(chosen_down) * down_save
    return LayerAllocation(formats, tuple(sorted(chosen_up)), tuple(sorted(chosen_down)), gain, delta)


def layer_formats(allocation: LayerAllocation) -> StoreFormats:
    return StoreFormats.with_int4(allocation.formats)


def plan_store_formats(policy, budget: float, unit: str, layout, num_sink: int, int4_allowed: bool,
                       profile: LayerProfile | None = None) -> tuple[StoreFormats, LayerAllocation | None]:
    """The int store formats a tiered engine runs policy at budget b with: the policy's own (KIVI),
    else a per-layer allocation from `profile` (None: uniform). `layout` is the uniform KVLayout."""
    from sgl_kvxfer.spectrum.byte_budget import planned_fractions
    from sgl_kvxfer.spectrum.tiers import TIER_INT4, TIER_INT8

    own = policy.store_formats(budget, layout)
    if own is not None:
        return own, None
    if profile is None or not int4_allowed:
        return StoreFormats.uniform(layout.num_layers), None
    if profile.num_layers != layout.num_layers:
        raise ValueError(f"the layer profile covers {profile.num_layers} layers, the model has {layout.num_layers}")
    _, f8, f4, _ = planned_fractions(policy, budget, layout, unit, num_sink, int4_allowed)
    extra = f8 * (layout.token_bytes(TIER_INT8) - layout.token_bytes(TIER_INT4)) / (f8 + f4) if f8 + f4 > 0 else 0.0
    alloc = allocate(profile, extra, layout.num_kv_heads, layout.head_dim, layout.group_size, layout.page_size)
    return layer_formats(alloc), alloc
