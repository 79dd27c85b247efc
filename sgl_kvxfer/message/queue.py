"""ZMQ queue wrappers: the only module that imports zmq.

Each process *binds* its own input PULL socket (address from `ServerArgs.ipc_addr`, or
`tcp://host:*` for the PD KV managers, which then publish `endpoint`) and *connects* PUSH sockets
to its peers. Messages are encoded with `message.encode`.
"""
from __future__ import annotations

import logging

import msgspec
import zmq
import zmq.asyncio

from sgl_kvxfer.message import decode, encode

logger = logging.getLogger(__name__)


def _decode_or_none(data: bytes, destination: str):
    """NOTE: a PD KV inbox listens on TCP, so anything may arrive: a message that does not
    decode is dropped (and logged), never raised into the receiving loop."""
    try:
        return decode(data, destination)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        logger.warning("dropped an undecodable message for %s (%d bytes): %s", destination, len(data), e)
        return None


class PushQueue:
    def __init__(self, addr: str, bind: bool = False):
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        (self._sock.bind if bind else self._sock.connect)(addr)

    def put(self, msg) -> None:
        self._sock.send(encode(msg), copy=False)

    def close(self) -> None:
        self._sock.close(linger=0)


class PullQueue:
    def __init__(self, addr: str, destination: str, bind: bool = True):
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        (self._sock.bind if bind else self._sock.connect)(addr)
        self._destination = destination

    def get(self, timeout: float | None = None):
        """Block up to `timeout` seconds (forever if None); return a message or None."""
        if timeout is not None and not self._sock.poll(int(timeout * 1000)):
            return None
        return _decode_or_none(self._sock.recv(copy=False).bytes, self._destination)

    def get_all_nowait(self) -> list:
        msgs = []
        while True:
            try:
                data = self._sock.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return msgs
            msg = _decode_or_none(data.bytes, self._destination)
            if msg is not None:
                msgs.append(msg)

    @property
    def endpoint(self) -> str:
        """The bound address, with the port resolved (tcp://host:* binds a free one)."""
        return self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def close(self) -> None:
        self._sock.close(linger=0)


class WakeChannel:
    """Wakes a `wait_readable` from another thread (PD: the sender thread's results have no
    socket of their own). `notify` is called from one thread only, `drain` from the waiting one
    (each end of the inproc pair belongs to one thread)."""

    def __init__(self):
        self._ctx = zmq.Context.instance()
        addr = f"inproc://wake-{id(self):x}"
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.bind(addr)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(addr)

    def notify(self) -> None:
        self._push.send(b"", flags=zmq.NOBLOCK, copy=False)

    def drain(self) -> None:
        while True:
            try:
                self._sock.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return

    def close(self) -> None:
        self._push.close(linger=0)
        self._sock.close(linger=0)


def wait_readable(queues: list, timeout: float) -> None:
    """Block until any of the queues (PullQueue / WakeChannel) has a message, or `timeout`
    seconds pass."""
    poller = zmq.Poller()
    for q in queues:
        poller.register(q._sock, zmq.POLLIN)
    poller.poll(int(timeout * 1000))


class AsyncPullQueue:
    """asyncio flavour for the tokenizer manager's event loop."""

    def __init__(self, addr: str, destination: str, bind: bool = True):
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        (self._sock.bind if bind else self._sock.connect)(addr)
        self._destination = destination

    async def get(self):
        """The next message that decodes."""
        while True:
            data = await self._sock.recv(copy=False)
            msg = _decode_or_none(data.bytes, self._destination)
            if msg is not None:
                return msg

    def close(self) -> None:
        self._sock.close(linger=0)
