"""Sealed streams: a weight push's bytes encrypted and authenticated by the application, on
several cores, over a plaintext connection whose key was handed out over mutual TLS.

gRPC's TLS encrypts each connection on one thread and, in a grpc.aio sender, on the event loop's
thread: a push over mTLS moved about half the bytes a second of the same push in plaintext
(bench/tls_overhead.py, bench/tls_transports.py), whatever the number of connections. A sealed
stream keeps gRPC's transport plaintext and seals each message with AES-256-GCM in a pool of
threads (`primerl_common.security.aead`, which lets go of the GIL), a few messages ahead of the
transport, so the cipher's work is spread over cores and off the event loop.

The protocol (a sealed stream carries one client-streaming call; Apache Spark's RPC encryption
and ALTS's record protocol are of this kind):
- The caller asks the service, over mutual TLS, to open one session per stream for a method
  (`SealedStreamService.OpenSealedStreams`); the service checks the caller's roles for that method as it would for
  the call itself, and answers each session's id and a fresh random 256-bit key, and the port its
  sealed streams are served on. A session is used once and lapses unused after a minute.
- Each frame is one flag byte (FINAL or not) and the AES-256-GCM sealing of one serialized
  message. The nonce is the direction (request 0, response 1) and the frame's sequence number;
  the associated data binds the session id, the method, the direction, the sequence number and
  the flag. A frame altered, replayed, reordered, dropped or moved to another session or method
  does not open. The request stream ends with an empty FINAL frame, so a stream cut short (its
  end forged on the plaintext connection) is told from a finished one; the answer is one FINAL
  frame. Anything that does not open fails the call, and nothing it carried is used.
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from concurrent import futures
from typing import Any

from primerl_common.security.aead import KEY_BYTES, TAG_BYTES, SealBroken, open_sealed, seal

__all__ = [
    "REQUEST",
    "RESPONSE",
    "SEALED_SESSION_METADATA",
    "SealBroken",
    "StreamKey",
    "open_frames",
    "seal_frames",
    "seal_frames_sync",
]

SEALED_SESSION_METADATA = "primerl-sealed-session"
REQUEST, RESPONSE = 0, 1
_FINAL = 1
# Messages sealed or opened ahead of the transport, per stream: enough to keep the pool's
# threads busy while gRPC moves the previous ones, few enough to bound memory (x 4 MiB).
_AHEAD = 4
_pool: futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _threads() -> futures.ThreadPoolExecutor:
    """The process's sealing threads (made at first use; gRPC's sending threads may ask at once)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = futures.ThreadPoolExecutor(
                max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="primerl-seal"
            )
        return _pool


class StreamKey:
    """One sealed stream's session: its id, its key and the method it carries."""

    __slots__ = ("key", "method", "session_id")

    def __init__(self, session_id: str, key: bytes, method: str) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a sealed stream's key is {KEY_BYTES} bytes, got {len(key)}")
        self.session_id, self.key, self.method = session_id, key, method

    def _nonce(self, direction: int, sequence: int) -> bytes:
        return direction.to_bytes(4, "big") + sequence.to_bytes(8, "big")

    def _aad(self, direction: int, sequence: int, flags: int) -> bytes:
        return b"\0".join(
            [
                b"primerl-sealed-v1",
                self.session_id.encode(),
                self.method.encode(),
                b"%d.%d.%d" % (direction, sequence, flags),
            ]
        )

    def seal_frame(self, direction: int, sequence: int, message: bytes, *, final: bool = False) -> bytes:
        """The serialized SealedStreamRequest (or Response) of `message`: its `frame` field is the
        flag byte, then the sealing (written straight into the bytes handed to gRPC)."""
        flags = _FINAL if final else 0
        prefix = _FRAME_FIELD + _varint(1 + len(message) + TAG_BYTES) + bytes([flags])
        nonce, aad = self._nonce(direction, sequence), self._aad(direction, sequence, flags)
        return seal(self.key, nonce, message, aad, prefix=prefix)

    def open_frame(self, direction: int, sequence: int, frame: bytes) -> tuple[bytes, bool]:
        """(the message, whether the frame is FINAL) of a serialized SealedStreamRequest or SealedStreamResponse; raises
        SealBroken."""
        start = _frame_field(frame, sequence)
        flags = frame[start]
        if flags & ~_FINAL:
            raise SealBroken(f"frame {sequence} of the sealed stream has unknown flags {flags:#x}")
        nonce, aad = self._nonce(direction, sequence), self._aad(direction, sequence, flags)
        return open_sealed(self.key, nonce, frame, aad, offset=start + 1), bool(flags & _FINAL)


_FRAME_FIELD = b"\x0a"  # Sealed*.frame: field 1, length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _frame_field(frame: bytes, sequence: int) -> int:
    """Where the `frame` field of a serialized SealedStreamRequest (or Response) starts (it must be all of it)."""
    if frame[:1] != _FRAME_FIELD:
        raise SealBroken(f"frame {sequence} of the sealed stream is not a SealedStreamRequest")
    size, shift, at = 0, 0, 1
    while at < len(frame) and at < 11:
        byte = frame[at]
        size |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            break
    if size < 1 + TAG_BYTES or at + size != len(frame):
        raise SealBroken(f"frame {sequence} of the sealed stream is cut or padded ({len(frame)} bytes)")
    return at


async def _ahead(jobs: AsyncIterator[futures.Future | asyncio.Future]) -> AsyncIterator:
    """The results of `jobs` in order, keeping up to _AHEAD of them running."""
    running: collections.deque = collections.deque()
    try:
        async for job in jobs:
            running.append(job)
            if len(running) > _AHEAD:
                yield await running.popleft()
        while running:
            yield await running.popleft()
    finally:
        for job in running:
            job.cancel()


async def seal_frames(key: StreamKey, messages: AsyncIterable[bytes], direction: int = REQUEST) -> AsyncIterator[bytes]:
    """The frames of `messages` (serialized), sealed in the thread pool ahead of the caller,
    then the empty FINAL frame."""
    loop = asyncio.get_running_loop()

    async def jobs():
        sequence = 0
        async for message in messages:
            yield loop.run_in_executor(_threads(), key.seal_frame, direction, sequence, message)
            sequence += 1
        yield loop.run_in_executor(_threads(), lambda: key.seal_frame(direction, sequence, b"", final=True))

    async for frame in _ahead(jobs()):
        yield frame


def seal_frames_sync(
    key: StreamKey,
    messages: Iterable[Any],
    serialize: Callable[[Any], bytes] | None = None,
    direction: int = REQUEST,
) -> Iterator[bytes]:
    """seal_frames for gRPC's threaded API: the frames of `messages` (each `serialize`d first,
    in the pool too), sealed in the thread pool ahead of the caller, then the empty FINAL frame."""

    def seal_one(sequence: int, message: Any) -> bytes:
        return key.seal_frame(direction, sequence, message if serialize is None else serialize(message))

    running: collections.deque[futures.Future[bytes]] = collections.deque()
    try:
        sequence = 0
        for message in messages:
            running.append(_threads().submit(seal_one, sequence, message))
            sequence += 1
            if len(running) > _AHEAD:
                yield running.popleft().result()
        running.append(_threads().submit(lambda: key.seal_frame(direction, sequence, b"", final=True)))
        while running:
            yield running.popleft().result()
    finally:
        for job in running:
            job.cancel()


async def open_frames(
    key: StreamKey,
    frames: AsyncIterable[bytes],
    direction: int = REQUEST,
    parse: Callable[[bytes], Any] | None = None,
) -> AsyncIterator[Any]:
    """The messages of sealed `frames` (each `parse`d, as a request deserializer would),
    opened in the thread pool ahead of the caller. Raises SealBroken on a frame that does not
    open, a frame after the FINAL one, or frames that end without it (the stream was cut short).

    Parsing in the thread that opened the frame reads the bytes while they are in that core's
    cache: on the event loop's thread, a 4 MiB chunk's copy out of another core's cache cost
    ~40% more than the rest of its receiving."""
    loop = asyncio.get_running_loop()
    ended = False

    def open_one(sequence: int, frame: bytes) -> tuple[Any, bool]:
        message, final = key.open_frame(direction, sequence, frame)
        return (message if final or parse is None else parse(message)), final

    async def jobs():
        sequence = 0
        async for frame in frames:
            yield loop.run_in_executor(_threads(), open_one, sequence, frame)
            sequence += 1

    async for message, final in _ahead(jobs()):
        if ended:
            raise SealBroken("the sealed stream went on after its FINAL frame")
        if final:
            if message:
                raise SealBroken("the sealed stream's FINAL frame carries bytes")
            ended = True
            continue
        yield message
    if not ended:
        raise SealBroken("the sealed stream ended without its FINAL frame: it was cut short")
