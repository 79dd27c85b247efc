"""Calibration's time budget (--time-budget-s): one deadline for the whole process, and each
Patch layer's share of what is left of it.

From the command line the deadline counts from the process's start (Linux /proc:
interpreter start and imports included, so the budget is what a `timeout` around the command
sees; where /proc does not say, from calibrate()'s start); calibrate() called from a longer-lived
process counts from its call. SAVE_RESERVE_S of it is kept free for writing the
artifacts and the report. A layer's share covers its whole turn (joint H fit, code, aligner
training, its final held-out check), so the turns add up to at most what was left.
"""
from __future__ import annotations

import os
import time

SAVE_RESERVE_S = 10.0  # kept free before the deadline: the artifacts, reuse stats and the report
MIN_LAYER_S = 1.0  # a layer given less than this is dropped from the Patch set (it stays Reuse)


def clock() -> float:
    return time.perf_counter()


def process_start() -> float:
    """This process's start on the clock() scale (now, where /proc does not say)."""
    return clock() - process_age_s()


def process_age_s() -> float:
    """Seconds since this process started (0 where /proc does not say)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class Budget:
    """total_s = 0: no deadline (every layer trains, each under cap_s if that is set)."""

    def __init__(self, total_s: float, cap_s: float = 0.0, reserve_s: float = SAVE_RESERVE_S,
                 started: float | None = None):
        """started: the clock() reading the budget counts from (default: now)."""
        self.total_s, self.cap_s, self.reserve_s = total_s, cap_s, reserve_s
        self.deadline = (clock() if started is None else started) + total_s if total_s else None

    @staticmethod
    def now() -> float:
        return clock()

    def left(self) -> float | None:
        """Seconds before the deadline less the save reserve (None: no deadline)."""
        return None if self.deadline is None else self.deadline - self.reserve_s - clock()

    def layer_share(self, layers_left: int) -> float | None:
        """Seconds for the next Patch layer's turn, `layers_left` counting it: 0 = no limit, None =
        no time (drop it). The time left is split evenly among as many of the remaining layers as
        can each get MIN_LAYER_S (the later, less valuable ones are dropped when their turn finds
        none), capped by cap_s."""
        left = self.left()
        if left is None:
            return self.cap_s
        if left < MIN_LAYER_S:
            return None
        share = left / max(1, min(layers_left, int(left // MIN_LAYER_S)))
        return min(self.cap_s, share) if self.cap_s else share
