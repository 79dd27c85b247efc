"""Under SpectrumKV tiering a prompt's streamed first token leaves before the prompt's re-tier
(Scheduler.send_early, OutcomesMixin._send_first_tokens): the re-tier is host bookkeeping the
token does not depend on. Checked on CPU through the scheduler: the order of the send and the
re-tier, no token sent twice, and what stays with the outbox (a request that ends at its first
token, an unstreamed one, a server with no early sender)."""
import pytest

from sgl_kvxfer.config import EngineConfig, SchedulerConfig
from sgl_kvxfer.message import TokenizedGenerateReq
from sgl_kvxfer.sampling.params import SamplingParams


def make_scheduler(model_dir, budget=0.3):
    from sgl_kvxfer.scheduler.scheduler import Scheduler
    from sgl_kvxfer.scheduler.startup import create_runner

    cfg = SchedulerConfig(engine=EngineConfig(model_path=model_dir, load_format="dummy", device="cpu",
                                              max_total_tokens=4096, kv_tier_budget=budget, kv_int4="on",
                                              attention_backend="torch"),
                          chunked_prefill_size=64, max_running_requests=4)
    runner, _, _ = create_runner(cfg)
    return Scheduler(cfg, runner, None)


def submit(sched, rid, n, new_tokens, stream=True):
    sched.handle(TokenizedGenerateReq(rid=rid, input_ids=[(11 * i) % 400 + 20 for i in range(n)], stream=stream,
                                      sampling=SamplingParams.from_dict({"max_new_tokens": new_tokens,
                                                                         "temperature": 0, "ignore_eos": True})))


def run(sched, log, steps=40):
    outputs = []
    for _ in range(steps):
        sched.step()
        taken = sched.take_outputs()
        if taken:
            log.append(("outbox", [(o.rid, list(o.new_output_ids)) for o in taken]))
        outputs += taken
        if not sched.running and not sched.waiting and sched.chunked is None:
            break
    return outputs


def test_a_streamed_first_token_leaves_before_the_retier(tiny_preset_dir):
    sched = make_scheduler(tiny_preset_dir)
    log = []
    sched.send_early = lambda outs: log.append(("early", [(o.rid, list(o.new_output_ids)) for o in outs]))
    retier = sched.tiering.after_forward

    def watched(batch, chunked):
        log.append(("after_forward", [s.req.rid for s in batch.slices if s.sample]))
        retier(batch, chunked)

    sched.tiering.after_forward = watched
    submit(sched, "long", 150, 4)  # three chunks of 64
    submit(sched, "one", 40, 1)  # ends at its first token: its output follows its KV into the cache
    submit(sched, "quiet", 40, 3, stream=False)
    run(sched, log)
    early = [e for e in log if e[0] == "early"]
    assert len(early) == 1 and [rid for rid, _ in early[0][1]] == ["long"]
    assert len(early[0][1][0][1]) == 1  # the first token alone
    i = log.index(early[0])
    assert log[i + 1][0] == "after_forward" and "long" in log[i + 1][1]  # the re-tier came after the send
    sent = [tok for kind, outs in log if kind in ("early", "outbox") for rid, toks in outs if rid == "long" for tok in toks]
    assert len(sent) == 4  # every token once: the outbox did not repeat the first
    for rid, n in (("one", 1), ("quiet", 3)):
        assert sum(len(toks) for kind, outs in log if kind == "outbox" for r, toks in outs if r == rid) == n
    assert sched.tiering.records  # the prompts were re-tiered


@pytest.mark.parametrize("budget", [1.0, 0.3])
def test_no_early_send_without_a_sender_or_without_tiering(tiny_preset_dir, budget):
    """The offline engine (no sender) and an untiered server (nothing to wait for) send every
    token through the outbox, each once."""
    sched = make_scheduler(tiny_preset_dir, budget)
    if budget == 1.0:
        assert sched.tiering is None
        sched.send_early = lambda outs: pytest.fail("an untiered server sends through the outbox")
    else:
        assert sched.send_early is None
    submit(sched, "a", 100, 3)
    outs = run(sched, [])
    assert sum(len(o.new_output_ids) for o in outs if o.rid == "a") == 3


def test_a_pd_prefill_sends_early_only_what_it_does_not_transfer(tiny_preset_dir, monkeypatch):
    """On a PD prefill server the tokens of a request whose KV leaves reach the client from the
    decode: only a request with no peer (its own) is streamed from here."""
    from types import SimpleNamespace as NS

    import sgl_kvxfer.scheduler.outcomes as outcomes

    sched = make_scheduler(tiny_preset_dir)
    sent = []
    sched.send_early = sent.extend
    sched._role_prefill = True
    sched.role = NS(transfers=lambda req: req.rid == "pd")
    monkeypatch.setattr(outcomes, "make_output", lambda req: req.rid)
    reqs = [NS(rid=rid, stream=True, finished_reason=None, output_ids=[5], sent_output_len=0,
               sampling=NS(stream_interval=None)) for rid in ("pd", "own")]
    sched._send_first_tokens(NS(slices=[NS(req=r, sample=True) for r in reqs]), 1)
    assert sent == ["own"]
