"""The scheduler's PD role: the one base class whose hooks the Scheduler calls, and nothing else.

A role is built before the Scheduler (`create_disagg_role`), handed to its constructor, and
started there with a `RoleContext`: the engine pieces it reads and writes (pool, req-to-token
table, KV lifecycle, tiering) and the four ways it may act on the scheduler's queues. It never
holds the Scheduler itself.

    Scheduler.__init__      role.start(ctx)            once, after the pool and tiering exist
    Scheduler.handle        role.on_new_request(req)   True: the role took the request
                            role.abort(rid, all)       requests the role holds
                            role.set_link(rate, lat, ...)   POST /kv_transfer_link
    Scheduler.step          role.poll()                first, every iteration
                            role.before_forward(b, fb) EXTEND batches, before the forward
                            role.after_launch(batch)   EXTEND batches, right after the launch
                            role.after_forward(batch)  every batch, results applied, before tiering
    Scheduler._after_batch  role.on_chunk(req, a, b)   a prefill chunk [a, b) of req finished
                            role.on_prompt_done(req)   True: req waits in the role (prefill)
    event loop              role.has_work()            keep the loop turning
                            role.wake_sockets()        sockets that end its idle wait
    /server_info            role.server_info()         its counters (None: nothing to show)
    shutdown                role.close()               threads, sockets, the peer monitor

Peer liveness (disagg/peers.py), for roles with remote peers: `start` sets `self.monitor`, `poll`
calls `check_peers(now)`, which probes the peers `watched_peers()` names and hands each one
seen dead to `on_peer_dead(peer, reason)`, which fails that peer's rooms at once.

`intercepts_prefill` is False for roles whose on_chunk / on_prompt_done do nothing, so the
scheduler's per-slice loop skips them. Every hook runs on the scheduler thread.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from sgl_kvxfer.disagg.peers import Peer


@dataclass(frozen=True)
class RoleContext:
    """What a started role may touch. `runner` is read for the model, device and pool;
    `kv` (KVLifecycle) is the only way to allocate or free KV; the callables are the only ways
    to move a request between the role and the scheduler's queues."""
    runner: Any
    kv: Any
    tiering: Any  # EngineTiering or None (kv_tier_budget 1.0)
    retire: Callable  # retire(req): end a request the role holds (its KV goes to the cache)
    requeue: Callable  # requeue(req): prefill it here after all (validated already)
    admit: Callable  # admit(req): join the running batch with its prompt KV in place
    has_seat: Callable  # has_seat() -> bool: the running batch has room for one more

    @property
    def pool(self):
        return self.runner.kv_pool

    @property
    def table(self):
        return self.runner.req_to_token


class PDRole:
    """No disaggregation: every hook does nothing. PD roles override what they need."""

    mode = "null"
    intercepts_prefill = False
    monitor = None  # PeerMonitor of a role with remote peers (set in start)
    peer_kind = "peer"  # how a dead peer is named in its rooms' failure reason

    def start(self, ctx: RoleContext) -> None:
        self.ctx = ctx

    def on_new_request(self, req) -> bool:
        return False

    def abort(self, rid: str, abort_all: bool) -> None:
        pass

    def set_link(self, rate_gbps: float, latency_ms: float, stream: str | None = None,
                 trace: bool | None = None, last_chunk: int | None = None) -> tuple[bool, str]:
        return False, "not a prefill server (--disaggregation-mode prefill)"

    def poll(self) -> None:
        pass

    def before_forward(self, batch, fb) -> None:
        pass

    def after_launch(self, batch) -> None:
        """An EXTEND batch's forward was just launched (its kernels may still run)."""

    def after_forward(self, batch) -> None:
        pass

    def on_chunk(self, req, start: int, end: int) -> None:
        pass

    def last_chunk_tokens(self, req) -> int:
        """Tokens the scheduler computes as req's last chunk on their own (0: none)."""
        return 0

    def stream_chunk_tokens(self, req) -> int:
        """The most tokens per chunk of req's prompt while this role streams its KV under the
        compute (0: the chunk size alone decides)."""
        return 0

    def on_prompt_done(self, req) -> bool:
        return False

    def has_work(self) -> bool:
        return False

    def wake_sockets(self) -> list:
        return []

    def server_info(self) -> dict | None:
        return None

    def watched_peers(self) -> dict[Peer, str]:
        """(host, port) -> its name in messages: the peers whose death fails open rooms."""
        return {}

    def on_peer_dead(self, peer: Peer, reason: str) -> None:
        """`peer` stopped answering: fail every room that depends on it, now."""

    def check_peers(self, now: float) -> None:
        """Probe the watched peers (worker thread); act on the ones seen dead since last time."""
        if self.monitor is None:
            return
        watched = self.watched_peers()
        for peer in self.monitor.poll(set(watched), now):
            self.stats.peer_failures += 1
            self.on_peer_dead(peer, f"{self.peer_kind} unreachable: {watched[peer]} ({self.monitor.describe(peer)})")

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
