"""KV pool sizing from mem_fraction_static, and the start-up check that a configuration fits
the machine (plain arithmetic, unit-testable)."""
from __future__ import annotations

import os
from dataclasses import dataclass

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
                   max_total_tokens: int | None, weights_loaded: bool = True) -> int:
    """Slots the pool gets: fraction * total memory, minus weights, divided by per-token bytes.

    On GPU the budget also subtracts memory already used by others (total - free, less the
    weights when they are already loaded).
    """
    total, free = device_memory_bytes(device)
    if mem_fraction is None:
        mem_fraction = DEFAULT_MEM_FRACTION_GPU if device.startswith("cuda") else DEFAULT_MEM_FRACTION_CPU
    budget = total * mem_fraction - weight_bytes
    if device.startswith("cuda"):
        budget -= max(total - free - (weight_bytes if weights_loaded else 0), 0)
    tokens = int(budget // bytes_per_token)
    if max_total_tokens is not None:
        tokens = min(tokens, max_total_tokens)
    if tokens < 16:
        raise RuntimeError(
            f"not enough memory for the KV pool: {budget / 2**30:.2f} GiB left after weights at "
            f"mem_fraction_static={mem_fraction}; raise --mem-fraction-static or use a smaller model")
    return tokens


def host_available_bytes() -> int:
    """Memory this process can still take on the host: the kernel's MemAvailable (free plus
    reclaimable cache), capped by the cgroup's limit where one is set (containers)."""
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def available_bytes(device: str) -> int:
    """What a new engine can still allocate: the GPU's free memory, or the host's available RAM."""
    return device_memory_bytes(device)[1] if device.startswith("cuda") else host_available_bytes()


def param_count(arch) -> tuple[int, int]:
    """(all parameters, those of the linears) of a Llama-family model, from its config alone."""
    a = arch
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    per_layer = (a.hidden_size * (q + 2 * kv) + q * a.hidden_size + 3 * a.hidden_size * a.intermediate_size
                 + (q + 2 * kv if a.attention_bias else 0) + (a.hidden_size if a.o_proj_bias else 0)
                 + (2 * a.intermediate_size + a.hidden_size if a.mlp_bias else 0))
    linears = a.num_hidden_layers * per_layer + a.vocab_size * a.hidden_size  # + the LM head
    total = (a.num_hidden_layers * (per_layer + 2 * a.hidden_size) + a.hidden_size
             + a.vocab_size * a.hidden_size * (1 if a.tie_word_embeddings else 2))
    return total, linears


def activation_bytes(arch, elem_bytes: int, batch_tokens: int, batch_requests: int) -> int:
    """An upper estimate of one forward's live activations: per token the residual and normed
    hidden states, q/k/v, the attention output, the MLP's gate|up and product, all at once
    (elem_bytes each); plus fp32 logits for every request of a batch, twice (logits and the
    sampler's working copy)."""
    a = arch
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    per_token = 3 * a.hidden_size + 2 * q + 2 * kv + 3 * a.intermediate_size
    return batch_tokens * per_token * elem_bytes + 2 * batch_requests * a.vocab_size * 4


@dataclass(frozen=True)
class MemoryPlan:
    """What an engine will hold at start-up, in bytes, against what the device has left."""
    device: str
    weights: int
    prepared_weights: int  # CPU bf16: the linears' prepared copies (layers/cpu_linear.py)
    pool_tokens: int
    pool: int
    activations: int
    available: int

    @property
    def needed(self) -> int:
        return self.weights + self.prepared_weights + self.pool + self.activations

    def describe(self) -> str:
        gib = 2 ** 30
        where = "the GPU has free" if self.device.startswith("cuda") else "the host has available"
        prepared = f", their prepared copies {self.prepared_weights / gib:.2f}" if self.prepared_weights else ""
        pool = f", KV pool {self.pool / gib:.2f} for {self.pool_tokens} tokens" if self.pool_tokens else ""
        return (f"about {self.needed / gib:.2f} GiB (weights {self.weights / gib:.2f}{prepared}{pool}, "
                f"activations {self.activations / gib:.2f}) of the {self.available / gib:.2f} GiB {where}")


def plan_memory(device: str, arch, elem_bytes: int, bytes_per_token: float, mem_fraction: float | None,
                max_total_tokens: int | None, max_prefill_tokens: int, max_running_requests: int | None,
                prepared_copy_bytes: int = 0) -> MemoryPlan:
    """Checked before any weight is loaded: weights + prepared copies + KV pool + activations
    must fit what the device has left, or start-up stops here with the numbers (instead of
    the machine running out of memory while a model too big for it loads).

    prepared_copy_bytes: bytes per linear parameter of the CPU bf16 prepared copies (2 or 4),
    0 where none are made."""
    total, linears = param_count(arch)
    weights, prepared = total * elem_bytes, linears * prepared_copy_bytes
    available = available_bytes(device)
    requests = max_running_requests or 256
    activations = activation_bytes(arch, elem_bytes, max_prefill_tokens, requests)
    plan = MemoryPlan(device, weights, prepared, 0, 0, activations, available)
    if plan.needed > available:  # the model alone does not fit: say so before sizing a pool
        raise InsufficientMemoryError(f"not enough memory: the model needs {plan.describe()}; use a smaller "
                                      "model, a smaller --dtype or --max-prefill-tokens")
    tokens = kv_pool_tokens(device, mem_fraction, weights, bytes_per_token, max_total_tokens, weights_loaded=False)
    plan = MemoryPlan(device, weights, prepared, tokens, int(tokens * bytes_per_token), activations, available)
    if plan.needed > available:
        raise InsufficientMemoryError(f"not enough memory: this configuration needs {plan.describe()}; lower "
                                      "--max-total-tokens, --mem-fraction-static or --max-prefill-tokens, or "
                                      "use a smaller model")
    return plan


class InsufficientMemoryError(RuntimeError):
    pass
