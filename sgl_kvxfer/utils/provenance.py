"""The source revision a result records: SGL_KVXFER_COMMIT (a GPU call's tree carries no .git),
else the checkout's HEAD, else "unknown"."""
from __future__ import annotations

import os
import subprocess


def source_commit() -> str:
    from sgl_kvxfer import env

    if env.COMMIT.get():
        return env.COMMIT.get()
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL,
                                       cwd=os.path.dirname(os.path.abspath(__file__))).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
