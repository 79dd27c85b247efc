"""Bytes a KV pool actually allocated: every tensor reachable from it, counted once.

Family-agnostic (fp16, paged, tiered, layer-mapped wrappers): walks the pool's attributes,
lists, tuples, dicts and nested objects of this package, and sums the storage of distinct
tensors. Benchmarks report it next to `bytes_per_token` (which is per resident token).
"""
from __future__ import annotations

import torch


def allocated_bytes(pool) -> int:
    seen_objs, seen_storage, total = set(), set(), 0
    stack = [pool]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objs:
            continue
        seen_objs.add(id(obj))
        if isinstance(obj, torch.Tensor):
            key = (obj.device, obj.untyped_storage().data_ptr())
            if key not in seen_storage:
                seen_storage.add(key)
                total += obj.untyped_storage().nbytes()
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif type(obj).__module__.startswith("sgl_kvxfer") and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return total
