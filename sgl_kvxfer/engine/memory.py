"""KV pool sizing from mem_fraction_static (plain arithmetic, unit-testable)."""
from __future__ import annotations

import os

import torch

DEFAULT_MEM_FRACTION_GPU = 0.85
DEFAULT_MEM_FRACTION_CPU = 0.15  # of system RAM: the CPU box also runs the tokenizer, tests, HF...


def device_memory_bytes(device: str) -> tuple[int, int]:
    """(total, free) bytes of the device the pool lives on."""
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        return total, free
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return total, avail


def kv_pool_tokens(device: str, mem_fraction: float | None, weight_bytes: int, bytes_per_token: float,
                   max_total_tokens: int | None) -> int:
    """Slots the pool gets: fraction * total memory, minus weights, divided by per-token bytes.

    On GPU the budget also subtracts memory already used by others (total - free - weights).
    """
    total, free = device_memory_bytes(device)
    if mem_fraction is None:
        mem_fraction = DEFAULT_MEM_FRACTION_GPU if device.startswith("cuda") else DEFAULT_MEM_FRACTION_CPU
    budget = total * mem_fraction - weight_bytes
    if device.startswith("cuda"):
        budget -= max(total - free - weight_bytes, 0)
    tokens = int(budget // bytes_per_token)
    if max_total_tokens is not None:
        tokens = min(tokens, max_total_tokens)
    if tokens < 16:
        raise RuntimeError(
            f"not enough memory for the KV pool: {budget / 2**30:.2f} GiB left after weights at "
            f"mem_fraction_static={mem_fraction}; raise --mem-fraction-static or use a smaller model")
    return tokens
