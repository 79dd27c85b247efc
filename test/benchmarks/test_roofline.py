"""The workload bound's arithmetic (benchmarks/common/roofline.py), checked against torch's own
FLOP counter on an HF Llama forward and against a brute-force sum."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from common.roofline import ModelShape, offline_flops, offline_lower_bound  # noqa: E402

transformers = pytest.importorskip("transformers")


def tiny_hf_llama(tied: bool):
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                      tie_word_embeddings=tied, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval(), config


def shape_of(config, tied: bool) -> ModelShape:
    return ModelShape(config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                      config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                      config.vocab_size, tied)


def test_forward_flops_match_torch_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    model, config = tiny_hf_llama(tied=False)
    seq = 11
    ids = torch.randint(0, config.vocab_size, (1, seq))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=ids, logits_to_keep=1)
    by_module = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    # the decoder layers and lm_head; some transformers versions add a tiny RoPE-table matmul
    # outside the layers, which no engine needs per token
    counted = sum(by_module[f"LlamaForCausalLM.model.layers.{i}"] for i in range(config.num_hidden_layers))
    counted += by_module["LlamaForCausalLM.lm_head"]
    # eager attention multiplies the full seq x seq score matrix (the causal mask is added after)
    assert shape_of(config, False).forward_flops(seq, seq * seq, 1) == counted


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_per_forward_leave_out_only_an_untied_input_embedding(tied):
    model, config = tiny_hf_llama(tied)
    total = sum(p.numel() for p in model.parameters())  # a tied table is one parameter
    embedding = model.model.embed_tokens.weight.numel()
    expected = total if tied else total - embedding
    assert shape_of(config, tied).weight_bytes_per_forward(2) == 2 * expected


def test_offline_flops_equal_a_step_by_step_sum():
    shape = ModelShape(32, 80, 2, 4, 2, 8, 50, False)
    lens, out = [3, 7, 5], 6
    prefill, decode = offline_flops(shape, lens, out)
    assert prefill == sum(shape.forward_flops(n, n * (n + 1) // 2, 1) for n in lens)
    # one decode forward per new token after the first; step j attends the prompt plus j tokens
    assert decode == sum(shape.forward_flops(1, n + j, 1) for n in lens for j in range(1, out))


def test_lower_bound_takes_the_larger_of_compute_and_critical_path():
    shape = ModelShape(32, 80, 2, 4, 2, 8, 50, False)
    lens, out = [16] * 4, 9
    prefill, decode = offline_flops(shape, lens, out)
    step_bytes = shape.weight_bytes_per_forward(2)
    # slow memory: the tail of 8 weight-bound forwards after the last prefill dominates
    slow = offline_lower_bound(shape, lens, out, 2, flops_per_s=1e9, bytes_per_s=1e3)
    assert slow["critical_path_bound_s"] == pytest.approx(prefill / 1e9 + 8 * step_bytes / 1e3)
    assert slow["bound_s"] == slow["critical_path_bound_s"] > slow["compute_bound_s"]
    # fast memory: all the FLOPs dominate
    fast = offline_lower_bound(shape, lens, out, 2, flops_per_s=1e9, bytes_per_s=1e15)
    assert fast["bound_s"] == fast["compute_bound_s"] == pytest.approx((prefill + decode) / 1e9)
