"""Offline Engine: the same Scheduler in-process, with SGLang's offline `Engine` API.

    from sgl_kvxfer import Engine
    with Engine(model_path="smollm2-135m") as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
        print(out["text"], out["meta_info"]["finish_reason"])
"""
from __future__ import annotations

import gc
import time
import uuid
from typing import Any, Iterator

import torch

from sgl_kvxfer.config import ServerArgs
from sgl_kvxfer.message import ProfileReq, TokenizedGenerateReq
from sgl_kvxfer.sampling.params import SamplingParams


class Engine:
    def __init__(self, model_path: str | None = None, **server_args: Any):
        from sgl_kvxfer.utils.triton_cpu import use_interpreter_on_cpu

        self.server_args = ServerArgs.from_flat(model_path=model_path, **server_args)
        cfg = self.server_args.scheduler
        use_interpreter_on_cpu(cfg.engine.resolved_device)  # before the imports below load kernels
        from sgl_kvxfer.scheduler.scheduler import Scheduler
        from sgl_kvxfer.scheduler.startup import create_runner

        if cfg.disaggregation_mode != "null":
            raise ValueError("PD roles (disaggregation_mode prefill / decode) run in the server: "
                             "python -m sgl_kvxfer.launch_server --disaggregation-mode ...")
        self.runner, self.tokenizer, _ = create_runner(cfg)
        self.scheduler = Scheduler(cfg, self.runner, self.tokenizer)
        from sgl_kvxfer.detokenizer.byte_level import ByteLevelDecoder

        ByteLevelDecoder.of(self.tokenizer)  # build its table now, not on the first request
        from sgl_kvxfer.utils.host_runtime import has_host_compute, settle_scheduler_host

        self.host_runtime = settle_scheduler_host(self.runner.device, has_host_compute(self.scheduler))  # last: start-up objects exist

    # ------------------------------------------------------------------ public API
    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                 logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                 token_ids_logprob: list[int] | None = None, return_text_in_logprobs: bool = False,
                 stream: bool = False, rid: str | list[str] | None = None, **ignored: Any):
        """Returns one SGLang-shaped dict, or a list for a batch (or n > 1); with stream=True an
        iterator of cumulative dicts (single prompt only). Raises ValueError on bad input."""
        self._live()
        reqs, single = self._tokenize(prompt, input_ids, sampling_params, return_logprob,
                                      logprob_start_len, top_logprobs_num, token_ids_logprob, rid, stream)
        if stream:
            if len(reqs) != 1:
                raise ValueError("stream=True supports a single prompt with n=1")
            return self._stream(reqs[0], return_text_in_logprobs)
        results = list(self._run(reqs, return_text_in_logprobs, stream=False))[-1]
        return results[0] if single else results

    def flush_cache(self) -> bool:
        return self._live().flush_cache().success

    def start_profile(self, **fields: Any) -> None:
        """A torch.profiler capture of the scheduler's steps (SGLang's /start_profile fields:
        output_dir, num_steps, activities, with_stack, record_shapes, profile_id)."""
        ok, message = self._live().profiler.start(ProfileReq(start=True, **fields))
        if not ok:
            raise ValueError(message)

    def stop_profile(self) -> None:
        """Stop the capture and write `<output_dir>/<profile_id>-TP-0.trace.json.gz`."""
        ok, message = self._live().profiler.stop()
        if not ok:
            raise ValueError(message)

    def get_server_info(self) -> dict:
        import msgspec

        flat = {k: v for k, v in self.server_args.to_flat().items() if k not in ("api_key", "admin_api_key")}
        return {**flat, **msgspec.structs.asdict(self._live().internal_state())}

    def _live(self):
        if self.scheduler is None:
            raise RuntimeError("this Engine was shut down")
        return self.scheduler

    def shutdown(self) -> None:
        """Give back what the engine holds, even while the caller keeps this object: requests,
        the radix cache, the KV pool, CUDA graphs and weights; the CUDA caching allocator then
        returns the freed blocks to the device (another engine in this process can use them).
        Idempotent; `generate` afterwards raises."""
        if self.runner is None:
            return
        self.scheduler.profiler.close()  # a running capture writes its trace
        runner, self.scheduler, self.runner = self.runner, None, None
        runner.close()
        del runner
        from sgl_kvxfer.utils.host_runtime import release_scheduler_host

        release_scheduler_host(getattr(self, "host_runtime", None))  # frozen objects are never collected
        gc.collect()  # the model and graph runners hold reference cycles
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ------------------------------------------------------------------ internals
    def _tokenize(self, prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
                  top_logprobs_num, token_ids_logprob, rid, stream):
        """Every argument through tokenizer/validation.py (the server's rules and messages);
        ValueError (RequestError) before any request of the call is queued: all or nothing."""
        from sgl_kvxfer.tokenizer import validation as v

        if prompt is not None and input_ids is not None:
            raise v.RequestError("Give either `prompt` (text) or `input_ids`, not both.")
        if prompt is None and input_ids is None:
            raise v.RequestError("Either prompt (text) or input_ids should be provided.")
        vocab = self.runner.arch.vocab_size
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            ids_list = [self.tokenizer.encode(v.read_str(t, f"prompt[{i}]")) for i, t in enumerate(texts)]
        else:
            single = not input_ids or not isinstance(input_ids[0], list)
            ids_list = [list(input_ids)] if single else [list(x) for x in input_ids]
            for i, ids in enumerate(ids_list):
                v.check_prompt_ids(v.read_ints(ids, f"input_ids[{i}]"), vocab, f"input_ids[{i}]")
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(ids_list)
        if len(params_list) != len(ids_list):
            raise v.RequestError(f"got {len(params_list)} sampling_params for {len(ids_list)} prompts")
        rids = rid if isinstance(rid, list) else [rid] * len(ids_list)
        start = -1 if logprob_start_len is None else v.read_int(logprob_start_len, "logprob_start_len")
        top = 0 if top_logprobs_num is None else v.read_int(top_logprobs_num, "top_logprobs_num")
        if token_ids_logprob is not None:
            v.read_ints(token_ids_logprob, "token_ids_logprob")
        v.check_logprob_args(top, token_ids_logprob, start, vocab)
        parsed: dict[int, SamplingParams] = {}  # one check per distinct dict (a batch often shares one)
        reqs = []
        for ids, raw, r in zip(ids_list, params_list, rids):
            params = parsed.get(id(raw))
            if params is None:
                params = parsed[id(raw)] = v.sampling_params(raw, vocab)
            for _ in range(params.n):
                msg = TokenizedGenerateReq(
                    rid=r if (r and params.n == 1) else uuid.uuid4().hex, input_ids=ids, sampling=params,
                    return_logprob=bool(return_logprob), logprob_start_len=start, top_logprobs_num=top,
                    token_ids_logprob=token_ids_logprob, stream=stream)
                error = self.scheduler.validate(msg)
                if error:
                    raise v.RequestError(error)
                reqs.append(self.scheduler.new_req(msg))
        return reqs, single and len(reqs) == 1

    def _stream(self, req, return_text_in_logprobs) -> Iterator[dict]:
        for results in self._run([req], return_text_in_logprobs, stream=True):
            yield results[0]

    def _run(self, reqs, return_text_in_logprobs, stream: bool):
        """Queue validated requests and step the scheduler until all finish. Not streamed, a
        request's ids arrive once, with its finish, and every request finishing in one step is
        rendered by one batched decode (render_finished)."""
        from sgl_kvxfer.detokenizer.incremental import IncrementalDetokenizer, render_finished
        from sgl_kvxfer.tokenizer.output_state import RequestOutputState

        start = time.perf_counter()
        states, detoks, done = {}, {}, set()
        for r in reqs:
            states[r.rid] = RequestOutputState(r.rid, self.tokenizer, r.return_logprob, return_text_in_logprobs,
                                               r.top_logprobs_num, r.token_ids_logprob)
            detoks[r.rid] = IncrementalDetokenizer(self.tokenizer, r.sampling.skip_special_tokens,
                                                   r.sampling.spaces_between_special_tokens)
            self.scheduler.enqueue_validated(r)
        while len(done) < len(reqs):
            if not self.scheduler.step() and not self.scheduler.outbox:
                raise RuntimeError("scheduler is idle but requests are unfinished")
            outputs = self.scheduler.take_outputs()
            at_once, incremental = [], []
            for out in outputs:
                whole = not stream and out.finish_reason is not None and not detoks[out.rid].output_ids
                (at_once if whole else incremental).append(out)
            for out in incremental:
                text = detoks[out.rid].append(out.new_output_ids)
                if out.finish_reason is not None:
                    text = detoks[out.rid].finish(out.finish_reason, out.no_stop_trim)
                    done.add(out.rid)
                states[out.rid].add(out, text)
            for out, text in zip(at_once, render_finished(self.tokenizer, at_once)):
                done.add(out.rid)
                states[out.rid].add(out, text)
            if stream and outputs:
                latency = time.perf_counter() - start
                yield [states[r.rid].to_dict(latency if r.rid in done else None) for r in reqs]
        if not stream:
            latency = time.perf_counter() - start
            yield [states[r.rid].to_dict(latency) for r in reqs]
