from primerl_router.circuit import CircuitBreaker, CircuitState


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_only():
    breaker = CircuitBreaker(failure_threshold=3, open_s=5, clock=Clock())
    for _ in range(2):
        breaker.on_failure()
    breaker.on_success()  # resets the run
    for _ in range(2):
        breaker.on_failure()
    assert breaker.state is CircuitState.CLOSED and breaker.available()
    breaker.on_failure()
    assert breaker.state is CircuitState.OPEN and not breaker.available()


def test_half_open_lets_one_trial_through_then_closes_or_reopens():
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=1, open_s=5, clock=clock)
    breaker.on_failure()
    clock.now = 4.9
    assert not breaker.available()
    clock.now = 5.0
    assert breaker.available() and breaker.state is CircuitState.HALF_OPEN
    breaker.on_attempt()
    assert not breaker.available()  # one trial at a time
    breaker.on_failure()
    assert breaker.state is CircuitState.OPEN and not breaker.available()

    clock.now = 10.0
    assert breaker.available()
    breaker.on_attempt()
    breaker.on_success()
    assert breaker.state is CircuitState.CLOSED and breaker.available()


def test_neutral_outcome_frees_the_trial():
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=1, open_s=1, clock=clock)
    breaker.on_failure()
    clock.now = 1.0
    assert breaker.available()
    breaker.on_attempt()
    breaker.on_neutral()  # e.g. the client cancelled: says nothing about the replica
    assert breaker.state is CircuitState.HALF_OPEN and breaker.available()
