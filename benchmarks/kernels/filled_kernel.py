"""The decode kernel over the engine's tiered layout, or its torch reference where it is missing.

    kernel = load_filled_kernel()
    kernel.available                  True: sgl_kvxfer.kernels.filled_decode_attention imports
    kernel.make_config(d)             FilledDecodeConfig(**d); None -> None (the kernel's defaults)
    kernel.make_plan(B, Hkv, L, dev, config, **shape)  plan_filled_decode(...) or None
    kernel(q, layer, tables, out=..., plan=..., config=...)

Without the kernel module the call is decode_attention_tiered_reference (a host loop per
request: correct, slow, not capturable in a CUDA graph), `available` is False and `name` says so.
plan_filled_decode gets the keyword arguments its signature names among config / head_dim /
num_q_heads / dtype / group_size; a plan that cannot be made is None (the kernel plans itself),
with the reason in `plan_error`.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


@dataclass
class FilledKernel:
    fn: Callable
    name: str
    available: bool
    config_cls: Any = None
    planner: Optional[Callable] = None
    plan_error: Optional[str] = field(default=None)

    def __call__(self, q, layer, tables, out=None, plan=None, config=None):
        if not self.available:
            res = self.fn(q, layer, tables)
            if out is not None:
                out.copy_(res)
                return out
            return res
        return self.fn(q, layer, tables, out=out, plan=plan, config=config)

    def make_config(self, d: Optional[dict]):
        if d is None:
            return None
        if self.config_cls is None:
            raise RuntimeError(f"{self.name}: no FilledDecodeConfig to build {d} with")
        return self.config_cls(**d)

    def make_plan(self, batch: int, num_kv_heads: int, max_tokens: int, device, config=None, **shape):
        if self.planner is None:
            return None
        params = inspect.signature(self.planner).parameters
        extra = {k: v for k, v in {"config": config, **shape}.items() if k in params}
        try:
            return self.planner(batch, num_kv_heads, max_tokens, device, **extra)
        except Exception as exc:  # noqa: BLE001 - record, and let the kernel plan itself
            self.plan_error = f"{type(exc).__name__}: {exc}"[:300]
            return None


def load_filled_kernel() -> FilledKernel:
    try:
        from sgl_kvxfer.kernels import filled_decode_attention as m
    except ImportError as exc:
        from sgl_kvxfer.kernels.decode_attention import decode_attention_tiered_reference

        return FilledKernel(decode_attention_tiered_reference,
                            f"decode_attention_tiered_reference (filled_decode_attention: {exc})", False)
    return FilledKernel(m.decode_attention_filled, "decode_attention_filled", True,
                        getattr(m, "FilledDecodeConfig", None), getattr(m, "plan_filled_decode", None))
