"""Server-side pure-Python pieces: incremental detokenization, output accumulation, /generate
parsing, launcher flags. No server, no model weights (tokenizer only)."""
import pytest

from sgl_kvxfer.detokenizer.incremental import IncrementalDetokenizer
from sgl_kvxfer.message import ReqOutput
from sgl_kvxfer.server.flags import parse_server_args
from sgl_kvxfer.tokenizer.generate_input import ContractError, RequestError, parse_generate_request
from sgl_kvxfer.tokenizer.output_state import RequestOutputState


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from sgl_kvxfer.models.loader import load_tokenizer

    return load_tokenizer(smollm2_path)


TEXTS = ["Hello, world! The quick brown fox.", "héllo wörld — 你好，世界 🙂🚀 done", "  leading spaces\n\nand\ttabs"]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_matches_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tokenizer)
    seen = []
    for t in ids:
        seen.append(det.append([t]))
    assert all("\ufffd" not in s for s in seen), "incomplete UTF-8 must be held back"
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:])), "streamed text only grows"
    assert det.finish(None, False) == tokenizer.decode(ids)


def test_finish_trims_stop_string_and_stop_token(tokenizer):
    ids = tokenizer.encode("The answer is 42. END of text", add_special_tokens=False)
    det = IncrementalDetokenizer(tokenizer)
    det.append(ids)
    assert det.finish({"type": "stop", "matched": " END"}, no_stop_trim=False) == "The answer is 42."
    det = IncrementalDetokenizer(tokenizer)
    det.append(ids)
    assert det.finish({"type": "stop", "matched": " END"}, no_stop_trim=True).endswith("END of text")
    eos = tokenizer.eos_token_id
    det = IncrementalDetokenizer(tokenizer)
    det.append(ids[:3] + [eos])
    assert det.finish({"type": "stop", "matched": eos}, False) == tokenizer.decode(ids[:3])
    # A non-special stop token id is not rendered either.
    det = IncrementalDetokenizer(tokenizer)
    det.append(ids[:4])
    assert det.finish({"type": "stop", "matched": ids[3]}, False) == tokenizer.decode(ids[:3])


def test_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert tokenizer.eos_token in kept.append(ids)
    assert IncrementalDetokenizer(tokenizer).append(ids) == "hi"


def _out(rid, ids, done, finish=None, lp=None, lp_in=None):
    return ReqOutput(rid=rid, new_output_ids=ids, finish_reason=finish, prompt_tokens=3, completion_tokens=done,
                     cached_tokens=1, output_token_logprobs=lp, input_token_logprobs=lp_in)


def test_output_state_shape(tokenizer):
    st = RequestOutputState("r1", tokenizer, True, True, 0, None)
    st.add(_out("r1", [28], 1, lp=[[-0.1, 28]], lp_in=[[None, 19556], [-2.0, 905]]), ",")
    mid = st.to_dict()
    assert mid["meta_info"]["finish_reason"] is None and "e2e_latency" not in mid["meta_info"]
    st.add(_out("r1", [905], 2, {"type": "length", "length": 2}, lp=[[-0.2, 905]]), ", world")
    d = st.to_dict(0.5)
    assert d["text"] == ", world" and d["output_ids"] == [28, 905]
    m = d["meta_info"]
    assert m["id"] == "r1" and m["completion_tokens"] == 2 and m["cached_tokens"] == 1 and m["prompt_tokens"] == 3
    assert m["reasoning_tokens"] == 0 and m["weight_version"] == "default" and m["e2e_latency"] == 0.5
    assert m["input_token_logprobs"][0] == [None, 19556, tokenizer.decode([19556])]
    assert m["output_token_logprobs"] == [[-0.1, 28, ","], [-0.2, 905, " world"]]
    assert m["output_token_logprobs_length"] == 2
    assert "input_top_logprobs" not in m
    assert mid["output_ids"] == [28], "snapshots are copies"


def test_parse_batch_and_n():
    req = parse_generate_request({"text": ["a", "b"], "sampling_params": {"n": 2, "max_new_tokens": 3}, "x": 1})
    assert req.is_batch and len(req.items) == 4 and [i.text for i in req.items] == ["a", "a", "b", "b"]
    assert len({i.rid for i in req.items}) == 4 and all(i.sampling.n == 1 for i in req.items)
    single = parse_generate_request({"input_ids": [1, 2, 3], "rid": "abc"})
    assert not single.is_batch and single.items[0].rid == "abc" and single.items[0].input_ids == [1, 2, 3]


@pytest.mark.parametrize("body,kind", [
    ({"text": "a", "sampling_params": {"bogus": 1}}, ContractError),
    ({"text": "a", "sampling_params": {"max_new_tokens": "5"}}, ContractError),
    ({"text": 3}, ContractError),
    ({"text": "a", "stream": "yes"}, ContractError),
    ({"input_ids": [1, "x"]}, ContractError),
    ([1, 2], ContractError),
    ({}, RequestError),
    ({"input_ids": []}, RequestError),
    ({"text": "a", "sampling_params": {"temperature": -1}}, RequestError),
    ({"text": "a", "sampling_params": {"top_p": 0}}, RequestError),
    ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, RequestError),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, RequestError),
    ({"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]}, RequestError),
])
def test_parse_errors(body, kind):
    with pytest.raises(kind):
        parse_generate_request(body)


def test_flags():
    args = parse_server_args(["--model", "smollm2-135m", "--tp-size", "1", "--trust-remote-code", "--port", "1234"])
    assert args.engine.model_path == "smollm2-135m" and args.port == 1234
    for bad in (["--tp-size", "2"], ["--speculative-algorithm", "EAGLE"], ["--enable-lora"], ["--no-such-flag"]):
        with pytest.raises(SystemExit):
            parse_server_args(bad)


def test_served_model_name():
    """SGLang's --served-model-name; without it the name is --model-path as given, or the
    embedded default's name, never the cache folder the model was converted into."""
    assert parse_server_args([]).resolved_served_model_name == "smollm2-135m"
    assert parse_server_args(["--model-path", "/m/llama"]).resolved_served_model_name == "/m/llama"
    named = parse_server_args(["--model-path", "/m/llama", "--served-model-name", "my-model"])
    assert named.resolved_served_model_name == "my-model"
    for bad in ("", " x", "x" * 257, "a\nb", "\x00"):
        with pytest.raises(SystemExit):
            parse_server_args(["--served-model-name", bad])


def test_socket_folder_fits_a_socket_path_under_a_deep_temp_dir(tmp_path, monkeypatch):
    """The ipc:// sockets go in a fresh temp folder; where TMPDIR is too deep for a Unix socket's
    path (pytest's per-test folders under xdist were), in /tmp. A bound socket proves the fit."""
    import os
    import tempfile

    import zmq

    from sgl_kvxfer.config import IPC_LINKS, IPC_PATH_MAX, ServerArgs, ipc_dir_fits

    deep = tmp_path / ("d" * 60) / ("e" * 30)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    assert not ipc_dir_fits(os.path.join(str(deep), "sgl_kvxfer_ipc_12345678"))
    args = ServerArgs().with_ipc_dir()
    try:
        assert args.ipc_dir.startswith("/tmp/sgl_kvxfer_ipc_") and ipc_dir_fits(args.ipc_dir)
        ctx = zmq.Context.instance()
        for link in IPC_LINKS:
            sock = ctx.socket(zmq.PULL)
            sock.bind(args.ipc_addr(link))
            sock.close(linger=0)
    finally:
        import shutil

        shutil.rmtree(args.ipc_dir, ignore_errors=True)
    with pytest.raises(ValueError, match="too long for a socket path"):  # an explicit one: refused up front
        ServerArgs(ipc_dir="/" + "x" * IPC_PATH_MAX)


def _finished(ids, finish, no_stop_trim=False, skip_special=True, spaces=True):
    return ReqOutput(rid="r", new_output_ids=ids, finish_reason=finish, prompt_tokens=1, completion_tokens=len(ids),
                     cached_tokens=0, skip_special_tokens=skip_special, spaces_between_special_tokens=spaces,
                     no_stop_trim=no_stop_trim)


def test_render_finished_equals_append_then_finish(tokenizer):
    """The batched render of unstreamed finishes gives each request the text the incremental
    detokenizer gives it: stop strings, stop tokens, no_stop_trim, special tokens, split UTF-8."""
    from sgl_kvxfer.detokenizer.incremental import render_finished

    eos = tokenizer.eos_token_id
    words = tokenizer.encode("The answer is 42. END of text", add_special_tokens=False)
    emoji = tokenizer.encode("ok 🙂🚀", add_special_tokens=False)
    cases = [
        _finished(words, {"type": "length", "length": len(words)}),
        _finished(words, {"type": "stop", "matched": " END"}),
        _finished(words, {"type": "stop", "matched": " END"}, no_stop_trim=True),
        _finished(words[:3] + [eos], {"type": "stop", "matched": eos}),
        _finished(words[:3] + [eos], {"type": "stop", "matched": eos}, skip_special=False),
        _finished(words[:3] + [eos], {"type": "stop", "matched": eos}, no_stop_trim=True, skip_special=False),
        _finished(words[:4], {"type": "stop", "matched": words[3]}),
        _finished(emoji[:-1], {"type": "length", "length": len(emoji) - 1}),  # ends mid-character
        _finished([], {"type": "abort", "message": "x"}),
        _finished(words + [eos] + words, {"type": "length", "length": 9}, spaces=False, skip_special=False),
    ]
    expected = []
    for out in cases:
        det = IncrementalDetokenizer(tokenizer, out.skip_special_tokens, out.spaces_between_special_tokens)
        det.append(out.new_output_ids)
        expected.append(det.finish(out.finish_reason, out.no_stop_trim))
    assert render_finished(tokenizer, cases) == expected
    assert expected[1] == "The answer is 42." and tokenizer.eos_token in expected[5]


def test_detokenizer_manager_renders_streamed_and_unstreamed_alike(tokenizer):
    from sgl_kvxfer.detokenizer.process import DetokenizerManager
    from sgl_kvxfer.message import BatchTokenIDOut

    ids = tokenizer.encode("héllo wörld — 你好 🙂 done", add_special_tokens=False)
    manager = DetokenizerManager(tokenizer)
    first = _finished(ids[:4], None)
    first.rid = "streamed"
    manager.handle(BatchTokenIDOut([first]))
    rest = _finished(ids[4:], {"type": "length", "length": len(ids)})
    rest.rid = "streamed"
    whole = _finished(ids, {"type": "length", "length": len(ids)})
    whole.rid = "whole"
    texts = manager.handle(BatchTokenIDOut([rest, whole])).texts
    assert texts == [tokenizer.decode(ids), tokenizer.decode(ids)]
    assert manager._states == {}


def test_byte_level_table_decodes_like_the_backend(tokenizer):
    """The table-driven decode (detokenizer/byte_level.py) equals the Rust decode on random ids:
    split multi-byte characters, special tokens kept and skipped, ids past the vocabulary."""
    import random

    from sgl_kvxfer.detokenizer.byte_level import ByteLevelDecoder

    fast, backend = ByteLevelDecoder.of(tokenizer), tokenizer.backend_tokenizer
    assert fast is not None and ByteLevelDecoder.of(tokenizer) is fast  # built once per tokenizer
    n = backend.get_vocab_size(with_added_tokens=True)
    rng = random.Random(0)
    seqs = [[rng.randrange(n) for _ in range(rng.randrange(0, 64))] for _ in range(400)]
    seqs += [[rng.choice([0, 1, 2, 17, n - 1, n + 5, rng.randrange(n)]) for _ in range(12)] for _ in range(100)]
    seqs += [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    seqs += [s[:k] for s in seqs[-3:] for k in range(len(s))]  # every prefix: characters cut mid-way
    for skip in (True, False):
        got = [fast.decode(s, skip) for s in seqs]
        assert got == [backend.decode(s, skip_special_tokens=skip) for s in seqs]
    assert any("\ufffd" in g for g in got) and any(tokenizer.eos_token in g for g in got)


def test_a_server_child_stopped_by_sigterm_leaks_no_semaphore(tmp_path):
    """A child of the launcher that drew a tqdm bar (the first start's conversion) and is then
    stopped by SIGTERM leaves no semaphore for the resource tracker to warn about."""
    import subprocess
    import sys

    script = tmp_path / "child.py"
    script.write_text(
        "import multiprocessing as mp, os, signal\n"
        "from sgl_kvxfer.launch_server import _child_main\n"
        "def work():\n"
        "    from tqdm.auto import tqdm\n"
        "    with tqdm(total=2, disable=False) as bar:\n"
        "        bar.update(1)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "if __name__ == '__main__':\n"
        "    p = mp.get_context('spawn').Process(target=_child_main, args=(work, (), os.getpid()))\n"
        "    p.start(); p.join()\n"
        "    print('exit', p.exitcode)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert "exit -15" in out.stdout, out.stdout + out.stderr
    assert "leaked semaphore" not in out.stderr, out.stderr
