"""What a workload must cost on a device, from the model's shapes and measured device rates.

Two rates are measured on the device in the same run as the benchmark (never taken from a
spec sheet): dense GEMM throughput (`matmul_flops_per_s`) and device-to-device copy bandwidth
(`copy_bandwidth`). From them and the model's arithmetic, `offline_lower_bound` gives the least
time any engine could take for an offline batch of prompts on that device:

- compute: every prompt and output token must pass through every linear layer, so
  time >= all FLOPs / GEMM rate;
- critical path: the prompt prefilled last cannot finish its prefill before all prefill FLOPs are
  done, and after that it needs output_len - 1 more forwards, one after another. Each forward
  reads every weight it uses from HBM (the weights are far larger than any cache), so each takes
  at least weight bytes / bandwidth: time >= prefill FLOPs / GEMM rate + tail.

Both bounds hold for any schedule (mixed batches, any order); the reported bound is the larger.
They leave out attention's KV reads in the tail and all non-GEMM work, so at the given rates the
true floor is higher. The measured rates are what cuBLAS and a copy reach, not the silicon's
ceiling: `python benchmarks/common/roofline.py RESULT.json --flops F --bandwidth B` recomputes a
result's bound at other rates, such as a spec sheet's peaks.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a Llama-family model that its FLOPs and weight bytes depend on."""

    hidden: int
    intermediate: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool

    @classmethod
    def from_arch(cls, arch) -> "ModelShape":
        return cls(arch.hidden_size, arch.intermediate_size, arch.num_hidden_layers, arch.num_attention_heads,
                   arch.num_key_value_heads, arch.head_dim, arch.vocab_size, arch.tie_word_embeddings)

    def linear_params_per_layer(self) -> int:
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate

    def forward_flops(self, tokens: int, attended_keys: int, logits_rows: int) -> int:
        """Multiply-add FLOPs (2 per MAC) of one forward.

        tokens: rows through the layers; attended_keys: (query, key) pairs summed over those
        rows (a causal prefill of L tokens has L(L+1)/2); logits_rows: rows through lm_head.
        """
        linear = 2 * tokens * self.linear_params_per_layer()
        attention = 2 * 2 * attended_keys * self.q_heads * self.head_dim  # QK^T and PV
        return self.layers * (linear + attention) + 2 * logits_rows * self.hidden * self.vocab

    def weight_bytes_per_forward(self, element_size: int) -> int:
        """Weights one forward reads in full: layers, norms and lm_head (the input embedding is
        only gathered by row, unless it is tied to lm_head, which reads it whole)."""
        norms = (2 * self.layers + 1) * self.hidden
        return element_size * (self.layers * self.linear_params_per_layer() + norms + self.vocab * self.hidden)


def offline_flops(shape: ModelShape, prompt_lens: list[int], output_len: int) -> tuple[int, int]:
    """(prefill FLOPs, decode FLOPs) for prompts that each generate output_len tokens, the first
    from the prefill forward and the rest from one decode forward each."""
    prefill = sum(shape.forward_flops(n, n * (n + 1) // 2, 1) for n in prompt_lens)
    decode = 0
    for n in prompt_lens:
        steps = max(output_len - 1, 0)
        keys = steps * (n + 1) + steps * (steps - 1) // 2  # decode step j attends n + j keys
        decode += shape.forward_flops(steps, keys, steps)
    return prefill, decode


def lower_bound(prefill_flops: int, decode_flops: int, weight_bytes: int, output_len: int,
                flops_per_s: float, bytes_per_s: float) -> dict:
    """Least seconds for an offline run at the given device rates; see the module docstring."""
    step_s = weight_bytes / bytes_per_s
    compute_s = (prefill_flops + decode_flops) / flops_per_s
    critical_s = prefill_flops / flops_per_s + max(output_len - 1, 0) * step_s
    return {"prefill_flops": prefill_flops, "decode_flops": decode_flops, "flops_per_s": flops_per_s,
            "bytes_per_s": bytes_per_s, "weight_bytes_per_forward": weight_bytes, "min_forward_s": step_s,
            "compute_bound_s": compute_s, "critical_path_bound_s": critical_s, "bound_s": max(compute_s, critical_s)}


def offline_lower_bound(shape: ModelShape, prompt_lens: list[int], output_len: int, element_size: int,
                        flops_per_s: float, bytes_per_s: float) -> dict:
    """`lower_bound` for prompts of these lengths, each generating output_len tokens."""
    prefill, decode = offline_flops(shape, prompt_lens, output_len)
    return lower_bound(prefill, decode, shape.weight_bytes_per_forward(element_size), output_len,
                       flops_per_s, bytes_per_s)


def _median_cuda_s(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth, read + write bytes per second, of an nbytes buffer."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_cuda_s(lambda: dst.copy_(src), repeats)


def matmul_flops_per_s(dtype: torch.dtype, shapes: list[tuple[int, int, int]], repeats: int = 10) -> float:
    """The best dense GEMM rate over (M, N, K) shapes, FLOPs per second (2 per MAC). Each is timed
    in a linear layer's layout (activations M x K times weights N x K, transposed) and in the
    plain one; the best counts, so the bound built on it errs low."""
    best = 0.0
    for m, n, k in shapes:
        a = torch.randn(m, k, dtype=dtype, device="cuda")
        w = torch.randn(n, k, dtype=dtype, device="cuda")
        for fn in (lambda: torch.mm(a, w.t()), lambda: torch.mm(a, w.view(k, n))):
            best = max(best, 2 * m * n * k / _median_cuda_s(fn, repeats))
    return best


def measure_offline_bound(arch, prompt_lens: list[int], output_len: int, dtype: torch.dtype,
                          prefill_rows: int) -> dict:
    """Measure this GPU's GEMM rate (a square GEMM and the model's own MLP shapes at a full
    prefill batch of `prefill_rows` tokens) and copy bandwidth, then return
    `offline_lower_bound` for the workload."""
    shape, rows = ModelShape.from_arch(arch), prefill_rows
    gemms = [(8192, 8192, 8192), (rows, 2 * shape.intermediate, shape.hidden), (rows, shape.hidden, shape.intermediate)]
    flops = matmul_flops_per_s(dtype, gemms)
    bandwidth = copy_bandwidth()
    element_size = torch.empty((), dtype=dtype).element_size()
    return {"gemm_shapes": gemms, **offline_lower_bound(shape, prompt_lens, output_len, element_size, flops, bandwidth)}


def main() -> None:
    """Recompute an offline result's bound at other rates, e.g. a spec sheet's peaks."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("result", help="an offline_*.json written on CUDA (it carries lower_bound)")
    p.add_argument("--flops", type=float, required=True, help="dense GEMM FLOPs per second")
    p.add_argument("--bandwidth", type=float, required=True, help="memory bytes per second")
    args = p.parse_args()
    with open(args.result) as f:
        result = json.load(f)
    lb = result["lower_bound"]
    b = lower_bound(lb["prefill_flops"], lb["decode_flops"], lb["weight_bytes_per_forward"],
                    result["params"]["output_len"], args.flops, args.bandwidth)
    bound, compute, critical = b["bound_s"], b["compute_bound_s"], b["critical_path_bound_s"]
    print(f"bound {bound:.3f} s (compute {compute:.3f} s, critical path {critical:.3f} s); "
          f"largest ratio over HF: {result['hf_generate']['elapsed_s'] / bound:.2f}x; "
          f"measured engine run: {result['sgl_kvxfer']['elapsed_s']:.3f} s")


if __name__ == "__main__":
    main()
