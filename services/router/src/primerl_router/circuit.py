"""Per-replica circuit breaker: after `failure_threshold` consecutive failed
requests the replica gets no traffic for `open_s`; then one trial request is let
through (half open), whose outcome closes the circuit or opens it again.

Health checks are a separate signal: a replica can answer its health check and
still fail every request (a wedged engine), which is what this catches.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

__all__ = ["CircuitBreaker", "CircuitState"]


class CircuitState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, *, failure_threshold: int, open_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._failure_threshold = failure_threshold
        self._open_s = open_s
        self._clock = clock
        self.state = CircuitState.CLOSED
        self.num_consecutive_failures = 0
        self._opened_at = 0.0
        self._trial_in_flight = False

    def available(self) -> bool:
        """Whether a new request may go to the replica now (an open circuit
        turns half open here once `open_s` has passed)."""
        if self.state is CircuitState.CLOSED:
            return True
        if self.state is CircuitState.OPEN:
            if self._clock() - self._opened_at < self._open_s:
                return False
            self.state = CircuitState.HALF_OPEN
            self._trial_in_flight = False
        return not self._trial_in_flight

    def on_attempt(self) -> None:
        """A request was sent; in half open it is the one trial."""
        if self.state is CircuitState.HALF_OPEN:
            self._trial_in_flight = True

    def on_success(self) -> None:
        self.state = CircuitState.CLOSED
        self.num_consecutive_failures = 0
        self._trial_in_flight = False

    def on_failure(self) -> None:
        self.num_consecutive_failures += 1
        if self.state is CircuitState.HALF_OPEN or self.num_consecutive_failures >= self._failure_threshold:
            self.state = CircuitState.OPEN
            self._opened_at = self._clock()
        self._trial_in_flight = False

    def on_neutral(self) -> None:
        """The request ended for a reason that says nothing about the replica
        (the client cancelled, a bad argument): a trial may be tried again."""
        self._trial_in_flight = False
