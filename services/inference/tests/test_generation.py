"""GenerateRequest validation and the stream batching policy (no engine)."""

import dataclasses

import pytest

from primerl_common.errors import InvalidArgument
from primerl_inference.generation import GenerateRequest, SamplingSpec, StreamBatcher, StreamPolicy

LIMITS = {"vocab_size": 320, "max_model_len": 64}


def request(prompt: tuple[int, ...] = (1, 2, 3), **sampling: object) -> GenerateRequest:
    return GenerateRequest(request_id="r", prompt_token_ids=prompt, sampling=SamplingSpec(**sampling))  # type: ignore[arg-type]


def test_a_plain_request_is_valid() -> None:
    request().validate(**LIMITS)
    request(temperature=0.0, top_k=5, top_p=0.5, max_tokens=4, min_tokens=4, stop_token_ids=(319,)).validate(**LIMITS)


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (request(prompt=()), "input.prompt_token_ids"),
        (request(prompt=(1, 320)), "input.prompt_token_ids"),
        (request(prompt=tuple(range(64))), "input.prompt_token_ids"),
        (request(temperature=-0.1), "input.sampling.temperature"),
        (request(temperature=float("nan")), "input.sampling.temperature"),
        (request(temperature=2.5), "input.sampling.temperature"),
        (request(top_p=0.0), "input.sampling.top_p"),
        (request(top_p=1.5), "input.sampling.top_p"),
        (request(top_k=-1), "input.sampling.top_k"),
        (request(min_p=2.0), "input.sampling.min_p"),
        (request(max_tokens=2, min_tokens=3), "input.sampling.min_tokens"),
        (request(stop_token_ids=(1, 320)), "input.sampling.stop_token_ids"),
        (request(repetition_penalty=0.0), "input.sampling.repetition_penalty"),
        (request(presence_penalty=2.5), "input.sampling.presence_penalty"),
        (request(frequency_penalty=-3.0), "input.sampling.frequency_penalty"),
    ],
)
def test_invalid_requests_name_the_field(bad: GenerateRequest, field: str) -> None:
    with pytest.raises(InvalidArgument) as error:
        bad.validate(**LIMITS)

    assert error.value.field == field


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def feed(batcher: StreamBatcher, num_tokens: int) -> None:
    batcher.add(list(range(num_tokens)), [-1.0] * num_tokens, [0] * num_tokens)


def test_default_policy_sends_every_token_at_once() -> None:
    batcher = StreamBatcher(StreamPolicy())

    assert not batcher.due()
    feed(batcher, 1)
    assert batcher.due() and batcher.seconds_until_due() is None
    chunk = batcher.take()
    feed(batcher, 2)
    second = batcher.take()

    assert (chunk.offset, chunk.token_ids, second.offset, second.token_ids) == (0, [0], 1, [0, 1])
    assert batcher.num_tokens == 3 and not batcher.due()


def test_every_n_tokens() -> None:
    batcher = StreamBatcher(StreamPolicy(every_n_tokens=3))

    feed(batcher, 2)
    assert not batcher.due() and batcher.seconds_until_due() is None
    feed(batcher, 1)
    assert batcher.due()
    assert len(batcher.take().token_ids) == 3


def test_every_ms_counts_from_the_last_message() -> None:
    clock = Clock()
    batcher = StreamBatcher(StreamPolicy(every_ms=100), clock=clock)

    assert batcher.seconds_until_due() is None  # nothing buffered, no timer
    clock.now = 0.04
    feed(batcher, 1)
    assert not batcher.due()
    assert batcher.seconds_until_due() == pytest.approx(0.06)
    clock.now = 0.1
    assert batcher.due() and batcher.seconds_until_due() == 0
    batcher.take()
    feed(batcher, 1)
    assert batcher.seconds_until_due() == pytest.approx(0.1)


def test_whichever_comes_first() -> None:
    clock = Clock()
    batcher = StreamBatcher(StreamPolicy(every_n_tokens=2, every_ms=100), clock=clock)

    feed(batcher, 2)
    assert batcher.due()  # by count, before the timer


def test_final_only_is_never_due() -> None:
    batcher = StreamBatcher(StreamPolicy(final_only=True, every_n_tokens=1, every_ms=1))

    feed(batcher, 5)

    assert not batcher.due() and batcher.seconds_until_due() is None
    assert dataclasses.asdict(batcher.take())["token_ids"] == [0, 1, 2, 3, 4]
