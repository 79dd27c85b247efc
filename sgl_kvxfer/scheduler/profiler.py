"""The scheduler's torch.profiler capture (POST /start_profile, /stop_profile; SGLang's routes).

States: idle --start--> recording --stop, or num_steps forward steps, or close--> idle.
The trace goes to `<output_dir>/<profile_id>-TP-0.trace.json.gz` (SGLang's name), a gzip of
torch.profiler's chrome trace, written under a temporary name and renamed: a reader never sees
half a file.

Hazards: a recording server runs slower (every op is recorded; `with_stack` and
`record_shapes` cost more), and writing the trace blocks the scheduler loop for as long as the
export takes (seconds for a long capture). CUDA activity is recorded only where CUDA exists.
"""
from __future__ import annotations

import gzip
import logging
import os
import shutil
import tempfile
import time

from sgl_kvxfer.env import TORCH_PROFILER_DIR
from sgl_kvxfer.message import ProfileReq

logger = logging.getLogger(__name__)
ACTIVITIES = ("CPU", "GPU")


def trace_path(output_dir: str, profile_id: str) -> str:
    return os.path.join(output_dir, f"{profile_id}-TP-0.trace.json.gz")


class SchedulerProfiler:
    """One torch.profiler capture at a time over the scheduler's steps."""

    def __init__(self):
        self._prof = None  # torch.profiler.profile while recording
        self._path = ""  # where the recording's trace goes
        self._steps_left: int | None = None  # forward steps until it stops itself (None: until /stop_profile)

    @property
    def recording(self) -> bool:
        return self._prof is not None

    def start(self, req: ProfileReq) -> tuple[bool, str]:
        import torch

        if self.recording:
            return False, f"A profile is already running (its trace goes to {self._path}); stop it first."
        pid = req.profile_id
        if pid is not None and (pid in (".", "..") or "/" in pid or "\\" in pid or "\x00" in pid):
            return False, f"profile_id must be a plain file-name stem (no path separators), got {pid!r}."
        if req.num_steps is not None and req.num_steps <= 0:
            return False, f"num_steps must be a positive integer, got {req.num_steps}."
        wanted = req.activities if req.activities is not None else list(ACTIVITIES)
        unknown = [a for a in wanted if a not in ACTIVITIES]
        if unknown or not wanted:
            return False, f"activities must be a non-empty list of {list(ACTIVITIES)}, got {wanted}."
        if req.activities is None and not torch.cuda.is_available():
            wanted = ["CPU"]  # the default: both where CUDA exists
        if "GPU" in wanted and not torch.cuda.is_available():
            return False, "activity GPU needs CUDA, which this server does not have."
        output_dir = req.output_dir or TORCH_PROFILER_DIR.get() or tempfile.gettempdir()
        try:
            os.makedirs(output_dir, exist_ok=True)
        except (OSError, ValueError) as e:  # ValueError: a NUL or an unencodable character in the path
            return False, f"output_dir {output_dir!r} cannot be created: {e}"
        if not os.access(output_dir, os.W_OK):
            return False, f"output_dir {output_dir!r} is not writable."
        kinds = {"CPU": torch.profiler.ProfilerActivity.CPU, "GPU": torch.profiler.ProfilerActivity.CUDA}
        prof = torch.profiler.profile(activities=[kinds[a] for a in wanted], with_stack=req.with_stack,
                                      record_shapes=req.record_shapes)
        prof.start()
        self._prof, self._steps_left = prof, req.num_steps
        self._path = trace_path(output_dir, req.profile_id or str(time.time()))
        logger.info("profiling %s (%s steps) to %s", wanted, req.num_steps or "until stopped", self._path)
        return True, f"Profiling to {self._path}."

    def stop(self) -> tuple[bool, str]:
        """Stop the recording and write its trace (blocks the caller while it writes)."""
        if not self.recording:
            return False, "No profile is running."
        prof, path, self._prof, self._steps_left = self._prof, self._path, None, None
        prof.stop()
        tmp_json = f"{path}.{os.getpid()}.tmp.json"
        tmp_gz = f"{path}.{os.getpid()}.tmp"
        try:
            prof.export_chrome_trace(tmp_json)
            with open(tmp_json, "rb") as src, gzip.open(tmp_gz, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(tmp_gz, path)
        except Exception as e:  # noqa: BLE001 (a trace that cannot be written must not stop the scheduler)
            logger.exception("profile trace could not be written to %s", path)
            return False, f"The trace could not be written to {path}: {e}"
        finally:
            for leftover in (tmp_json, tmp_gz):
                if os.path.exists(leftover):
                    os.remove(leftover)
        logger.info("profile trace written to %s", path)
        return True, f"Trace written to {path}."

    def after_step(self, ran_forward: bool) -> None:
        """Count a scheduler step; the num_steps-th one that ran a forward ends the recording."""
        if self._steps_left is None or not ran_forward:
            return
        self._steps_left -= 1
        if self._steps_left <= 0:
            self.stop()

    def close(self) -> None:
        """At shutdown: a running recording is stopped and its trace written (nothing lost)."""
        if self.recording:
            self.stop()
