"""Liveness of PD peers: a prefill or decode server that dies is seen within seconds, not at
the end of --kv-transfer-timeout.

Each role watches the peers it has open rooms with (decode: the prefill's bootstrap server;
prefill: a decode's KV inbox once it registered for a room). Every PROBE_INTERVAL_S a worker thread
opens a TCP connection to each such peer and closes it (nothing is sent: the bootstrap server
and the ZMQ inbox both accept and drop it). A refused or timed-out connection is a failure;
MAX_FAILURES in a row make the peer dead, and the role fails that peer's rooms at once (the
decode prefills them locally, the prefill ends them naming the decode). A later probe that
connects revives the peer.

Worst case from a peer's death to its rooms failing (one scheduler poll added):
    process gone (connection refused):  MAX_FAILURES * PROBE_INTERVAL_S          ~ 2 s
    host gone (no answer):              MAX_FAILURES * (PROBE_INTERVAL_S + PROBE_TIMEOUT_S)  ~ 8 s
"""
from __future__ import annotations

import logging
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 3.0
MAX_FAILURES = 2
Peer = tuple  # (host, port)


def probe(peer: Peer, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Raises OSError when `peer` accepts no TCP connection within `timeout` seconds."""
    with socket.create_connection(peer, timeout=timeout):
        pass


def endpoint_peer(endpoint: str) -> Peer:
    """"tcp://host:port" -> (host, port)."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return host, int(port)


@dataclass
class _State:
    failures: int = 0
    dead: bool = False
    next_probe: float = 0.0
    probe: Future | None = None
    error: str = ""
    since: float = field(default_factory=time.monotonic)


class PeerMonitor:
    """Not thread-safe: the scheduler thread calls `poll`; probes run on one worker thread."""

    def __init__(self, interval: float = PROBE_INTERVAL_S, timeout: float = PROBE_TIMEOUT_S,
                 max_failures: int = MAX_FAILURES):
        self.interval, self.timeout, self.max_failures = interval, timeout, max_failures
        self._peers: dict[Peer, _State] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-peer-probe")
        self.deaths = 0  # peers seen dying (a revived peer that dies again counts again)

    def is_dead(self, peer: Peer) -> bool:
        st = self._peers.get(peer)
        return st is not None and st.dead

    def describe(self, peer: Peer) -> str:
        st = self._peers.get(peer)
        return f"{st.failures} failed probes, last: {st.error}" if st else "never probed"

    def poll(self, watched: set[Peer], now: float | None = None) -> list[Peer]:
        """Collect finished probes, start due ones for `watched` peers; returns the peers that
        died since the last poll. Peers no longer watched are forgotten."""
        now = time.monotonic() if now is None else now
        for peer in [p for p in self._peers if p not in watched]:
            st = self._peers.pop(peer)
            if st.probe is not None:
                st.probe.cancel()
        died = []
        for peer in watched:
            st = self._peers.setdefault(peer, _State())
            if st.probe is not None and st.probe.done():
                error = st.probe.exception()
                st.probe = None
                if error is None:
                    if st.dead:
                        logger.info("PD peer %s:%s answers again", *peer)
                    st.failures, st.dead, st.error = 0, False, ""
                else:
                    st.failures += 1
                    st.error = f"{type(error).__name__}: {error}"
                    if st.failures >= self.max_failures and not st.dead:
                        st.dead = True
                        self.deaths += 1
                        died.append(peer)
                        logger.warning("PD peer %s:%s is unreachable (%s)", *peer, self.describe(peer))
            if st.probe is None and now >= st.next_probe:
                st.next_probe = now + self.interval
                st.probe = self._pool.submit(probe, peer, self.timeout)
        return died

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
