"""SpectrumKV's tier settings (a mixin of `EngineTiering`, scheduler/tiering.py).

Settings apply to later requests; requests already tiered keep their tiers. The int stores'
per-layer formats are fixed when the pool is built: `_check_formats` refuses settings that need
other formats, so `layout` and `allocation` always describe the pool's stores.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

from sgl_kvxfer.spectrum.policies import create_tier_policy


@dataclass(frozen=True)
class TierSettings:
    policy: str
    budget: float
    unit: str
    int4_allowed: bool
    decode_recent: int
    layer_budget: str = "uniform"      # "profile": per-layer int4 formats (spectrum/layer_budget.py)
    layer_profile: str | None = None   # its JSON
    recency_lambda: float = 0.0        # Eq. 13's lambda


class TierSettingsMixin:
    """`EngineTiering.configure` / `using` and the policy they build; reads `base_layout`, `pool`."""

    def configure(self, **changes) -> TierSettings:
        """Change policy / budget / unit / int4_allowed / decode_recent / layer_budget /
        layer_profile / recency_lambda for later requests; returns the old settings. Requests
        already tiered keep their tiers. The int stores' per-layer formats were fixed when the
        pool was built (mem_cache/__init__.py: tier_store_formats, from the flags): a change that
        needs other formats (to or from KIVI, --kv-layer-budget profile, a budget that moves a
        profile's allocation) is refused with a ValueError; start an engine with those flags. The
        stores' sizes stay too: a mix other than the planned one falls back to a higher tier
        where a store is short (TierRecord.got)."""
        old = self.settings
        new = replace(old, **changes)
        policy = self._make_policy(new)
        self._check_formats(policy, new)
        self.settings, self.policy = new, policy
        return old

    @contextmanager
    def using(self, **changes):
        old = self.configure(**changes)
        try:
            yield self
        finally:
            self.configure(**vars(old))

    def _make_policy(self, st: TierSettings):
        return create_tier_policy(st.policy, layout=self.base_layout, budget=st.budget)

    def _profile(self, st: TierSettings):
        if st.layer_budget != "profile":
            return None
        from sgl_kvxfer.spectrum.layer_budget import LayerProfile

        if not st.layer_profile:
            raise ValueError("layer_budget 'profile' needs a layer_profile JSON")
        return LayerProfile.load(st.layer_profile)

    def _check_formats(self, policy, st: TierSettings) -> None:
        """Refuse settings whose int store formats differ from the pool's (fixed at start-up)."""
        from sgl_kvxfer.spectrum.layer_budget import plan_store_formats

        formats, alloc = plan_store_formats(policy, st.budget, st.unit, self.base_layout, self.config.kv_sink_tokens,
                                            st.int4_allowed, self._profile(st))
        # FusedKV pools hold only the stored layers: uniform formats compare by value, not by count
        same = formats == self.pool.formats or (
            formats.is_uniform and self.pool.formats.is_uniform
            and set(formats.int8) == set(self.pool.formats.int8) and set(formats.int4) == set(self.pool.formats.int4))
        if not same:
            raise ValueError(f"tier settings {st} need int store formats {formats.describe()}, the pool was built "
                             f"with {self.pool.formats.describe()}: the formats are fixed at start-up (start an "
                             f"engine with --kv-tier-policy / --kv-tier-budget / --kv-layer-budget for them)")
        self.layout = replace(self.base_layout, formats=None if formats.is_uniform else formats)
        self.allocation = alloc
