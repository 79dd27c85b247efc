"""`python -m sgl_kvxfer.launch_server` / `sgl-kvxfer-server`: the process diagram.

    launcher (this process: HTTP server + TokenizerManager, asyncio)
      ├── bootstrap    (PD prefill only, not with the fake backend: disagg/bootstrap_server.py on
      │                 --disaggregation-bootstrap-port; spawned first, the scheduler registers in it)
      ├── scheduler    (spawned; loads the model; ack = scheduler info dict)
      └── detokenizer  (spawned with the scheduler; sent its tokenizer_path after the scheduler ack)

    TokenizerManager ──scheduler_input──▶ scheduler ──detokenizer_input──▶ detokenizer
           ▲                                                                   │
           └─────────────────────────────tokenizer_input───────────────────────┘

Shutdown invariant: no orphans. The launcher terminates its children on any exit path
(SIGTERM, Ctrl-C, startup error); each child also dies with its parent (PR_SET_PDEATHSIG plus a
watchdog thread on the parent pid) in case the launcher is SIGKILLed. While serving, the first
SIGTERM / Ctrl-C drains the HTTP server first (server/shutdown.py: no new requests, in-flight ones
finish within --shutdown-grace-period-secs or end with a 503), a second one stops at once.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import sys
import threading
import time

from sgl_kvxfer import env
from sgl_kvxfer.config import ServerArgs
from sgl_kvxfer.server.flags import parse_server_args
from sgl_kvxfer.utils.process import die_with_parent

logger = logging.getLogger("sgl_kvxfer.launch_server")
STARTUP_TIMEOUT_S = env.STARTUP_TIMEOUT.get_float()


def _watch_parent(parent_pid: int) -> None:
    """Backstop for PR_SET_PDEATHSIG (which fires on the death of the parent *thread*)."""
    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _child_main(target, args, parent_pid: int) -> None:
    die_with_parent()
    _watch_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when children stop
    _no_semaphores()
    target(*args)


def _no_semaphores() -> None:
    """Hazard: a child stops by SIGTERM, so it never unlinks a multiprocessing semaphore it
    made, and the launcher's resource tracker warns of a "leaked semaphore" at exit. tqdm makes
    one for its default lock at its first bar (the first start's model conversion); a thread
    lock serves a process that shares no bar with another."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def _spawn(ctx, name: str, target, args, duplex: bool = False) -> tuple[mp.Process, object]:
    ours, theirs = ctx.Pipe(duplex=duplex)
    proc = ctx.Process(target=_child_main, args=(target, (*args, theirs), os.getpid()), name=name, daemon=False)
    proc.start()
    theirs.close()
    return proc, ours


def _wait_ack(name: str, proc: mp.Process, reader) -> dict:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if reader.poll(0.5):
            try:
                ack = reader.recv()
            except EOFError:
                break
            if ack.get("status") != "ready":
                raise RuntimeError(f"{name} failed to start: {ack.get('error')}")
            return ack
        if not proc.is_alive():
            break
    raise RuntimeError(f"{name} exited (code {proc.exitcode}) or timed out before it was ready")


def _terminate(procs: list[mp.Process]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            logger.warning("%s (pid %s) ignored SIGTERM; killing it", proc.name, proc.pid)
            proc.kill()
            proc.join(2.0)


def _watch_children(procs: list[mp.Process], stopping: threading.Event, crashed: threading.Event) -> None:
    """A dead scheduler or detokenizer would leave requests hanging: take the server down."""
    def watch():
        mp.connection.wait([p.sentinel for p in procs])
        if stopping.is_set():
            return
        crashed.set()
        dead = [f"{p.name} (exit {p.exitcode})" for p in procs if not p.is_alive()]
        logger.error("child process died: %s; shutting down", ", ".join(dead))
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="child-watchdog", daemon=True).start()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def launch_server(server_args: ServerArgs, scheduler_target=None, launch_command: str | None = None) -> None:
    owns_ipc_dir = server_args.ipc_dir is None
    server_args = server_args.with_ipc_dir()
    if scheduler_target is None:
        from sgl_kvxfer.scheduler.process import run_scheduler_process as scheduler_target
    from sgl_kvxfer.detokenizer.process import run_detokenizer_process

    signal.signal(signal.SIGTERM, _raise_interrupt)
    ctx = mp.get_context("spawn")
    procs: list[mp.Process] = []
    stopping, crashed = threading.Event(), threading.Event()
    try:
        cfg = server_args.scheduler
        if cfg.disaggregation_mode == "prefill" and cfg.disaggregation_transfer_backend != "fake":
            from sgl_kvxfer.disagg.bootstrap_server import run_bootstrap_server

            boot, boot_conn = _spawn(ctx, "bootstrap", run_bootstrap_server,
                                     (server_args.host, cfg.disaggregation_bootstrap_port, server_args.log_level))
            procs.append(boot)
            _wait_ack("bootstrap server", boot, boot_conn)
        sched, sched_conn = _spawn(ctx, "scheduler", scheduler_target, (server_args,))
        detok, detok_conn = _spawn(ctx, "detokenizer", run_detokenizer_process, (server_args,), duplex=True)
        procs += [sched, detok]
        _preload_http_modules()  # overlaps with the children's start-up
        info = _wait_ack("scheduler", sched, sched_conn)
        logger.info("scheduler ready: max_total_num_tokens=%s context_len=%s",
                    info.get("max_total_num_tokens"), info.get("context_len"))
        detok_conn.send(info.get("tokenizer_path"))
        tokenizer = _load_tokenizer(server_args, info)
        _wait_ack("detokenizer", detok, detok_conn)
        _watch_children(procs, stopping, crashed)
        _serve(server_args, info, tokenizer, launch_command, crashed)
    except KeyboardInterrupt:
        logger.info("shutting down")
    finally:
        stopping.set()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
        _terminate(procs)
        if owns_ipc_dir:
            shutil.rmtree(server_args.ipc_dir, ignore_errors=True)
    if crashed.is_set():
        sys.exit(1)


def _preload_http_modules() -> None:
    import transformers  # noqa: F401  (the tokenizer's; this process needs no torch)
    import uvicorn  # noqa: F401

    import sgl_kvxfer.server.app  # noqa: F401


def _load_tokenizer(server_args: ServerArgs, info: dict):
    if server_args.skip_tokenizer_init:
        return None
    from sgl_kvxfer.utils.tokenizer_loading import load_tokenizer

    return load_tokenizer(info["tokenizer_path"])


def _serve(server_args: ServerArgs, info: dict, tokenizer, launch_command: str | None,
           crashed: threading.Event) -> None:
    import uvicorn

    from sgl_kvxfer.server.app import create_app
    from sgl_kvxfer.server.http1 import Http1Protocol
    from sgl_kvxfer.server.shutdown import DrainingServer
    from sgl_kvxfer.tokenizer.manager import TokenizerManager

    tm = TokenizerManager(server_args, info, tokenizer)
    app = create_app(server_args, tm, launch_command)
    logger.info("serving on http://%s:%d", server_args.host, server_args.port)
    config = uvicorn.Config(app, host=server_args.host, port=server_args.port, log_level=server_args.log_level,
                            access_log=False, timeout_graceful_shutdown=3, http=Http1Protocol)
    DrainingServer(config, tm, server_args.shutdown_grace_period_secs, crashed.is_set).run()


def main(argv: list[str] | None = None, scheduler_target=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    server_args = parse_server_args(argv)
    logging.basicConfig(level=server_args.log_level.upper(), format="[%(name)s] %(asctime)s %(levelname)s %(message)s")
    try:
        launch_server(server_args, scheduler_target, launch_command="sgl-kvxfer-server " + " ".join(argv))
    except RuntimeError as e:  # a child failed to start; the cause is in its own log lines above
        logger.error("%s", e)
        sys.exit(1)


if __name__ == "__main__":
    main()
