"""Scheduler process: entry point and main loop (server mode I/O over zmq)."""
from __future__ import annotations

import logging
import traceback

from sgl_kvxfer.config import ServerArgs
from sgl_kvxfer.message import BatchTokenIDOut
from sgl_kvxfer.message.queue import PullQueue, PushQueue, wait_readable
from sgl_kvxfer.utils.process import die_with_parent

logger = logging.getLogger("sgl_kvxfer.scheduler")


def run_scheduler_process(server_args: ServerArgs, ready_conn) -> None:
    """Load the model, ack on `ready_conn` with the scheduler's facts, then serve forever."""
    die_with_parent()
    logging.basicConfig(level=server_args.log_level.upper(), format="[scheduler] %(asctime)s %(levelname)s %(message)s")
    try:
        scheduler, info = build_scheduler(server_args)
        inbox = PullQueue(server_args.ipc_addr("scheduler_input"), "scheduler", bind=True)
        outbox = PushQueue(server_args.ipc_addr("detokenizer_input"))
    except Exception as exc:  # report start-up failures to the launcher instead of hanging it
        logger.error("scheduler failed to start:\n%s", traceback.format_exc())
        ready_conn.send({"status": "error", "error": f"{type(exc).__name__}: {exc}"})
        return
    ready_conn.send({"status": "ready", **info})
    event_loop(scheduler, inbox, outbox)


def build_scheduler(server_args: ServerArgs):
    from sgl_kvxfer.utils.triton_cpu import use_interpreter_on_cpu

    use_interpreter_on_cpu(server_args.scheduler.engine.resolved_device)  # before any kernel import
    from sgl_kvxfer.engine.model_runner import ModelRunner
    from sgl_kvxfer.models.loader import load_tokenizer, resolve_tokenizer_path
    from sgl_kvxfer.scheduler.scheduler import Scheduler

    from sgl_kvxfer.disagg import create_disagg_role
    from sgl_kvxfer.disagg.common import DisaggSettings

    cfg = server_args.scheduler
    runner = ModelRunner(cfg.engine, cfg.max_running_requests, cfg.max_prefill_tokens)
    tokenizer_path = resolve_tokenizer_path(runner.model_dir, cfg.engine.tokenizer_path)
    role = create_disagg_role(DisaggSettings.from_config(cfg), server_args.host)
    scheduler = Scheduler(cfg, runner, load_tokenizer(tokenizer_path), role=role)
    info = {
        "max_total_num_tokens": runner.max_total_tokens, "max_req_input_len": runner.context_len - 1,
        "context_len": runner.context_len, "vocab_size": runner.arch.vocab_size,
        "model_path": runner.model_dir, "tokenizer_path": tokenizer_path,
        "architectures": list(runner.arch.architectures), "model_type": runner.arch.model_type,
        "load_format": cfg.engine.load_format, "max_running_requests": runner.max_running_requests,
        "kv_bytes_per_token": runner.kv_pool.bytes_per_token(), "dtype": str(runner.dtype).replace("torch.", ""),
        "device": runner.device, "attention_backend": cfg.engine.resolved_attention_backend,
    }
    return scheduler, info


def event_loop(scheduler, inbox: PullQueue, outbox: PushQueue) -> None:
    """Receive, poll the PD role, schedule + forward, send results. What the role produced
    (a PD request's first token) goes out before the step's forward. When nothing ran, sleep on
    the sockets (the role's include the wake channel its sender thread signals): up to 1 s idle,
    5 ms while the role has work (its bootstrap lookups run in threads that signal nothing)."""
    sockets = [inbox] + scheduler.role.wake_sockets()

    def flush() -> bool:
        outputs = scheduler.take_outputs()
        if outputs:
            outbox.put(BatchTokenIDOut(outputs))
        return bool(outputs)

    while True:
        msgs = inbox.get_all_nowait()
        for msg in msgs:
            reply = scheduler.handle(msg)
            if reply is not None:
                outbox.put(reply)
        scheduler.poll_role()
        sent = flush()
        ran = scheduler.step()
        sent = flush() or sent
        if not ran and not msgs and not sent:
            wait_readable(sockets, 0.005 if scheduler.has_work() else 1.0)
