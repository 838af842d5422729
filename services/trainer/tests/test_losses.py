"""Per-token logprobs (alignment, temperature, chunking, gradients) and the RL and SFT losses
against hand-computed values."""

import math

import pytest
import torch
from pydantic import ValidationError

from primerl_trainer.losses import RLLossConfig, rl_loss, sft_loss, target_logprobs, token_logprobs

# --- token_logprobs ------------------------------------------------------------------

# Row 0 is uniform; row 1 is log(1..4): probabilities k / 10 at temperature 1, k^2 / 30 at 0.5.
LOGITS = torch.tensor(
    [
        [0.0, 0.0, 0.0, 0.0],
        [math.log(1), math.log(2), math.log(3), math.log(4)],
        [5.0, -1.0, 2.0, 0.5],  # the last row predicts nothing in the sequence
    ]
)


def test_token_logprobs_hand_computed_alignment_and_temperature() -> None:
    input_ids = torch.tensor([3, 1, 3])
    # temperatures[t] is the temperature token t was sampled at: row t - 1 is divided by it.
    temperatures = torch.tensor([9.0, 1.0, 0.5])
    logprobs, entropy = token_logprobs(LOGITS, input_ids, temperatures)
    assert logprobs.dtype == entropy.dtype == torch.float32
    # Token 1 (id 1) from row 0 (uniform); token 2 (id 3) from row 1 at temperature 0.5: 16 / 30.
    torch.testing.assert_close(logprobs, torch.tensor([0.0, math.log(1 / 4), math.log(16 / 30)]))
    row1 = [k * k / 30 for k in (1, 2, 3, 4)]
    torch.testing.assert_close(entropy, torch.tensor([0.0, math.log(4), -sum(p * math.log(p) for p in row1)]))


def test_token_logprobs_at_temperature_one() -> None:
    logprobs, _ = token_logprobs(LOGITS, torch.tensor([0, 0, 2]), torch.ones(3))
    torch.testing.assert_close(logprobs, torch.tensor([0.0, math.log(1 / 4), math.log(3 / 10)]))


def _naive(logits: torch.Tensor, input_ids: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """The textbook computation: a float32 log_softmax of all shifted logits."""
    logprobs = (logits[:-1].float() / temperatures[1:, None]).log_softmax(-1)
    return torch.cat([torch.zeros(1), logprobs.gather(1, input_ids[1:, None])[:, 0]])


@pytest.mark.parametrize("chunk_size", [1, 3, 7, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_match_naive_reference_for_any_chunking(chunk_size: int | None, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(20, 50, generator=generator)).to(dtype)
    input_ids = torch.randint(0, 50, (20,), generator=generator)
    temperatures = 0.5 + torch.rand(20, generator=generator)
    logprobs, entropy = token_logprobs(logits, input_ids, temperatures, chunk_size=chunk_size)
    torch.testing.assert_close(logprobs, _naive(logits, input_ids, temperatures))
    reference = (logits[:-1].double() / temperatures[1:, None]).log_softmax(-1)
    expected_entropy = -(reference.exp() * reference).sum(-1).float()
    torch.testing.assert_close(entropy[1:], expected_entropy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_gradient_matches_naive_reference(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    logits = (2 * torch.randn(12, 30, generator=generator)).to(dtype)
    input_ids = torch.randint(0, 30, (12,), generator=generator)
    temperatures = 0.5 + torch.rand(12, generator=generator)
    weights = torch.randn(12, generator=generator)
    grads = []
    for fn in (
        lambda x: token_logprobs(x, input_ids, temperatures, chunk_size=5)[0],
        lambda x: _naive(x, input_ids, temperatures),
    ):
        x = logits.clone().requires_grad_()
        (fn(x) * weights).sum().backward()
        assert x.grad is not None and x.grad.dtype == dtype
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1])
    # The last row predicts no token of the sequence: no gradient reaches it.
    assert torch.all(grads[0][-1] == 0)


def test_token_logprobs_gradcheck() -> None:
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    input_ids = torch.randint(0, 5, (6,), generator=generator)
    temperatures = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.9, 2.0], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, input_ids, temperatures, chunk_size=2)[0], (logits,))


def test_excluded_tokens_are_scored_as_if_they_were_not_in_the_vocabulary() -> None:
    """As inference samples with tokens banned: logprobs, entropy and gradient over the others."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 10, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 1, 2, 4, 5, 7, 8, 9])
    temperatures = torch.full((8,), 0.8, dtype=torch.float64)
    excluded = torch.tensor([3, 6])
    kept = torch.tensor([0, 1, 2, 4, 5, 7, 8, 9])

    logprobs, entropy = target_logprobs(logits, targets, temperatures, chunk_size=3, excluded=excluded)
    reference = torch.log_softmax(logits[:, kept] / 0.8, dim=-1)
    torch.testing.assert_close(logprobs, reference.gather(1, torch.arange(8)[:, None])[:, 0])
    torch.testing.assert_close(entropy, -(reference.exp() * reference).sum(-1))
    (grad,) = torch.autograd.grad(logprobs.sum(), logits)
    (expected,) = torch.autograd.grad(reference.diagonal().sum(), logits)
    torch.testing.assert_close(grad, expected)
    assert torch.all(grad[:, excluded] == 0)
    assert torch.autograd.gradcheck(
        lambda x: target_logprobs(x, targets, temperatures, chunk_size=3, excluded=excluded)[0], (logits,)
    )


def test_token_logprobs_rejects_a_bad_chunk_size() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(LOGITS, torch.tensor([0, 0, 0]), torch.ones(3), chunk_size=0)


# --- rl_loss -------------------------------------------------------------------------

# Per token: (in the loss, advantage A, trainer prob p, inference prob q); p - q in the comment.
TOKENS = [
    (False, 3.0, 0.9, 0.1),  # not a loss token: ignored whatever its values
    (True, 1.0, 0.5, 0.4),  # +0.1: kept
    (True, 1.0, 0.7, 0.4),  # +0.3 with A > 0: masked (high)
    (True, -2.0, 0.1, 0.4),  # -0.3 with A < 0: masked (low)
    (True, -1.0, 0.7, 0.4),  # +0.3 with A < 0: kept (advantage-sign mask), masked (symmetric)
    (True, 0.5, 0.1, 0.4),  # -0.3 with A > 0: kept (advantage-sign mask), masked (symmetric)
    (True, 0.0, 0.7, 0.4),  # +0.3 with A = 0: kept (advantage-sign mask), masked (symmetric)
]
NUM_LOSS_TOKENS = 10  # the whole batch's count: more than this micro-batch holds


def _rl_inputs(requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    loss_mask = torch.tensor([t[0] for t in TOKENS])
    advantages = torch.tensor([t[1] for t in TOKENS])
    logprobs = torch.tensor([math.log(t[2]) for t in TOKENS], requires_grad=requires_grad)
    inference_logprobs = torch.tensor([math.log(t[3]) for t in TOKENS])
    return logprobs, inference_logprobs, advantages, loss_mask


def _kl_sum() -> float:
    return sum(math.log(p / q) ** 2 for in_loss, _, p, q in TOKENS if in_loss)


def test_rl_loss_advantage_sign_mask_hand_computed() -> None:
    output = rl_loss(*_rl_inputs(), num_loss_tokens=NUM_LOSS_TOKENS, config=RLLossConfig())
    # Kept: tokens 1, 4, 5, 6; -A * r with r = p / q.
    policy = -1.0 * 0.5 / 0.4 + 1.0 * 0.7 / 0.4 - 0.5 * 0.1 / 0.4 - 0.0
    assert output.loss.item() == pytest.approx((policy + 1e-3 * _kl_sum()) / NUM_LOSS_TOKENS, rel=1e-6)
    assert output.sums["masked_high"].item() == 1
    assert output.sums["masked_low"].item() == 1
    mismatch_kl = sum(p / q - math.log(p / q) - 1 for in_loss, _, p, q in TOKENS if in_loss)
    assert output.sums["mismatch_kl"].item() == pytest.approx(mismatch_kl, rel=1e-6)


def test_rl_loss_symmetric_mask_hand_computed() -> None:
    output = rl_loss(*_rl_inputs(), num_loss_tokens=NUM_LOSS_TOKENS, config=RLLossConfig(mask="symmetric"))
    policy = -1.0 * 0.5 / 0.4  # only token 1 is kept
    assert output.loss.item() == pytest.approx((policy + 1e-3 * _kl_sum()) / NUM_LOSS_TOKENS, rel=1e-6)
    assert output.sums["masked_high"].item() == 3  # tokens 2, 4, 6
    assert output.sums["masked_low"].item() == 2  # tokens 3, 5


def test_rl_loss_thresholds_and_kl_coef_are_configurable() -> None:
    # p - q = +0.3 now inside the region above, -0.3 still outside below.
    config = RLLossConfig(mask_high=0.35, mask_low=0.25, kl_coef=0.5)
    output = rl_loss(*_rl_inputs(), num_loss_tokens=NUM_LOSS_TOKENS, config=config)
    policy = -1.0 * 0.5 / 0.4 - 1.0 * 0.7 / 0.4 + 1.0 * 0.7 / 0.4 - 0.5 * 0.1 / 0.4
    assert output.loss.item() == pytest.approx((policy + 0.5 * _kl_sum()) / NUM_LOSS_TOKENS, rel=1e-6)
    assert (output.sums["masked_high"].item(), output.sums["masked_low"].item()) == (0, 1)


def test_rl_loss_gradient_hand_computed() -> None:
    logprobs, inference_logprobs, advantages, loss_mask = _rl_inputs(requires_grad=True)
    rl_loss(
        logprobs, inference_logprobs, advantages, loss_mask, num_loss_tokens=NUM_LOSS_TOKENS, config=RLLossConfig()
    ).loss.backward()
    # d/d log p of -A * r is -A * r; of kl_coef * (log p - log q)^2 it is 2 * kl_coef * log(p / q).
    kept = {1, 4, 5, 6}
    expected = [
        0.0 if not in_loss else ((-a * p / q) if i in kept else 0.0) + 2e-3 * math.log(p / q)
        for i, (in_loss, a, p, q) in enumerate(TOKENS)
    ]
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor(expected) / NUM_LOSS_TOKENS)


def test_rl_loss_ignores_non_finite_values_off_the_loss_mask() -> None:
    logprobs, inference_logprobs, advantages, loss_mask = _rl_inputs()
    logprobs = logprobs.clone()
    logprobs[0] = -math.inf
    inference_logprobs[0] = math.inf
    logprobs.requires_grad_()
    output = rl_loss(
        logprobs, inference_logprobs, advantages, loss_mask, num_loss_tokens=NUM_LOSS_TOKENS, config=RLLossConfig()
    )
    output.loss.backward()
    assert torch.isfinite(output.loss)
    assert logprobs.grad is not None and torch.all(torch.isfinite(logprobs.grad))
    assert torch.isfinite(output.sums["mismatch_kl"])


def test_rl_loss_on_policy_is_minus_the_mean_advantage() -> None:
    # p == q: ratio 1, no KL, nothing masked, mismatch KL 0.
    advantages = torch.tensor([0.0, 1.5, -0.5, 2.0])
    logprobs = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    loss_mask = torch.tensor([False, True, True, True])
    output = rl_loss(logprobs, logprobs.clone(), advantages, loss_mask, num_loss_tokens=3, config=RLLossConfig())
    assert output.loss.item() == pytest.approx(-(1.5 - 0.5 + 2.0) / 3)
    assert output.sums["mismatch_kl"].item() == 0
    assert output.sums["masked_high"].item() == output.sums["masked_low"].item() == 0


def test_rl_loss_config_rejects_negative_values() -> None:
    for field in ("mask_high", "mask_low", "kl_coef"):
        with pytest.raises(ValidationError, match=field):
            RLLossConfig(**{field: -0.1})
    with pytest.raises(ValidationError, match="mask"):
        RLLossConfig(mask="clip")  # type: ignore[arg-type]


def test_losses_reject_a_non_positive_token_count() -> None:
    with pytest.raises(ValueError, match="num_loss_tokens"):
        rl_loss(*_rl_inputs(), num_loss_tokens=0, config=RLLossConfig())
    with pytest.raises(ValueError, match="num_loss_tokens"):
        sft_loss(torch.zeros(2), torch.ones(2, dtype=torch.bool), num_loss_tokens=0)


# --- sft_loss ------------------------------------------------------------------------


def test_sft_loss_hand_computed_with_gradient() -> None:
    logprobs = torch.tensor([-9.0, -1.0, -2.0, -0.5], requires_grad=True)
    loss_mask = torch.tensor([False, True, True, False])
    output = sft_loss(logprobs, loss_mask, num_loss_tokens=4)
    assert output.loss.item() == pytest.approx((1.0 + 2.0) / 4)
    output.loss.backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor([0.0, -0.25, -0.25, 0.0]))
