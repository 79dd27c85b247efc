"""Build something into a folder once, across processes, with a lock that dies with its owner.

    build_once(final_dir, build, marker, what) -> True if this call built it

`final_dir` only ever appears complete: the build runs in a private folder beside it
(`<final_dir>.part-XXXX`) that is renamed into place when `build` returns. An OS file lock
(`flock` on `<final_dir>.lock`) serialises builders; the kernel drops it when its holder exits,
killed or not, so a second process either finds the folder complete and goes on at once, waits
for a LIVE builder (announced with its pid), or builds itself. A killed builder leaves only its
`.part-*` folder, which the next builder removes under the lock.

Every build is announced on stderr ("building ...", then "... done in N s"), whatever the
logging setup of the calling process: a build takes minutes and must never be silent.
"""
from __future__ import annotations

import fcntl
import glob
import os
import shutil
import sys
import tempfile
import time
from typing import Callable


def announce(msg: str) -> None:
    print(f"[sgl_kvxfer] {msg}", file=sys.stderr, flush=True)


def _complete(final_dir: str, marker: str) -> bool:
    return os.path.exists(os.path.join(final_dir, marker))


def build_once(final_dir: str, build: Callable[[str], None], marker: str, what: str, note: str = "") -> bool:
    """Make `final_dir` hold a complete build (`marker`, a file name inside it, exists).

    `build(tmp_dir)` writes the build into an empty private folder; it may raise (nothing is
    kept then). `what` names the build in the lines printed, `note` adds to the "building" line.
    Returns True if this call ran `build`, False if the folder was complete already or another
    process completed it while this one waited."""
    if _complete(final_dir, marker):
        return False
    parent = os.path.dirname(os.path.abspath(final_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    with open(final_dir + ".lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            owner = lock.read().strip() or "another process"
            announce(f"waiting for {owner}, which is building {what} ...")
            fcntl.flock(lock, fcntl.LOCK_EX)  # returns when the builder finishes or dies
        try:
            if _complete(final_dir, marker):
                return False
            # NOTE: under the lock no other builder of this folder runs, so every part folder
            # and an incomplete final folder are leftovers of dead builders.
            for stale in glob.glob(glob.escape(final_dir) + ".part-*"):
                shutil.rmtree(stale, ignore_errors=True)
            shutil.rmtree(final_dir, ignore_errors=True)
            lock.seek(0)
            lock.truncate()
            lock.write(f"process {os.getpid()}")
            lock.flush()
            tmp = tempfile.mkdtemp(prefix=os.path.basename(final_dir) + ".part-", dir=parent)
            announce(f"building {what}{' ' + note if note else ''} into {final_dir} ...")
            start = time.perf_counter()
            try:
                build(tmp)
                if not _complete(tmp, marker):
                    raise RuntimeError(f"the build of {what} wrote no {marker}")
                os.rename(tmp, final_dir)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            announce(f"{what}: done in {time.perf_counter() - start:.0f} s")
            return True
        finally:
            lock.seek(0)
            lock.truncate()
            fcntl.flock(lock, fcntl.LOCK_UN)
