"""Engine.shutdown gives the GPU back (CUDA): three engines in a row in one process, each taking
half of the device for its KV pool and capturing decode graphs, each shut down while the caller
still holds it. After every shutdown the device's free memory is back to where it started
(within 1 GiB) and torch's caching allocator holds almost nothing. About a minute on an H100.

    bash scripts/gpu/run_gpu_tests.sh test/engine/test_engine_shutdown_gpu.py    (carry .whl)
"""
import json

import pytest
import torch

pytestmark = pytest.mark.gpu
TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "vocab_size": 256,
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 1024, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from sgl_kvxfer.models.presets import write_dummy_tokenizer

    d = tmp_path_factory.mktemp("tiny_llama_gpu")
    (d / "config.json").write_text(json.dumps(TINY))
    return write_dummy_tokenizer(str(d), TINY["vocab_size"])


def test_three_engines_in_a_row_each_get_the_whole_gpu_back(tiny_dir):
    from sgl_kvxfer import Engine

    torch.cuda.synchronize()
    free0, total = torch.cuda.mem_get_info()
    kept = []
    for i in range(3):
        eng = Engine(tiny_dir, load_format="dummy", device="cuda", mem_fraction_static=0.5, cuda_graph_max_bs=16)
        assert eng.runner.graph_runner is not None  # decode graphs captured (their pool must go too)
        free_loaded = torch.cuda.mem_get_info()[0]
        assert free0 - free_loaded > total * 0.3, "the engine did not take its pool"
        out = eng.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params={"max_new_tokens": 8, "temperature": 0})
        assert all(len(o["output_ids"]) == 8 for o in out)
        eng.shutdown()
        kept.append(eng)  # still referenced, as `with Engine(...) as e:` leaves `e`
        free, _ = torch.cuda.mem_get_info()
        reserved = torch.cuda.memory_reserved()
        print(f"engine {i}: free {free0 / 2**30:.1f} -> {free_loaded / 2**30:.1f} -> {free / 2**30:.1f} GiB, "
              f"reserved after shutdown {reserved / 2**20:.0f} MiB")
        assert free > free0 - 2**30, f"engine {i}: {(free0 - free) / 2**30:.1f} GiB not returned"
        assert reserved < 512 * 2**20, f"engine {i}: torch still reserves {reserved / 2**20:.0f} MiB"
