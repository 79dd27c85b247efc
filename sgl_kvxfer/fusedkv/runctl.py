"""Run control of a budgeted training run: a clock of training seconds, a progress bar over the
budget, and SIGINT as a request to stop at the next step."""
from __future__ import annotations

import signal
import threading
import time

import torch


class TrainClock:
    """Seconds spent inside `with clock:` blocks, the device synchronized at both ends."""

    def __init__(self, device: str):
        self.s, self.cuda = 0.0, device.startswith("cuda")

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def __enter__(self):
        self._sync()
        self._t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._sync()
        self.s += time.perf_counter() - self._t


class Progress:
    """A tqdm bar over the budget's seconds (a plain line per update without tqdm)."""

    def __init__(self, total_s: float, enabled: bool):
        self.bar, self.enabled, self.done = None, enabled, 0.0
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=round(total_s, 1), unit="s", desc="retrofit", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, clock_s: float, **postfix):
        if self.bar is not None:
            self.bar.update(round(clock_s - self.done, 2))
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)
        self.done = clock_s

    def write(self, line: str):
        if self.bar is not None:
            self.bar.write(line)
        elif self.enabled:
            print(line, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


class StopOnInterrupt:
    """SIGINT (e.g. `timeout -s INT`) ends training at the next step instead of killing the run:
    the final evaluation and the model dir still get written."""

    def __init__(self):
        self.requested, self._old = False, None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, *_):
        self.requested = True

    def restore(self):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None
