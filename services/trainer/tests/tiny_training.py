"""The tiny model and synthetic packed batches for the trainer's tests (imported by them and by
the torchrun worker script)."""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from primerl_launcher.tiny_model import make_tiny_model
from primerl_trainer.batch import BatchSpec, MicroBatch
from primerl_trainer.config import LoRAConfig
from primerl_trainer.lora import apply_lora
from primerl_trainer.models import load_model
from primerl_trainer.optim import LRScheduleConfig, OptimizerConfig, build_lr_scheduler, build_optimizer
from primerl_trainer.runs import RunConfig
from primerl_trainer.train import Trainer

if TYPE_CHECKING:
    import pytest

SEQ_LEN = 128
NUM_BYTE_TOKENS = 256
# The data-parallel test's settings, shared by its torchrun workers and its one-process reference.
DP_OPTIMIZER = OptimizerConfig(lr=1e-3, weight_decay=0.01)
DP_SCHEDULE = LRScheduleConfig(decay="cosine", warmup_steps=1, total_steps=4, min_lr_ratio=0.1)


# How far float32 weights may drift from a one-process run after a few Adam steps of DP_OPTIMIZER:
# ranks sum gradients in another order, and Adam's normalisation g / (|g| + eps) turns that rounding
# into up to lr in the few entries whose gradient nearly cancels, ~1e-5 everywhere else.
ADAM_WEIGHT_ATOL = 1e-4
ADAM_OUTLIER_FRACTION = 1e-4


def assert_weights_match_after_adam(name: str, got: torch.Tensor, wanted: torch.Tensor) -> None:
    """`got` equals `wanted` within ADAM_WEIGHT_ATOL but for at most ADAM_OUTLIER_FRACTION of its
    entries (one in a small tensor), none of which moved more than the learning rate (a wrong split
    moves many)."""
    difference = (got.double() - wanted.double()).abs()
    num_outliers = int((difference > ADAM_WEIGHT_ATOL).sum())
    assert num_outliers <= max(1.0, ADAM_OUTLIER_FRACTION * difference.numel()), (
        f"{name}: {num_outliers} of {difference.numel()} entries differ by more than {ADAM_WEIGHT_ATOL} "
        f"(max {float(difference.max()):.3g})"
    )
    largest = float(difference.max())
    assert largest <= DP_OPTIMIZER.lr, f"{name}: an entry moved {largest:.3g}, more than the learning rate"


def load_tiny_model(model_dir: pathlib.Path) -> torch.nn.Module:
    """The trainer's own Qwen3 implementation (the registry's "auto"), in float32."""
    return load_model(model_dir, impl="auto", dtype=torch.float32)


def batch_spec(model: torch.nn.Module) -> BatchSpec:
    return BatchSpec(seq_len=SEQ_LEN, vocab_size=model.args.vocab_size)


# Every linear layer of the tiny dense model (lora.target_modules' default).
LORA_TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]


def lora_trainer_alone(model_dir: pathlib.Path, config: RunConfig) -> Trainer:
    """The single-run trainer of a LoRA run: apply_lora at its rank and seed, one Trainer."""
    model = load_tiny_model(model_dir)
    lora = LoRAConfig(enabled=True, rank=config.rank, alpha=config.alpha, target_modules=LORA_TARGETS)
    apply_lora(model, lora, seed=config.seed)
    optimizer = build_optimizer(model, config.optimizer)
    return Trainer(
        model,
        optimizer,
        build_lr_scheduler(optimizer, config.schedule),
        spec=batch_spec(model),
        device=torch.device("cpu"),
        mode=config.mode,
        loss_config=config.loss,
        max_grad_norm=config.optimizer.max_grad_norm,
    )


def train_lora_alone(
    model_dir: pathlib.Path, config: RunConfig, batches: list[list[MicroBatch]]
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A LoRA run trained alone, the single-run way: its losses and final LoRA tensors, which a
    run of a RunSet must equal."""
    trainer = lora_trainer_alone(model_dir, config)
    model = trainer.model
    losses = [trainer.train_step(batch)["loss"] for batch in batches]
    adapter = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    return losses, adapter


@dataclass(frozen=True)
class Sample:
    """One rollout: prompt tokens, then the completion the policy sampled (the loss tokens)."""

    prompt: torch.Tensor
    completion: torch.Tensor
    advantage: float
    temperature: float
    inference_logprobs: torch.Tensor  # of the completion tokens

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt, self.completion])


def make_samples(model: torch.nn.Module, *, seed: int, num_samples: int, logprob_noise: float = 0.1) -> list[Sample]:
    """Random byte-token prompts and completions; the inference logprobs are the model's own (each
    sample scored alone, at its temperature) plus Gaussian noise, as an engine's would differ.

    Bytes only: the tiny model's <|endoftext|> embedding row is zero (transformers' init zeroes the
    padding row), and an RMSNorm of a zero vector has a gradient of 1/sqrt(eps), a thousand times
    the others', which would drown every comparison in rounding."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(num_samples):
        prompt_len, completion_len = (int(n) for n in torch.randint(2, 9, (2,), generator=generator))
        prompt = torch.randint(0, NUM_BYTE_TOKENS, (prompt_len,), generator=generator)
        completion = torch.randint(0, NUM_BYTE_TOKENS, (completion_len,), generator=generator)
        temperature = [1.0, 0.7][int(torch.randint(0, 2, (), generator=generator))]
        ids = torch.cat([prompt, completion])
        logprobs = reference_logprobs(model, ids, temperature)[prompt_len:]
        noise = logprob_noise * torch.randn(completion_len, generator=generator)
        samples.append(
            Sample(
                prompt=prompt,
                completion=completion,
                advantage=float(torch.randn((), generator=generator)),
                temperature=temperature,
                inference_logprobs=(logprobs + noise).clamp(max=0.0),
            )
        )
    return samples


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """logprob of each token of one unpacked sample given the ones before it; 0 for the first."""
    logits = model(input_ids[None], torch.arange(len(input_ids))[None]).logits[0].double()
    logprobs = (logits[:-1] / temperature).log_softmax(-1).gather(1, input_ids[1:, None])[:, 0]
    return torch.cat([logprobs.new_zeros(1), logprobs]).float()


def pack(samples: list[Sample]) -> MicroBatch:
    """Samples back to back in one micro-batch, as the orchestrator packs them."""
    input_ids, positions, loss_mask, advantages, inference_logprobs, temperatures = [], [], [], [], [], []
    for sample in samples:
        num_prompt, num_completion = len(sample.prompt), len(sample.completion)
        num_tokens = num_prompt + num_completion
        input_ids.append(sample.input_ids)
        positions.append(torch.arange(num_tokens))
        loss_mask.append(torch.arange(num_tokens) >= num_prompt)
        advantages.append(torch.cat([torch.zeros(num_prompt), torch.full((num_completion,), sample.advantage)]))
        inference_logprobs.append(torch.cat([torch.zeros(num_prompt), sample.inference_logprobs]))
        temperatures.append(torch.full((num_tokens,), sample.temperature))
    return MicroBatch(
        input_ids=torch.cat(input_ids),
        position_ids=torch.cat(positions),
        loss_mask=torch.cat(loss_mask),
        temperatures=torch.cat(temperatures).float(),
        advantages=torch.cat(advantages).float(),
        inference_logprobs=torch.cat(inference_logprobs).float(),
    )


def pack_into(samples: list[Sample], num_micro_batches: int) -> list[MicroBatch]:
    """Split samples into `num_micro_batches` contiguous groups, each packed."""
    bounds = torch.linspace(0, len(samples), num_micro_batches + 1).round().long().tolist()
    return [pack(samples[start:end]) for start, end in itertools.pairwise(bounds)]


def micro_batches_to_dicts(micro_batches: list[MicroBatch]) -> list[dict[str, torch.Tensor | None]]:
    """Plain tensors that torch.save / torch.load(weights_only=True) carry to another process."""
    return [dataclasses.asdict(micro_batch) for micro_batch in micro_batches]


def micro_batches_from_dicts(items: list[dict[str, torch.Tensor | None]]) -> list[MicroBatch]:
    return [MicroBatch(**item) for item in items]


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every parameter, by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The tiny dense float32 model, made once per test session (make_tiny_model is idempotent)."""
    return make_tiny_model(tmp_path_factory.getbasetemp() / "trainer-tiny-dense", kind="dense", dtype="float32")


def runs_batches(
    model_dir: pathlib.Path, modes: dict[str, str], *, num_steps: int
) -> dict[str, list[list[MicroBatch]]]:
    """Each run's own batches (its own task's data): `num_steps` of three samples in two
    micro-batches, as SFT batches (no advantages, temperature 1) for a run whose mode is "sft"."""
    model = load_tiny_model(model_dir)
    out = {}
    with torch.no_grad():
        for index, (run_id, mode) in enumerate(modes.items()):
            run_batches = [
                pack_into(make_samples(model, seed=100 * index + step, num_samples=3), 2) for step in range(num_steps)
            ]
            out[run_id] = [_as_sft(batch) for batch in run_batches] if mode == "sft" else run_batches
    return out


def _as_sft(micro_batches: list[MicroBatch]) -> list[MicroBatch]:
    return [
        dataclasses.replace(mb, advantages=None, inference_logprobs=None, temperatures=torch.ones_like(mb.temperatures))
        for mb in micro_batches
    ]
