"""Scheduler process: entry point and main loop (server mode I/O over zmq)."""
from __future__ import annotations

import functools
import logging
import os
import signal
import traceback

from sgl_kvxfer.config import ServerArgs
from sgl_kvxfer.message import BatchTokenIDOut, ReqOutput
from sgl_kvxfer.message.queue import PullQueue, PushQueue, wait_readable
from sgl_kvxfer.utils.process import die_with_parent

logger = logging.getLogger("sgl_kvxfer.scheduler")


def run_scheduler_process(server_args: ServerArgs, ready_conn) -> None:
    """Load the model, ack on `ready_conn` with the scheduler's facts, then serve forever."""
    die_with_parent()
    logging.basicConfig(level=server_args.log_level.upper(), format="[scheduler] %(asctime)s %(levelname)s %(message)s")
    try:
        scheduler, info = build_scheduler(server_args)
        from sgl_kvxfer.utils.host_runtime import has_host_compute, settle_scheduler_host

        info["host_runtime"] = settle_scheduler_host(scheduler.runner.device, has_host_compute(scheduler))  # last: start-up objects exist
        inbox = PullQueue(server_args.ipc_addr("scheduler_input"), "scheduler", bind=True)
        outbox = PushQueue(server_args.ipc_addr("detokenizer_input"))
    except Exception as exc:  # report start-up failures to the launcher instead of hanging it
        logger.error("scheduler failed to start:\n%s", traceback.format_exc())
        ready_conn.send({"status": "error", "error": f"{type(exc).__name__}: {exc}"})
        return
    ready_conn.send({"status": "ready", **info})
    signal.signal(signal.SIGTERM, functools.partial(_write_profile_then_die, scheduler))
    event_loop(scheduler, inbox, outbox)


def _write_profile_then_die(scheduler, signum, frame) -> None:
    """SIGTERM (the launcher's stop): a running /start_profile capture writes its trace, then
    the process dies by SIGTERM as it would without this handler.
    Hazard: the launcher SIGKILLs a child still alive 5 s after SIGTERM; a longer export leaves
    only its temporary file (the trace's final name is written by rename, never half)."""
    try:
        scheduler.profiler.close()
    except Exception:  # noqa: BLE001 (the process must die either way)
        logger.exception("scheduler: the running profile could not be written at shutdown")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def build_scheduler(server_args: ServerArgs):
    from sgl_kvxfer.utils.triton_cpu import use_interpreter_on_cpu

    use_interpreter_on_cpu(server_args.scheduler.engine.resolved_device)  # before any kernel import
    from sgl_kvxfer.scheduler.scheduler import Scheduler
    from sgl_kvxfer.scheduler.startup import create_runner

    from sgl_kvxfer.disagg import create_disagg_role
    from sgl_kvxfer.disagg.common import DisaggSettings

    cfg = server_args.scheduler
    runner, tokenizer, tokenizer_path = create_runner(cfg)
    role = create_disagg_role(DisaggSettings.from_config(cfg), server_args.host)
    scheduler = Scheduler(cfg, runner, tokenizer, role=role)
    info = {
        "max_total_num_tokens": runner.max_total_tokens, "max_req_input_len": runner.context_len - 1,
        "context_len": runner.context_len, "vocab_size": runner.arch.vocab_size,
        "model_path": runner.model_dir, "tokenizer_path": tokenizer_path,
        "architectures": list(runner.arch.architectures), "model_type": runner.arch.model_type,
        "load_format": cfg.engine.load_format, "max_running_requests": runner.max_running_requests,
        "kv_bytes_per_token": runner.kv_pool.bytes_per_token(), "dtype": str(runner.dtype).replace("torch.", ""),
        "device": runner.device, "attention_backend": cfg.engine.resolved_attention_backend,
        "chunked_prefill_size": cfg.resolved_chunked_prefill_size or -1,
    }
    return scheduler, info


def event_loop(scheduler, inbox: PullQueue, outbox: PushQueue) -> None:
    """Receive, poll the PD role, schedule + forward, send results. What the role produced
    (a PD request's first token) goes out before the step's forward; under tiering a prompt's
    streamed first token goes out during the step, before its re-tier (`Scheduler.send_early`). When nothing ran, sleep on
    the sockets (the role's include the wake channel its sender thread signals): up to 1 s idle,
    5 ms while the role has work (its bootstrap lookups run in threads that signal nothing).
    No message and no request stops the loop: `step` and `poll_role` contain a failure
    (Scheduler._recover), a message that raises is logged, and an output that cannot be sent
    ends its request with a 500."""
    sockets = [inbox] + scheduler.role.wake_sockets()
    scheduler.send_early = functools.partial(send_outputs, outbox)  # (a tiered prompt's first token)

    def flush() -> bool:
        outputs = scheduler.take_outputs()
        if outputs:
            send_outputs(outbox, outputs)
        return bool(outputs)

    while True:
        msgs = inbox.get_all_nowait()
        for msg in msgs:
            try:
                reply = scheduler.handle(msg)
            except Exception:  # noqa: BLE001
                logger.exception("scheduler: %s failed", type(msg).__name__)
                continue
            if reply is not None:
                outbox.put(reply)
        scheduler.poll_role()
        sent = flush()
        ran = scheduler.step()
        sent = flush() or sent
        if not ran and not msgs and not sent:
            wait_readable(sockets, 0.005 if scheduler.has_work() else 1.0)


def send_outputs(outbox: PushQueue, outputs: list[ReqOutput]) -> None:
    """One message for the batch; if it cannot be encoded, each output alone, and an output
    that still cannot be is replaced by its request's 500 (its waiter must not hang)."""
    try:
        outbox.put(BatchTokenIDOut(outputs))
        return
    except Exception:  # noqa: BLE001
        logger.exception("scheduler: a batch of outputs could not be sent; sending them one by one")
    for out in outputs:
        try:
            outbox.put(BatchTokenIDOut([out]))
        except Exception as e:  # noqa: BLE001
            outbox.put(BatchTokenIDOut([ReqOutput(
                rid=out.rid, new_output_ids=[], prompt_tokens=out.prompt_tokens, completion_tokens=0,
                cached_tokens=0, finish_reason={"type": "abort", "status_code": 500, "err_type": "InternalServerError",
                                                "message": f"Internal server error: output not sendable: {e}"})]))
