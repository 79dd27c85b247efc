"""Offline SpectrumKV tooling (never imported by the runtime): the per-layer sensitivity profile."""
