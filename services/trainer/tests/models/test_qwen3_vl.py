"""Own Qwen3-VL and Qwen3-VL-MoE against transformers' Qwen3VL(Moe)ForConditionalGeneration on the
tiny-model maker's checkpoints (float32): prompts with one image and with three of different sizes,
text alone, packed samples with images; the image-token checks, the state-dict round trip, the
frozen (or trainable) vision tower, router replay and FSDP on one CPU rank. Images are random
pixel values."""

import dataclasses
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from primerl_launcher.tiny_model import IMAGE_TOKEN_ID, VISION_END_TOKEN_ID, VISION_START_TOKEN_ID, make_tiny_model
from primerl_trainer.models import load_model, model_spec_of
from primerl_trainer.models.qwen3_vl.model import Qwen3VLModel, Qwen3VLMoeModel
from primerl_trainer.models.qwen3_vl.positions import mrope_position_ids

from .hf_parity import assert_hf_round_trip_is_bit_exact, assert_sharded_model_matches

TOLERANCE = 1e-4
FAMILIES = {"qwen3-vl": Qwen3VLModel, "qwen3-vl-moe": Qwen3VLMoeModel}
# (t, h, w) patch grids; 2 x 2 patches merge into one image token.
ONE_IMAGE = [(1, 4, 4)]
THREE_IMAGES = [(1, 4, 4), (1, 2, 6), (1, 6, 4)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(family: str, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_tiny_model(tmp_path_factory.mktemp(family) / "model", family=family)


@pytest.fixture(scope="module")
def models(checkpoint: pathlib.Path) -> tuple[nn.Module, nn.Module]:
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="sdpa")
    return load_model(checkpoint, impl="auto"), hf.eval()


def image_prompt(grids: list[tuple[int, int, int]], *, seed: int = 0) -> dict[str, torch.Tensor]:
    """A row of text with each image of `grids` between vision start and end tokens, and the
    images' random pixel values: input_ids [1, T], pixel_values, image_grid_thw."""
    generator = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for t, h, w in grids:
        ids += torch.randint(0, 256, (5,), generator=generator).tolist()
        ids += [VISION_START_TOKEN_ID, *[IMAGE_TOKEN_ID] * (t * h * w // 4), VISION_END_TOKEN_ID]
    ids += torch.randint(0, 256, (7,), generator=generator).tolist()
    grid_thw = torch.tensor(grids)
    # 3 channels x 2 frames x 16 x 16 pixels per patch.
    pixel_values = torch.randn(int(grid_thw.prod(-1).sum()), 3 * 2 * 16 * 16, generator=generator)
    return {"input_ids": torch.tensor([ids]), "pixel_values": pixel_values, "image_grid_thw": grid_thw}


def reference_forward(hf: nn.Module, **inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' logits and (MoE) the experts its routers chose [B*T, MoE layers, K], sorted."""
    chosen = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda module, args, out: chosen.append(out[2]))
        for layer in hf.model.language_model.layers
        if hasattr(layer.mlp, "experts")
    ]
    mm_token_type_ids = (inputs["input_ids"] == IMAGE_TOKEN_ID).int()
    try:
        logits = hf(**inputs, mm_token_type_ids=mm_token_type_ids, use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
    return logits, torch.stack(chosen, dim=1).sort(dim=-1).values if chosen else None


def assert_matches(out, logits: torch.Tensor, expert_ids: torch.Tensor | None) -> None:
    """The own output's logits within TOLERANCE of `logits`, and (MoE) the same experts."""
    error = (out.logits - logits).abs().max().item()
    assert error <= TOLERANCE, error
    if expert_ids is None:
        assert out.routed_experts is None
    else:
        assert torch.equal(out.routed_experts.sort(dim=-1).values, expert_ids)


@pytest.mark.parametrize("grids", [ONE_IMAGE, THREE_IMAGES], ids=["one-image", "three-images"])
@torch.no_grad()
def test_logits_and_routing_equal_transformers_with_images(models, family: str, grids) -> None:
    own, hf = models
    assert type(own) is FAMILIES[family]
    inputs = image_prompt(grids)
    reference = reference_forward(hf, **inputs)
    assert_matches(own(**inputs), *reference)
    # The 3-D positions are transformers' get_rope_index's; given, they give the same logits.
    input_ids, grid_thw = inputs["input_ids"], inputs["image_grid_thw"]
    positions = mrope_position_ids(
        input_ids, None, grid_thw, image_token_id=IMAGE_TOKEN_ID, spatial_merge_size=own.args.vision.spatial_merge_size
    )
    hf_positions, _ = hf.model.get_rope_index(input_ids, (input_ids == IMAGE_TOKEN_ID).int(), grid_thw)
    assert torch.equal(positions, hf_positions)
    assert_matches(own(**inputs, position_ids=positions), *reference)
    # The images count: other pixels give other logits.
    other = own(**(inputs | {"pixel_values": torch.randn_like(inputs["pixel_values"])}))
    assert (other.logits - own(**inputs).logits).abs().max() > 100 * TOLERANCE


@torch.no_grad()
def test_text_alone_equals_transformers_with_1d_or_3d_position_ids(models) -> None:
    own, hf = models
    input_ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    logits, expert_ids = reference_forward(hf, input_ids=input_ids)
    assert_matches(own(input_ids), logits, expert_ids)
    positions = torch.arange(20).expand(2, 20)
    assert_matches(own(input_ids, positions), logits, expert_ids)
    assert_matches(own(input_ids, positions.expand(3, 2, 20)), logits, expert_ids)


@torch.no_grad()
def test_packed_samples_with_images_equal_separate_runs(models) -> None:
    """Two prompts with images packed in one row (position ids restarting): each sample's 3-D
    positions start afresh, and the logits equal transformers' run of each sample alone."""
    own, hf = models
    samples = [image_prompt(ONE_IMAGE, seed=2), image_prompt(THREE_IMAGES[1:], seed=3)]
    input_ids = torch.cat([sample["input_ids"] for sample in samples], dim=1)
    position_ids = torch.cat([torch.arange(sample["input_ids"].shape[1]) for sample in samples])[None]
    packed = own(
        input_ids,
        position_ids,
        pixel_values=torch.cat([sample["pixel_values"] for sample in samples]),
        image_grid_thw=torch.cat([sample["image_grid_thw"] for sample in samples]),
    )
    separate = [reference_forward(hf, **sample) for sample in samples]
    expert_ids = None if separate[0][1] is None else torch.cat([ids for _, ids in separate])
    assert_matches(packed, torch.cat([logits for logits, _ in separate], dim=1), expert_ids)


def test_image_tokens_that_do_not_match_the_features_raise(models) -> None:
    own, _ = models
    inputs = image_prompt(ONE_IMAGE)
    input_ids = inputs["input_ids"]
    image_start = int((input_ids[0] == IMAGE_TOKEN_ID).nonzero()[0])
    fewer = torch.cat([input_ids[:, :image_start], input_ids[:, image_start + 1 :]], dim=1)
    with pytest.raises(ValueError, match=r"holds 3 image tokens .* give 4 features"):
        own(**(inputs | {"input_ids": fewer}))
    with pytest.raises(ValueError, match=r"holds 4 image tokens but no pixel_values"):
        own(input_ids)
    with pytest.raises(ValueError, match=r"give both or neither"):
        own(input_ids, pixel_values=inputs["pixel_values"])


def test_hf_to_own_to_hf_is_bit_exact(checkpoint: pathlib.Path) -> None:
    assert_hf_round_trip_is_bit_exact(checkpoint)


def test_transformers_impl_is_refused_naming_the_field(checkpoint: pathlib.Path) -> None:
    # The transformers wrapper runs causal LMs and would drop the images.
    with pytest.raises(ValueError, match=r"model.impl 'hf' runs text models"):
        load_model(checkpoint, impl="hf")


@pytest.mark.parametrize("train_vision", [False, True], ids=["frozen", "trained"])
def test_vision_tower_is_frozen_unless_asked(checkpoint: pathlib.Path, family: str, train_vision: bool) -> None:
    """By default the vision tower's parameters take no gradient (the language model's do);
    with `train_vision` every one of them gets one."""
    loaded = load_model(checkpoint, impl="custom")
    model = FAMILIES[family](dataclasses.replace(loaded.args, train_vision=train_vision))
    model.load_state_dict(loaded.state_dict())
    inputs = image_prompt(THREE_IMAGES)
    logits = model(**inputs).logits
    F.cross_entropy(logits[0, :-1], inputs["input_ids"][0, 1:]).backward()
    for name, param in model.named_parameters():
        if name.startswith("visual."):
            assert param.requires_grad == train_vision, name
            assert (param.grad is not None and param.grad.abs().sum() > 0) == train_vision, name
        else:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
    assert all(not p.requires_grad for p in loaded.visual.parameters())


@pytest.mark.parametrize("family", ["qwen3-vl-moe"], indirect=True)
@torch.no_grad()
def test_replayed_routing_reproduces_the_recorded_experts(models) -> None:
    """Replaying transformers' routing of a prompt with images (as uint8, inference's dtype) gives
    its experts and logits; replaying the own routing gives identical logits."""
    own, hf = models
    inputs = image_prompt(THREE_IMAGES, seed=4)
    logits, expert_ids = reference_forward(hf, **inputs)
    replayed = own(**inputs, routed_experts=expert_ids.to(torch.uint8))
    assert torch.equal(replayed.routed_experts, expert_ids)
    assert (replayed.logits - logits).abs().max() <= TOLERANCE
    free = own(**inputs)
    again = own(**inputs, routed_experts=free.routed_experts.to(torch.uint8))
    assert torch.equal(again.logits, free.logits) and torch.equal(again.routed_experts, free.routed_experts)


@pytest.fixture
def mesh():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_fsdp_and_activation_checkpointing_keep_forward_and_gradients(
    checkpoint: pathlib.Path, family: str, mesh
) -> None:
    """parallelize_fn on one CPU rank (gloo), with a trained vision tower (sharded with the root):
    the same logits, gradients and exported names."""
    loaded = load_model(checkpoint, impl="custom")
    reference, model = (FAMILIES[family](dataclasses.replace(loaded.args, train_vision=True)) for _ in range(2))
    for copy in (reference, model):
        copy.load_state_dict(loaded.state_dict())
    model_spec_of(model).parallelize_fn(model, dp_mesh=mesh, param_dtype=None, activation_checkpointing=True)
    assert_sharded_model_matches(reference, model, image_prompt(THREE_IMAGES, seed=5), checkpoint)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.gpu
def test_on_cuda_float32_equals_transformers_and_bf16_is_as_close_as_transformers_bf16(
    checkpoint: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three images on CUDA: float32 logits (and experts) within TOLERANCE of transformers'; in
    bfloat16 (the GPU training dtype) the own logits no further from the float32 ones than
    transformers' bfloat16 logits, and every gradient finite."""
    from transformers import AutoModelForImageTextToText

    # transformers embeds patches with a Conv3d, which cuDNN runs in TF32 by default.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    inputs = {name: tensor.cuda() for name, tensor in image_prompt(THREE_IMAGES, seed=7).items()}
    hf = {
        dtype: AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=dtype, attn_implementation="sdpa")
        .cuda()
        .eval()
        for dtype in (torch.float32, torch.bfloat16)
    }
    with torch.no_grad():
        expected, expert_ids = reference_forward(hf[torch.float32], **inputs)
        assert_matches(load_model(checkpoint, impl="auto", device="cuda")(**inputs), expected, expert_ids)
        bf16_inputs = inputs | {"pixel_values": inputs["pixel_values"].to(torch.bfloat16)}
        hf_error = relative_error(reference_forward(hf[torch.bfloat16], **bf16_inputs)[0], expected)
    own = load_model(checkpoint, impl="auto", dtype=torch.bfloat16, device="cuda").requires_grad_(True)
    logits = own(**bf16_inputs).logits
    own_error = relative_error(logits, expected)
    print(f"bf16 logits' relative error to float32: own {own_error:.3e}, transformers {hf_error:.3e}")
    assert own_error <= 1.5 * hf_error + 1e-3, (own_error, hf_error)
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in own.parameters())
