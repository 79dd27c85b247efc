"""Real SGLang clients against a real server: every `python/` frontend-DSL program.
`python -m sglang.bench_serving --backend sglang --dataset-name random-ids` against a single
server runs as docs/http_api.md prints it (test/test_doc_commands.py, which checks that every
request succeeded), and through the PD router in test/disagg/test_pd_serving.py."""
import importlib
import os
import sys

import pytest
from servers import ROOT

pytestmark = pytest.mark.slow
sys.path.insert(0, os.path.join(ROOT, "python"))


def run_program(name, url):
    return importlib.import_module(name).main(url)


def test_qa_gen_honours_max_tokens_and_stop(live_server):
    out = run_program("qa_gen", live_server.url)
    assert out["answer"].strip() and "\n" not in out["answer"]
    assert out["landmark_tokens"] <= 6


def test_select_picks_a_choice(live_server):
    out = run_program("select_choice", live_server.url)
    assert out["city"] in out["choices"]
    assert out["city"] == "Paris"


def test_multi_turn_chat(live_server):
    out = run_program("multi_turn_chat", live_server.url)
    assert len(out["answers"]) == 2 and all(a.strip() for a in out["answers"])
    assert out["num_messages"] == 5


def test_fork_parallel(live_server):
    out = run_program("fork_parallel", live_server.url)
    assert set(out["examples"]) == {"fruit", "animal", "color"}
    assert all("." not in v and "\n" not in v for v in out["examples"].values())


def test_shared_prefix_fanout(live_server):
    out = run_program("shared_prefix_fanout", live_server.url)
    assert len(out["answers"]) == out["num_prompts"] and all("\n" not in a for a in out["answers"])
    assert max(out["cached_tokens"]) > 0, "the shared prefix should be served from the prefix cache"


def test_stream_gen(live_server):
    out = run_program("stream_gen", live_server.url)
    assert out["pieces"] > 1 and out["streamed"] == out["final"] and out["final"].strip()
