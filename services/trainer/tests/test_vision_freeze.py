"""model.train_vision_encoder: the trainer built from its config (FSDP2 on one CPU rank) takes an RL
step on a micro-batch with one image through the tiny Qwen3-VL. By default the vision encoder is
frozen (bit-identical, no gradient, no optimizer state; published as loaded) while the language
model trains, its gradient flowing through the image tokens; asked for, the encoder trains too.
LoRA with a trained encoder, and a trained encoder on a text model, are refused naming the fields."""

import dataclasses
import pathlib

import pytest
import torch
from pydantic import ValidationError
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from primerl_launcher.tiny_model import IMAGE_TOKEN_ID, VISION_END_TOKEN_ID, VISION_START_TOKEN_ID, make_tiny_model
from primerl_trainer.batch import MicroBatch
from primerl_trainer.checkpoint import TrainedParametersChanged
from primerl_trainer.export import exported_tensors, gather_state_dict
from primerl_trainer.models import read_hf_state_dict
from primerl_trainer.runtime import TrainingRuntime, build_runtime, shutdown_runtime

from .serving import trainer_config

# One sample: text, a 4x4-patch image (2x2 patches merge into one of its 4 tokens), text, and a
# completion of the last 4 tokens.
PROMPT = [7, 8, VISION_START_TOKEN_ID, *[IMAGE_TOKEN_ID] * 4, VISION_END_TOKEN_ID, 9, 10]
INPUT_IDS = torch.tensor([*PROMPT, 11, 12, 13, 14])


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_tiny_model(tmp_path_factory.getbasetemp() / "trainer-tiny-vl", family="qwen3-vl")


def one_image_micro_batch() -> MicroBatch:
    """The sample with random pixels, advantage 1 on its completion, inference logprobs 0."""
    num_tokens = INPUT_IDS.numel()
    loss_mask = torch.arange(num_tokens) >= len(PROMPT)
    return MicroBatch(
        input_ids=INPUT_IDS,
        position_ids=torch.arange(num_tokens),
        loss_mask=loss_mask,
        temperatures=torch.ones(num_tokens),
        advantages=torch.where(loss_mask, 1.0, 0.0),
        inference_logprobs=torch.zeros(num_tokens),
        pixel_values=torch.randn(16, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(0)),
        image_grid_thw=torch.tensor([[1, 4, 4]]),
    )


def image_micro_batch(runtime: TrainingRuntime) -> MicroBatch:
    """The sample, scored on policy by the runtime's model."""
    micro_batch = one_image_micro_batch()
    logprobs, _ = runtime.trainer.token_logprobs(micro_batch)
    return dataclasses.replace(micro_batch, inference_logprobs=logprobs.detach())


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def is_vision(name: str) -> bool:
    return name.startswith("visual.")


def test_the_vision_encoder_is_frozen_by_default_and_the_language_model_trains_through_the_images(
    vl_dir: pathlib.Path,
) -> None:
    runtime = build_runtime(trainer_config(vl_dir))
    try:
        model, optimizer = runtime.trainer.model, runtime.trainer.optimizer
        assert isinstance(model.visual, FSDPModule)  # a unit of its own, gathered for its forward alone
        micro_batch = image_micro_batch(runtime)
        # The gradient of the first block's input: at the image tokens, what the vision encoder's
        # features would get (they are the input there).
        first_block_input_grads = []

        def keep_input_grad(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            args[0].register_hook(first_block_input_grads.append)

        model.layers["0"].register_forward_pre_hook(keep_input_grad)
        before = weights(model)
        metrics = runtime.trainer.train_step([micro_batch])
        after = weights(model)
        optimized = {p for group in optimizer.param_groups for p in group["params"]}
        parameters = dict(model.named_parameters())
        published = dict(
            exported_tensors(
                model,
                gather_state_dict(model, kind="full", is_destination=True),
                kind="full",
                dtype=torch.float32,
                lora_scale=None,
            )
        )
    finally:
        shutdown_runtime(runtime)

    assert metrics["loss"] != 0
    vision = [name for name in parameters if is_vision(name)]
    assert vision and len(vision) < len(parameters)
    for name in vision:
        param = parameters[name]
        assert not param.requires_grad and param.grad is None, name
        assert param not in optimized and param not in optimizer.state, name
        assert torch.equal(after[name], before[name]), name
    language_model = [name for name in parameters if not is_vision(name)]
    assert all(parameters[name] in optimizer.state for name in language_model)
    assert any(not torch.equal(after[name], before[name]) for name in language_model)
    (grad,) = first_block_input_grads
    image_tokens = INPUT_IDS == IMAGE_TOKEN_ID
    assert grad[0, image_tokens].abs().amax(-1).min() > 0
    # Inference gets the whole model: every checkpoint tensor, the vision encoder's as loaded.
    checkpoint = read_hf_state_dict(vl_dir)
    assert published.keys() == checkpoint.keys()
    vision_tensors = [name for name in checkpoint if ".visual." in name]
    assert vision_tensors and all(torch.equal(published[name], checkpoint[name]) for name in vision_tensors)


def test_train_vision_encoder_trains_the_vision_encoder(vl_dir: pathlib.Path) -> None:
    runtime = build_runtime(trainer_config(vl_dir, model={"train_vision_encoder": True}))
    try:
        model = runtime.trainer.model
        micro_batch = image_micro_batch(runtime)
        before = weights(model)
        runtime.trainer.train_step([micro_batch])
        after = weights(model)
        optimizer_state = runtime.trainer.optimizer.state
        vision = {name: p for name, p in model.named_parameters() if is_vision(name)}
    finally:
        shutdown_runtime(runtime)
    assert vision and all(p.requires_grad and p in optimizer_state for p in vision.values())
    assert [name for name in vision if torch.equal(after[name], before[name])] == []


def test_lora_with_a_trained_vision_encoder_is_refused_naming_both_fields() -> None:
    with pytest.raises(ValidationError, match=r"model\.train_vision_encoder with lora\.enabled"):
        trainer_config(pathlib.Path("m"), model={"train_vision_encoder": True}, lora={"enabled": True})
    assert trainer_config(pathlib.Path("m"), lora={"enabled": True}).lora.enabled


def test_train_vision_encoder_on_a_text_model_is_refused_naming_the_field(dense_dir: pathlib.Path) -> None:
    with pytest.raises(ValueError, match=r"model\.train_vision_encoder: .* has no vision encoder"):
        build_runtime(trainer_config(dense_dir, model={"train_vision_encoder": True}))


def test_resuming_with_the_encoder_trained_when_it_was_frozen_is_refused_naming_the_setting(
    vl_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    checkpoint = {"dir": str(tmp_path / "checkpoints"), "interval": 1}
    runtime = build_runtime(trainer_config(vl_dir, checkpoint=checkpoint))
    try:
        runtime.trainer.train_step([image_micro_batch(runtime)])
        assert runtime.checkpointer is not None
        runtime.checkpointer.save(runtime.trainer)
    finally:
        shutdown_runtime(runtime)
    # The same settings resume; a trained encoder would need AdamW state the checkpoint lacks.
    resumed = build_runtime(trainer_config(vl_dir, checkpoint=checkpoint))
    try:
        assert resumed.restored_step == 1
    finally:
        shutdown_runtime(resumed)
    with pytest.raises(TrainedParametersChanged, match=r"57 trained now and not then.*model\.train_vision_encoder"):
        build_runtime(trainer_config(vl_dir, checkpoint=checkpoint, model={"train_vision_encoder": True}))
