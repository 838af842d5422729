"""Striped weight pushes, receiving side: the streams of one update joined into one
all-or-nothing outcome.

A push striped over K streams (each on its own connection: TLS encrypts and decrypts one
connection on one thread per direction, so one stream keeps ~1 core busy per end) sends the
same `begin` on each, with a session id, K and the stream's index, and whole tensors on each
stream. Each stream's handler joins the session and receives its part; the handler whose part
ends last commits them all, and every handler answers with that commit's outcome. A stream
that fails (a refused tensor, its own deadline, its client gone) fails the session: the other
streams are cancelled and answered ABORTED, nothing is committed. Streams that have not all
arrived within the join timeout fail the session too.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Generic, TypeVar

import grpc

from primerl_common.errors import InvalidArgument, ServiceError

__all__ = [
    "PUBLISH_STRIPED",
    "StripeAborted",
    "StripeSession",
    "StripeSessions",
    "check_stripe_fields",
    "stripe_channel_options",
]

T = TypeVar("T")
R = TypeVar("R")

MAX_SESSION_ID_LEN = 128
# What a weight broadcaster lists in its capabilities when it joins striped publishes: a
# publisher stripes only to one that does (an older broadcaster takes one stream).
PUBLISH_STRIPED = "publish.striped"
# Streams one striped transfer uses by default (the trainer's publish.streams, the broadcaster's
# push.streams): enough for TLS to run on several cores.
DEFAULT_STREAMS = 4
# Ids of failed sessions remembered, so that a stripe arriving late fails at once.
_FAILED_KEPT = 256


def stripe_channel_options(stripe_index: int) -> list[tuple[str, Any]]:
    """Channel options that give a stripe's channel a TCP connection of its own (gRPC shares
    one connection between channels to the same address with the same arguments)."""
    return [("grpc.use_local_subchannel_pool", 1), ("primerl.stripe_index", stripe_index)]


class StripeAborted(ServiceError):
    """Another stripe of the same update failed: nothing of the update was applied."""

    code = grpc.StatusCode.ABORTED


def check_stripe_fields(
    session: str, num_stripes: int, stripe_index: int, *, max_stripes: int, config_field: str
) -> bool:
    """Checks a `begin`'s stripe fields; True when the push is striped (num_stripes > 1)."""
    if num_stripes <= 1 and not session:
        if stripe_index:
            raise InvalidArgument("must be 0 for an unstriped push", field="begin.stripe_index")
        return False
    if not session or len(session) > MAX_SESSION_ID_LEN:
        raise InvalidArgument(
            f"a striped push needs a session id of 1 to {MAX_SESSION_ID_LEN} characters", field="begin.stripe_session"
        )
    if num_stripes < 1 or num_stripes > max_stripes:
        raise InvalidArgument(
            f"{num_stripes} stripes: this server takes 1 to {max_stripes} ({config_field})", field="begin.num_stripes"
        )
    if stripe_index >= num_stripes:
        raise InvalidArgument(f"must be below num_stripes ({num_stripes})", field="begin.stripe_index")
    return True


class StripeSession(Generic[T, R]):
    """The streams of one striped update. `state`: what the stripes share while receiving
    (e.g. a budget of announced tensors), made by the first stripe to arrive."""

    def __init__(self, session_id: str, num_stripes: int, key: Hashable, *, on_end: Callable[[], None]) -> None:
        self.session_id = session_id
        self.num_stripes = num_stripes
        self.key = key
        self.state: Any = None
        self.joined: set[int] = set()
        self._results: dict[int, T] = {}
        self._receiving: dict[int, asyncio.Task[T]] = {}
        self._failure: str | None = None
        self._outcome: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        # The outcome is awaited by the stripes still there, maybe by none: never "unretrieved".
        self._outcome.add_done_callback(lambda future: future.cancelled() or future.exception())
        self._outcome.add_done_callback(lambda _: on_end())

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """`callback()` once the session has an outcome (committed or failed)."""
        self._outcome.add_done_callback(lambda _: callback())

    def fail(self, why: str) -> None:
        """Fails the session: the stripes still receiving are cancelled, every stripe answers
        ABORTED (but the one whose failure this is, which raises its own error)."""
        if self._outcome.done():
            return
        self._failure = why
        self._outcome.set_exception(self._aborted())
        for task in self._receiving.values():
            task.cancel()

    def _aborted(self) -> StripeAborted:
        return StripeAborted(
            f"striped update {self.session_id!r} failed, nothing of it was applied: {self._failure}",
            reason="STRIPE_FAILED",
        )

    async def run(self, stripe_index: int, receive: Awaitable[T], commit: Callable[[list[T]], Awaitable[R]]) -> R:
        """Receives this stripe's part (`receive`); the last stripe to end runs `commit` with
        every part (in stripe order); each stripe returns (or raises) its outcome."""
        task = asyncio.ensure_future(receive)
        if self.failed:
            task.cancel()
            raise self._aborted()
        self._receiving[stripe_index] = task
        try:
            self._results[stripe_index] = await task
        except asyncio.CancelledError:
            if task.cancelled() and self.failed and not _cancelling():
                raise self._aborted() from None
            self.fail(f"stripe {stripe_index} was cancelled (its client went away)")
            raise
        except BaseException as exc:
            self.fail(f"stripe {stripe_index} failed: {exc}")
            raise
        finally:
            self._receiving.pop(stripe_index, None)
        if self.failed:
            raise self._aborted()
        if len(self._results) == self.num_stripes:
            # Its own task: the commit (a swap) runs to its end even if this stripe's client goes away.
            committing = asyncio.ensure_future(commit([self._results[index] for index in range(self.num_stripes)]))
            committing.add_done_callback(self._committed)
        return await asyncio.shield(self._outcome)

    def _committed(self, committing: asyncio.Future[R]) -> None:
        if self._outcome.done():
            return
        if committing.cancelled():
            self._outcome.set_exception(asyncio.CancelledError())
        elif (exc := committing.exception()) is not None:
            self._outcome.set_exception(exc)
        else:
            self._outcome.set_result(committing.result())


def _cancelling() -> bool:
    """The current task itself is being cancelled (not only the part it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class StripeSessions(Generic[T, R]):
    """The striped updates being received, by session id."""

    def __init__(self, *, join_timeout_s: float) -> None:
        if join_timeout_s <= 0:
            raise ValueError("join_timeout_s must be positive")
        self._join_timeout_s = join_timeout_s
        self._sessions: dict[str, StripeSession[T, R]] = {}
        self._failed: collections.OrderedDict[str, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def join(
        self,
        session_id: str,
        *,
        num_stripes: int,
        stripe_index: int,
        key: Hashable,
        new_state: Callable[[StripeSession[T, R]], Any],
    ) -> StripeSession[T, R]:
        """The session of a stripe that just began: the first stripe makes it (and its state,
        `new_state(session)`); the others must announce the same `key` (their `begin`) and count."""
        if session_id in self._failed:
            raise StripeAborted(f"striped update {session_id!r} failed already", reason="STRIPE_FAILED")
        session = self._sessions.get(session_id)
        if session is None:
            session = StripeSession(session_id, num_stripes, key, on_end=lambda: self._end(session_id, session))
            session.state = new_state(session)  # may refuse (admission): then no session is kept
            self._sessions[session_id] = session
            timer = asyncio.get_running_loop().call_later(self._join_timeout_s, self._expire, session)
            session.add_done_callback(timer.cancel)
        elif session.key != key or session.num_stripes != num_stripes:
            session.fail(f"stripe {stripe_index} began with another begin")
            raise InvalidArgument(
                f"differs from the begin of the other stripes of session {session_id!r}", field="begin"
            )
        if stripe_index in session.joined:
            session.fail(f"stripe {stripe_index} began twice")
            raise InvalidArgument(
                f"stripe {stripe_index} of session {session_id!r} began twice", field="begin.stripe_index"
            )
        session.joined.add(stripe_index)
        return session

    def _expire(self, session: StripeSession[T, R]) -> None:
        if len(session.joined) < session.num_stripes:
            session.fail(
                f"{len(session.joined)} of its {session.num_stripes} stripes began within {self._join_timeout_s:g} s"
            )

    def _end(self, session_id: str, session: StripeSession[T, R] | None) -> None:
        if self._sessions.get(session_id) is session:
            del self._sessions[session_id]
        if session is not None and session.failed:
            self._failed[session_id] = None
            while len(self._failed) > _FAILED_KEPT:
                self._failed.popitem(last=False)
