"""kernels.linear_cross_entropy against F.cross_entropy on materialised logits, the models'
hidden-states output that feeds it, and the MoE permutations' hand-written backwards."""

import pathlib

import pytest
import torch
import torch.nn.functional as F

from primerl_trainer.kernels import linear_cross_entropy
from primerl_trainer.models import load_model
from primerl_trainer.models.moe import _CombineFromExperts, _DispatchToExperts

from .conftest import random_ids


def _inputs(num_rows: int, dim: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_rows, dim, generator=generator, dtype=dtype).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=generator, dtype=dtype) / dim**0.5).requires_grad_()
    targets = torch.randint(0, vocab, (num_rows,), generator=generator)
    return hidden, weight, targets


@pytest.mark.parametrize("chunk_size", [None, 1, 5, 64])
def test_mean_loss_and_gradients_equal_cross_entropy_of_logits(chunk_size: int | None) -> None:
    hidden, weight, targets = _inputs(13, 8, 50, torch.float64)
    targets[[2, 7]] = -100
    out = linear_cross_entropy(hidden, weight, targets, chunk_size=chunk_size)
    out.loss.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    logits = hidden @ weight.T
    expected = F.cross_entropy(logits, targets, ignore_index=-100)
    expected.backward()
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(grads[0], hidden.grad)
    torch.testing.assert_close(grads[1], weight.grad)
    log_probs = logits.detach().log_softmax(-1)
    valid = targets != -100
    torch.testing.assert_close(out.logprobs[valid], log_probs[valid].gather(1, targets[valid, None]).squeeze(1))
    torch.testing.assert_close(out.entropy[valid], -(log_probs.exp() * log_probs).sum(-1)[valid])
    assert (out.logprobs[~valid] == 0).all() and (out.entropy[~valid] == 0).all()


def test_token_weights_temperatures_and_a_scaled_loss() -> None:
    hidden, weight, targets = _inputs(9, 6, 40, torch.float64, seed=1)
    token_weights = torch.rand(9, dtype=torch.float64)
    temperatures = torch.rand(9, dtype=torch.float64) + 0.5
    out = linear_cross_entropy(
        hidden, weight, targets, token_weights=token_weights, temperatures=temperatures, chunk_size=4
    )
    (3 * out.loss).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    logprobs = ((hidden @ weight.T) / temperatures[:, None]).log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    expected = -(token_weights * logprobs).sum()
    (3 * expected).backward()
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(grads[0], hidden.grad)
    torch.testing.assert_close(grads[1], weight.grad)


def test_bad_shapes_are_refused() -> None:
    hidden, weight, targets = _inputs(4, 6, 10, torch.float32)
    with pytest.raises(ValueError, match="hidden must be"):
        linear_cross_entropy(hidden, weight[:, :5], targets)
    with pytest.raises(ValueError, match="targets must have shape"):
        linear_cross_entropy(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="share a dtype"):
        linear_cross_entropy(hidden, weight.double(), targets)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_hidden_states_output_gives_the_logits_loss(request: pytest.FixtureRequest, kind: str) -> None:
    path: pathlib.Path = request.getfixturevalue(f"{kind}_path")
    model = load_model(path)
    input_ids = random_ids(1, 24, seed=3)
    targets = torch.roll(input_ids[0], -1)
    expected = F.cross_entropy(model(input_ids).logits[0], targets)
    expected.backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    out = model(input_ids, compute_logits=False)
    assert out.logits is None and out.hidden_states.shape == (1, 24, model.args.dim)
    loss = linear_cross_entropy(out.hidden_states[0], model.output_weight, targets).loss
    loss.backward()
    torch.testing.assert_close(loss, expected)
    for param, expected_grad in zip(model.parameters(), expected_grads, strict=True):
        torch.testing.assert_close(param.grad, expected_grad, rtol=1e-4, atol=1e-6)


def test_moe_permutation_backwards_pass_gradcheck() -> None:
    generator = torch.Generator().manual_seed(0)
    num_tokens, top_k, dim = 5, 3, 4
    order = torch.randperm(num_tokens * top_k, generator=generator)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    x = torch.randn(num_tokens, dim, dtype=torch.float64, generator=generator, requires_grad=True)
    routed = torch.randn(num_tokens * top_k, dim, dtype=torch.float64, generator=generator, requires_grad=True)
    scores = torch.rand(num_tokens, top_k, dtype=torch.float64, generator=generator, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: _DispatchToExperts.apply(x, order, inverse, top_k), (x,))
    assert torch.autograd.gradcheck(lambda r, s: _CombineFromExperts.apply(r, s, order, inverse), (routed, scores))
    torch.testing.assert_close(_DispatchToExperts.apply(x, order, inverse, top_k), x[order // top_k])
    expected = torch.bmm(scores.unsqueeze(1), routed[inverse].view(num_tokens, top_k, dim)).squeeze(1)
    torch.testing.assert_close(_CombineFromExperts.apply(routed, scores, order, inverse), expected)
