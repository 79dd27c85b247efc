"""A small random FusedKV model served over HTTP: /generate and /v1/completions answer like the
offline Engine on the same checkpoint, and /get_server_info reports the layer storage map and
the halved KV bytes per token."""
import pytest
import requests
from fusedkv_helpers import write_model
from servers import scaled, start_server

PROMPT = " ".join(f"t{i}" for i in (5, 17, 99, 3, 42, 8, 77, 64, 12, 31, 90, 4))
ARGS = ["--load-format", "safetensors", "--max-total-tokens", "1024", "--chunked-prefill-size", "8",
        "--context-length", "512", "--log-level", "warning"]


@pytest.fixture(scope="module")
def fusedkv_server(tmp_path_factory):
    model_dir = write_model(str(tmp_path_factory.mktemp("fkv_served")), "fusedkv", seed=1)
    handle = start_server(["--model-path", model_dir, *ARGS], name="fusedkv")
    yield model_dir, handle
    assert handle.stop() == []


def test_generate_matches_engine_and_reports_storage(fusedkv_server):
    from sgl_kvxfer import Engine

    model_dir, server = fusedkv_server
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = requests.post(server.url + "/generate", json={"text": PROMPT, "sampling_params": params}, timeout=scaled(120))
    assert r.status_code == 200, r.text
    served = r.json()
    assert served["meta_info"]["prompt_tokens"] == 12 and len(served["output_ids"]) == 8
    c = requests.post(server.url + "/v1/completions", timeout=scaled(120),
                      json={"model": "default", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert c.status_code == 200, c.text
    with Engine(model_dir, max_total_tokens=1024, chunked_prefill_size=8) as eng:
        offline = eng.generate(PROMPT, params)
    assert served["output_ids"] == offline["output_ids"]
    assert c.json()["choices"][0]["text"] == offline["text"]

    info = requests.get(server.url + "/get_server_info", timeout=scaled(30)).json()
    state = info["internal_states"][0]
    fkv = state["fusedkv"]
    assert fkv["variant"] == "fusedkv" and fkv["storage_map"] == [True, True, False, False]
    assert fkv["kv_bytes_ratio_vs_vanilla"] == 0.5
    assert state["kv_bytes_per_token"] == fkv["kv_vanilla_bytes_per_token"] / 2
    assert info["max_total_num_tokens"] == 1024
