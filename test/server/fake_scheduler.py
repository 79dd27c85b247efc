"""A model-free stand-in for the scheduler process, for fast HTTP-layer tests.

Speaks the real message protocol. Output token k of a request is input_ids[k % len(input_ids)]
(so greedy text is predictable), every logprob is -0.5, and one token per request is produced
every `TICK` seconds. KV usage is the sum of prompt+output lengths of live requests.
"""
from __future__ import annotations

import time

from sgl_kvxfer.message import (AbortReq, BatchTokenIDOut, FlushCacheReq, FlushCacheResult, GetInternalStateReq,
                                InternalState, ProfileReq, ProfileResult, ReqOutput, TokenizedGenerateReq)
from sgl_kvxfer.message.queue import PullQueue, PushQueue
from sgl_kvxfer.scheduler.profiler import SchedulerProfiler

TICK = 0.005
CONTEXT = 2048


def _output(req, new_ids, done, finish=None, first=False):
    lp_in = None
    if req.return_logprob and first:
        start = max(req.logprob_start_len, 0) if req.logprob_start_len >= 0 else len(req.input_ids)
        lp_in = [[None if i == start else -0.5, t] for i, t in enumerate(req.input_ids) if i >= start]
    return ReqOutput(
        rid=req.rid, new_output_ids=new_ids, finish_reason=finish, prompt_tokens=len(req.input_ids),
        completion_tokens=done, cached_tokens=0, skip_special_tokens=req.sampling.skip_special_tokens,
        no_stop_trim=req.sampling.no_stop_trim,
        input_token_logprobs=lp_in if req.return_logprob else None,
        output_token_logprobs=[[-0.5, t] for t in new_ids] if req.return_logprob else None)


def run_fake_scheduler(server_args, ready_conn):
    inbox = PullQueue(server_args.ipc_addr("scheduler_input"), "scheduler", bind=True)
    outbox = PushQueue(server_args.ipc_addr("detokenizer_input"))
    from sgl_kvxfer.models.loader import resolve_model_path

    path = resolve_model_path(server_args.engine.model_path)
    ready_conn.send({"status": "ready", "max_total_num_tokens": 4096, "max_req_input_len": CONTEXT - 1,
                     "context_len": CONTEXT, "vocab_size": 49152, "model_path": path, "tokenizer_path": path,
                     "architectures": ["LlamaForCausalLM"], "model_type": "llama", "load_format": "auto"})
    live: dict[str, list] = {}  # rid -> [req, produced]
    profiler = SchedulerProfiler()  # the real one: a tick that produced tokens counts as a forward step
    while True:
        msgs = inbox.get_all_nowait() or ([m] if (m := inbox.get(timeout=TICK if live else 0.5)) else [])
        outs = []
        for msg in msgs:
            if isinstance(msg, TokenizedGenerateReq):
                if msg.sampling.max_new_tokens == 0:
                    outs.append(_output(msg, [], 0, {"type": "length", "length": 0}, first=True))
                else:
                    live[msg.rid] = [msg, 0]
            elif isinstance(msg, AbortReq):
                for rid in list(live) if msg.abort_all else [msg.rid]:
                    if rid in live:
                        req, done = live.pop(rid)
                        outs.append(_output(req, [], done, {"type": "abort", "message": "Abort", "status_code": None}))
            elif isinstance(msg, GetInternalStateReq):
                used = sum(len(r.input_ids) + d for r, d in live.values())
                outbox.put(InternalState(max_total_num_tokens=4096, max_req_input_len=CONTEXT - 1,
                                         num_running_reqs=len(live), num_queue_reqs=0, kv_used_tokens=used,
                                         kv_cached_tokens=0, kv_bytes_per_token=1.0, last_gen_throughput=0.0,
                                         cache_hit_rate=0.0))
            elif isinstance(msg, FlushCacheReq):
                outbox.put(FlushCacheResult(success=not live, message="" if not live else "requests running"))
            elif isinstance(msg, ProfileReq):
                outbox.put(ProfileResult(*(profiler.start(msg) if msg.start else profiler.stop())))
        profiler.after_step(bool(live))
        for rid, entry in list(live.items()):
            req, done = entry
            tok = req.input_ids[done % len(req.input_ids)]
            entry[1] = done = done + 1
            finish = {"type": "length", "length": done} if done >= req.sampling.max_new_tokens else None
            outs.append(_output(req, [tok], done, finish, first=done == 1))
            if finish:
                del live[rid]
        if outs:
            outbox.put(BatchTokenIDOut(outs))
        time.sleep(TICK)
