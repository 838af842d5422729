"""The train step on the tiny models: token alignment with packing, gradient independence from
the micro-batch split, metrics, SFT mode, router replay, and no partial step on a bad batch."""

import dataclasses
import math
import pathlib
import types

import pytest
import torch

from primerl_common.errors import InvalidArgument
from primerl_launcher.tiny_model import make_tiny_model
from primerl_trainer.batch import BatchSpec
from primerl_trainer.config import PublishConfig
from primerl_trainer.losses import token_logprobs
from primerl_trainer.optim import LRScheduleConfig, OptimizerConfig, build_lr_scheduler, build_optimizer
from primerl_trainer.train import Trainer

from .test_vision_freeze import one_image_micro_batch
from .tiny_training import (
    SEQ_LEN,
    Sample,
    batch_spec,
    load_tiny_model,
    make_samples,
    pack,
    pack_into,
    parameters,
    reference_logprobs,
    tiny_model_dir,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def samples(model_dir: pathlib.Path) -> list[Sample]:
    return make_samples(load_tiny_model(model_dir), seed=0, num_samples=6)


def _sgd_trainer(model: torch.nn.Module, *, mode: str = "rl", max_grad_norm: float = 1e9) -> Trainer:
    """Plain SGD at lr 1: the update is minus the gradient, which the tests compare."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    return Trainer(
        model,
        optimizer,
        build_lr_scheduler(optimizer, LRScheduleConfig()),
        spec=batch_spec(model),
        device=CPU,
        mode=mode,  # type: ignore[arg-type]
        max_grad_norm=max_grad_norm,
    )


def _update(before: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() - before[name] for name, p in model.named_parameters()}


def test_packed_logprobs_match_each_sample_scored_alone(model_dir: pathlib.Path, samples: list[Sample]) -> None:
    model = load_tiny_model(model_dir)
    micro_batch = pack(samples)
    with torch.no_grad():
        logits = model(micro_batch.input_ids[None], micro_batch.position_ids[None]).logits[0]
        logprobs, _ = token_logprobs(logits, micro_batch.input_ids, micro_batch.temperatures)
    start = 0
    for sample in samples:
        end = start + len(sample.input_ids)
        # The first token of a sample is predicted by nothing (its packed value is meaningless).
        expected = reference_logprobs(model, sample.input_ids, sample.temperature)[1:]
        torch.testing.assert_close(logprobs[start + 1 : end], expected, rtol=1e-5, atol=1e-5)
        start = end


def test_gradient_does_not_depend_on_how_the_batch_is_split(model_dir: pathlib.Path, samples: list[Sample]) -> None:
    updates, metrics = [], []
    for num_micro_batches in (1, 2, 6):
        model = load_tiny_model(model_dir)
        before = parameters(model)
        metrics.append(_sgd_trainer(model).train_step(pack_into(samples, num_micro_batches)))
        updates.append(_update(before, model))
    for other, other_metrics in zip(updates[1:], metrics[1:], strict=True):
        for name, update in updates[0].items():
            # Updates up to ~0.6, sums over the batch's tokens in another order: float32 rounding
            # stays under 1e-5, a wrong normalisation would be off by whole factors.
            torch.testing.assert_close(other[name], update, rtol=1e-4, atol=1e-5)
        for key in ("loss", "grad_norm", "entropy", "mismatch_kl", "masked_fraction", "num_loss_tokens"):
            assert other_metrics[key] == pytest.approx(metrics[0][key], rel=1e-4, abs=1e-9), key
    assert metrics[0]["grad_norm"] > 0


def test_rl_step_metrics_against_a_reference(model_dir: pathlib.Path, samples: list[Sample]) -> None:
    model = load_tiny_model(model_dir)
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-3))
    trainer = Trainer(
        model,
        optimizer,
        build_lr_scheduler(optimizer, LRScheduleConfig(warmup_steps=2)),
        spec=batch_spec(model),
        device=CPU,
    )
    # Reference (before the step changes the model): every sample scored alone, the loss and its
    # statistics by their definitions.
    loss, mismatch_kl, num_loss_tokens = 0.0, 0.0, 0
    for sample in samples:
        logp = reference_logprobs(model, sample.input_ids, sample.temperature)[len(sample.prompt) :].double()
        logq = sample.inference_logprobs.double()
        ratio = torch.exp(logp - logq)
        assert torch.all((logp.exp() - logq.exp()).abs() < 0.2), "the noise is meant to stay inside the trust region"
        loss += float((-sample.advantage * ratio + 1e-3 * (logp - logq) ** 2).sum())
        mismatch_kl += float((ratio - torch.log(ratio) - 1).sum())
        num_loss_tokens += len(sample.completion)
    micro_batches = pack_into(samples, 2)
    metrics = trainer.train_step(micro_batches)
    assert metrics["num_loss_tokens"] == num_loss_tokens
    assert metrics["num_tokens"] == sum(len(s.input_ids) for s in samples)
    assert metrics["loss"] == pytest.approx(loss / num_loss_tokens, rel=1e-4)
    assert metrics["mismatch_kl"] == pytest.approx(mismatch_kl / num_loss_tokens, rel=1e-3)
    assert metrics["masked_fraction"] == metrics["masked_high_fraction"] == metrics["masked_low_fraction"] == 0
    # Near-uniform predictions over 320 tokens.
    assert 0 < metrics["entropy"] <= math.log(320)
    assert metrics["lr"] == pytest.approx(5e-4)  # first of 2 warmup steps
    assert metrics["grad_norm"] > 0 and metrics["update_skipped"] == 0
    assert metrics["tokens_per_s"] > 0 and metrics["step_time_s"] > 0 and metrics["peak_memory_bytes"] > 0
    assert metrics["num_micro_batches"] == 2
    assert trainer.step == 1
    assert trainer.train_step(micro_batches)["lr"] == pytest.approx(1e-3)
    assert trainer.step == 2


def test_mismatch_kl_is_zero_on_policy(model_dir: pathlib.Path) -> None:
    model = load_tiny_model(model_dir)
    samples = make_samples(model, seed=1, num_samples=3, logprob_noise=0.0)
    metrics = _sgd_trainer(model).train_step([pack(samples)])
    assert metrics["mismatch_kl"] < 1e-9
    advantage_sum = sum(s.advantage * len(s.completion) for s in samples)
    assert metrics["loss"] == pytest.approx(-advantage_sum / metrics["num_loss_tokens"], rel=1e-5)


def test_sft_step_minimises_the_mean_token_nll(model_dir: pathlib.Path, samples: list[Sample]) -> None:
    model = load_tiny_model(model_dir)
    trainer = _sgd_trainer(model, mode="sft")
    rl_batch = pack_into(samples, 2)
    sft_batch = [
        dataclasses.replace(mb, advantages=None, inference_logprobs=None, temperatures=torch.ones_like(mb.temperatures))
        for mb in rl_batch
    ]
    nll = -sum(float(reference_logprobs(model, s.input_ids, 1.0)[len(s.prompt) :].sum()) for s in samples)
    num_loss_tokens = sum(len(s.completion) for s in samples)
    metrics = trainer.train_step(sft_batch, num_loss_tokens=num_loss_tokens)
    assert metrics["loss"] == pytest.approx(nll / num_loss_tokens, rel=1e-5)
    assert "mismatch_kl" not in metrics
    # One SGD step down the gradient lowers the loss.
    assert trainer.train_step(sft_batch)["loss"] < metrics["loss"]


def test_a_bad_micro_batch_rejects_the_whole_batch_before_any_work(
    model_dir: pathlib.Path, samples: list[Sample]
) -> None:
    model = load_tiny_model(model_dir)
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-3))
    trainer = Trainer(
        model, optimizer, build_lr_scheduler(optimizer, LRScheduleConfig()), spec=batch_spec(model), device=CPU
    )
    good = pack_into(samples, 3)
    bad_advantages = good[2].advantages.clone()
    bad_advantages[4] = float("nan")
    before = parameters(model)
    with pytest.raises(InvalidArgument) as excinfo:
        trainer.train_step([*good[:2], dataclasses.replace(good[2], advantages=bad_advantages)])
    assert excinfo.value.field == "micro_batch.advantages"
    assert "micro-batch 2" in excinfo.value.message
    with pytest.raises(InvalidArgument) as excinfo:
        trainer.train_step(good, num_loss_tokens=1)
    assert excinfo.value.field == "begin.num_loss_tokens"
    assert trainer.step == 0 and not optimizer.state
    assert all(p.grad is None for p in model.parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_gradients_are_clipped_to_the_max_norm(model_dir: pathlib.Path, samples: list[Sample]) -> None:
    model = load_tiny_model(model_dir)
    before = parameters(model)
    metrics = _sgd_trainer(model, max_grad_norm=1e-3).train_step([pack(samples)])
    update_norm = math.sqrt(sum(float(u.square().sum()) for u in _update(before, model).values()))
    assert update_norm == pytest.approx(1e-3, rel=1e-4)
    assert metrics["grad_norm"] > 1e-3


# A first step without an update steps the schedule before the optimizer ever has: torch warns.
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_a_non_finite_gradient_skips_the_update_but_counts_the_step(
    model_dir: pathlib.Path, samples: list[Sample]
) -> None:
    model = load_tiny_model(model_dir)
    next(model.parameters()).register_hook(lambda grad: grad * float("nan"))
    trainer = _sgd_trainer(model)
    before = parameters(model)
    metrics = trainer.train_step([pack(samples)])
    assert metrics["update_skipped"] == 1 and math.isnan(metrics["grad_norm"])
    assert trainer.step == 1
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_router_replay_feeds_the_batch_experts_to_the_moe_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    moe_dir = make_tiny_model(tmp_path_factory.getbasetemp() / "trainer-tiny-moe", kind="moe", dtype="float32")
    model = load_tiny_model(moe_dir)
    micro_batch = pack(make_samples(model, seed=0, num_samples=3))
    with torch.no_grad():
        own_routing = model(micro_batch.input_ids[None], micro_batch.position_ids[None]).routed_experts
    _, num_moe_layers, top_k = own_routing.shape
    replay_spec = BatchSpec(
        seq_len=SEQ_LEN,
        vocab_size=model.args.vocab_size,
        router_replay=True,
        num_moe_layers=num_moe_layers,
        num_experts_per_token=top_k,
        num_experts=model.args.num_experts,
    )

    def step(routed_experts: torch.Tensor | None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        model = load_tiny_model(moe_dir)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        spec = batch_spec(model) if routed_experts is None else replay_spec
        trainer = Trainer(model, optimizer, build_lr_scheduler(optimizer, LRScheduleConfig()), spec=spec, device=CPU)
        before = parameters(model)
        metrics = trainer.train_step([dataclasses.replace(micro_batch, routed_experts=routed_experts)])
        return metrics, _update(before, model)

    own, _ = step(None)
    replayed, replayed_update = step(own_routing.to(torch.uint8))
    # Replaying the model's own choice changes nothing; the router still learns (R3 gathers
    # its scores at the replayed experts).
    assert replayed["loss"] == pytest.approx(own["loss"], rel=1e-5)
    router_updates = [u for name, u in replayed_update.items() if "router" in name]
    assert router_updates and all(u.abs().max() > 0 for u in router_updates)
    # Other experts give another loss: the replayed indices are the ones used.
    shifted = (own_routing + 1) % model.args.num_experts
    assert step(shifted.to(torch.uint8))[0]["loss"] != pytest.approx(own["loss"], rel=1e-3)
    with pytest.raises(InvalidArgument) as excinfo:
        step(own_routing[:, :1].to(torch.uint8))
    assert excinfo.value.field == "micro_batch.routed_experts"


def test_a_vision_language_step_trains_on_the_images(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A micro-batch with images through the batch spec of the tiny Qwen3-VL: its logprobs are the
    model's with those pixels (other pixels give others), and a step updates the language model."""
    from primerl_launcher.tiny_model import (
        IMAGE_TOKEN_ID,
        VIDEO_TOKEN_ID,
        VISION_END_TOKEN_ID,
        VISION_START_TOKEN_ID,
    )
    from primerl_trainer.models import read_hf_config
    from primerl_trainer.runtime import _batch_spec

    vl_dir = make_tiny_model(tmp_path_factory.getbasetemp() / "trainer-tiny-vl", family="qwen3-vl")
    model = load_tiny_model(vl_dir)
    # The trainer service's spec of the checkpoint (its sizes under text_config).
    config = types.SimpleNamespace(seq_len=SEQ_LEN, router_replay=False, publish=PublishConfig())
    spec = _batch_spec(model, read_hf_config(vl_dir), config)
    assert (spec.image_token_id, spec.patches_per_image_token) == (IMAGE_TOKEN_ID, 4)
    micro_batch = one_image_micro_batch()
    input_ids, loss_mask, pixels, grid = (
        micro_batch.input_ids,
        micro_batch.loss_mask,
        micro_batch.pixel_values,
        micro_batch.image_grid_thw,
    )
    num_tokens = input_ids.numel()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    trainer = Trainer(model, optimizer, build_lr_scheduler(optimizer, LRScheduleConfig()), spec=spec, device=CPU)
    logprobs, _ = trainer.token_logprobs(micro_batch)
    with torch.no_grad():
        direct = model(input_ids[None], pixel_values=pixels, image_grid_thw=grid).logits[0]
    # Over the vocabulary without the vision placeholders, which inference never samples.
    placeholders = torch.tensor(spec.unsampled_token_ids)
    assert set(spec.unsampled_token_ids) == {VISION_START_TOKEN_ID, VISION_END_TOKEN_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID}
    without = direct.index_fill(-1, placeholders, float("-inf"))
    expected = token_logprobs(without, input_ids, torch.ones(num_tokens))[0]
    assert torch.allclose(logprobs[loss_mask], expected[loss_mask], atol=1e-5)
    assert (logprobs[loss_mask] - token_logprobs(direct, input_ids, torch.ones(num_tokens))[0][loss_mask]).max() > 1e-3
    other, _ = trainer.token_logprobs(dataclasses.replace(micro_batch, pixel_values=-pixels))
    assert (other - logprobs)[loss_mask].abs().max() > 1e-3
    before = parameters(model)
    trainer.train_step([micro_batch])
    update = _update(before, model)
    assert any(u.abs().max() > 0 for name, u in update.items() if not name.startswith("visual."))
    # The vision tower is frozen by default.
    assert all(u.abs().max() == 0 for name, u in update.items() if name.startswith("visual."))
