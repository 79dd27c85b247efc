"""PD transfer: the room state machine and the narrow base of transfer engines.

A room (one request's KV, named by the router's `bootstrap_room`) moves through SGLang's states
on both sides:

    BOOTSTRAPPING --> WAITING_FOR_INPUT --> TRANSFERRING --> SUCCESS
          \\                  \\                  \\
           +-------------------+------------------+------> FAILED

    prefill: BOOTSTRAPPING until a decode claims the room; WAITING_FOR_INPUT until its prompt
             is prefilled (chunks may already stream); TRANSFERRING while segments go out;
             SUCCESS once KVDone is sent. FAILED: no claim in time, a write error, a stalled
             ring (no acks), or the decode cancelled.
    decode:  BOOTSTRAPPING while it finds the prefill (bootstrap server) and claims; WAITING_FOR_INPUT
             until the first segment; TRANSFERRING while segments land and are unpacked;
             SUCCESS at KVDone with every segment verified. FAILED: bad checksum, KVFailed,
             no progress in time, prefill unreachable -> the request is prefilled locally.

`TransferEngine` moves bytes from this process's registered memory into a peer's registered
memory; one file per engine (mooncake.py, ...), named in TRANSFER_ENGINES (disagg/__init__.py).
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod


class KVPoll(enum.IntEnum):  # SGLang's values
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


class TransferError(RuntimeError):
    """A write did not complete (peer gone, connection refused, ...)."""


class TransferEngine(ABC):
    """Invariants: `register` is called for every buffer before any `write` reads or writes it;
    `write` blocks until the bytes are in the peer's memory or raises TransferError; writes are
    issued by one sender thread (engines need not be re-entrant); `session_id` is what peers pass
    as `peer` to reach this process."""

    name = "base"
    gpu_memory = False  # whether register / write take GPU memory (Mooncake's CUDA build)

    @abstractmethod
    def session_id(self) -> str:
        """"host:port" at which peers reach this engine."""

    @abstractmethod
    def register(self, addr: int, nbytes: int) -> None:
        """Make [addr, addr + nbytes) of this process readable / writable by transfers."""

    @abstractmethod
    def write(self, peer: str, src_addr: int, dst_addr: int, nbytes: int) -> None:
        """Copy nbytes from local src_addr to dst_addr in the peer's registered memory."""

    def describe(self) -> dict:
        """What /server_info reports about the engine."""
        return {"engine": self.name}

    def close(self) -> None:
        pass
