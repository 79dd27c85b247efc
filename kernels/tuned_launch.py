"""Launch an autotuned kernel through the config it was tuned to, without Autotuner.run's
per-call work.

    launch = TunedLauncher(_some_autotuned_kernel)
    launch(key, grid, *args, **constexprs)

Triton's `Autotuner.run` rebuilds its cache key on every call from the key arguments and the
dtype string of every tensor argument; at ~50 arguments (the extend attention kernel) that made
the launch ~160 us of host time on an H200's host (benchmarks/kernels/launch_overhead.py), paid
per layer per prefill step. Here the caller supplies `key`, a tuple that determines the
autotuner's own key (its key arguments and its tensor arguments' dtypes). The first launch per
`key` goes through the autotuner (tuning if it must) and records its pick; later launches call
the underlying jitted function with that config's launch options.

Hazard: the bypass skips the autotuner's hooks (pre_hook, post_hook, reset_to_zero,
restore_value); kernels launched this way must not use any. A key that misses something the
autotuner's key depends on would reuse a config tuned for other inputs: slower, never wrong
(every config computes the same result).
"""
from __future__ import annotations


class TunedLauncher:
    def __init__(self, kernel):
        hooked = (getattr(kernel, "user_defined_pre_hook", False) or getattr(kernel, "user_defined_post_hook", False)
                  or getattr(kernel, "reset_to_zero", None) or getattr(kernel, "restore_value", None)
                  or any(getattr(c, "pre_hook", None) for c in kernel.configs))
        if hooked:
            raise ValueError("TunedLauncher cannot bypass an autotuner with hooks or argument reset/restore")
        self.kernel = kernel
        self.configs: dict = {}

    def __call__(self, key: tuple, grid, *args, **kwargs) -> None:
        options = self.configs.get(key)
        if options is None:
            self.kernel[grid](*args, **kwargs)
            best = getattr(self.kernel, "best_config", None)  # a Triton without it: always tune-path
            if best is not None and hasattr(best, "all_kwargs"):
                self.configs[key] = best.all_kwargs()
            return
        self.kernel.fn[grid](*args, **kwargs, **options)
