"""sgl_kvxfer/utils/provenance.py: SGL_KVXFER_COMMIT wins; otherwise the checkout's HEAD (or
"unknown" outside a git checkout)."""
from __future__ import annotations

import re

from sgl_kvxfer.utils.provenance import source_commit


def test_environment_commit_wins(monkeypatch):
    monkeypatch.setenv("SGL_KVXFER_COMMIT", "abc1234")
    assert source_commit() == "abc1234"


def test_checkout_head_without_the_variable(monkeypatch):
    monkeypatch.delenv("SGL_KVXFER_COMMIT", raising=False)
    got = source_commit()
    assert got == "unknown" or re.fullmatch(r"[0-9a-f]{40}", got)
