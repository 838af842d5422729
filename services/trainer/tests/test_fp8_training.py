"""`model.fp8` on the tiny models, with the "emulated" backend (the FP8 numerics on the CPU): what
converts and what stays, the state dict untouched, logits near (not equal to) the unquantized
ones, training steps that lower the loss, torch.compile of a converted block, and the config
and device errors naming the fields."""

from __future__ import annotations

import copy
import logging
import pathlib
from typing import get_args

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from primerl_common.config import ConfigError, load_config
from primerl_launcher.tiny_model import FAMILIES
from primerl_trainer.batch import BatchSpec, MicroBatch
from primerl_trainer.config import ModelConfig, TrainerConfig
from primerl_trainer.kernels.fp8_linear import FP8_BACKENDS
from primerl_trainer.models import MODEL_SPECS, load_model, model_spec_of
from primerl_trainer.models.common.linear import Fp8Linear
from primerl_trainer.models.common.sparse_attention import LightningIndexer
from primerl_trainer.models.fp8 import convert_to_fp8
from primerl_trainer.models.gpt_oss.model import GptOssExperts
from primerl_trainer.models.moe import GroupedExperts, TokenChoiceTopKRouter
from primerl_trainer.models.nemotron_h.model import Relu2Experts
from primerl_trainer.optim import LRScheduleConfig, OptimizerConfig, build_lr_scheduler, build_optimizer
from primerl_trainer.runtime import build_runtime, shutdown_runtime
from primerl_trainer.train import Trainer

from .serving import trainer_config
from .tiny_training import NUM_BYTE_TOKENS, load_tiny_model

CPU = torch.device("cpu")


@pytest.fixture(params=["dense", "moe"])
def model_dir(request: pytest.FixtureRequest, dense_dir: pathlib.Path, moe_dir: pathlib.Path) -> pathlib.Path:
    return {"dense": dense_dir, "moe": moe_dir}[request.param]


def fp8_model(model_dir: pathlib.Path) -> nn.Module:
    """The tiny model as the trainer builds it with model.fp8 (no FSDP: a CPU process alone)."""
    model = load_tiny_model(model_dir)
    return model_spec_of(model).parallelize_fn(model, fp8_backend="emulated")


def random_row(length: int, *, seed: int) -> torch.Tensor:
    return torch.randint(0, NUM_BYTE_TOKENS, (1, length), generator=torch.Generator().manual_seed(seed))


def test_conversion_keeps_the_state_dict_and_leaves_routers_embedding_and_head(model_dir: pathlib.Path) -> None:
    reference = load_tiny_model(model_dir)
    model = fp8_model(model_dir)

    state, reference_state = model.state_dict(), reference.state_dict()
    assert state.keys() == reference_state.keys()
    assert all(torch.equal(state[key], reference_state[key]) for key in state)
    for name, module in model.named_modules():
        if isinstance(module, TokenChoiceTopKRouter):
            assert type(module.gate) is nn.Linear, name
        elif isinstance(module, GroupedExperts):
            assert module.fp8_backend == "emulated", name
        elif isinstance(module, nn.Linear) and name.startswith("layers.") and ".router." not in name:
            assert isinstance(module, Fp8Linear) and module.fp8_backend == "emulated", name
    assert type(model.tok_embeddings) is nn.Embedding
    assert model.lm_head is None or type(model.lm_head) is nn.Linear
    converted = [name for name, module in model.named_modules() if isinstance(module, Fp8Linear)]
    # q, k, v, o of every layer, and the dense layers' gate, up, down
    per_layer = 4 if model.args.__class__.__name__.endswith("MoeModelArgs") else 7
    assert len(converted) == per_layer * model.args.num_layers


def test_logits_are_near_the_unquantized_ones_but_not_equal(model_dir: pathlib.Path) -> None:
    reference = load_tiny_model(model_dir)
    bf16 = load_model(model_dir, impl="auto", dtype=torch.bfloat16)
    model = fp8_model(model_dir)
    input_ids = random_row(48, seed=0)
    with torch.no_grad():
        wanted = reference(input_ids)
        # The reference's experts, so that the comparison sees rounding, not routing flips.
        replay = {} if wanted.routed_experts is None else {"routed_experts": wanted.routed_experts}
        errors = {
            name: float((m(input_ids, **replay).logits.float() - wanted.logits).norm() / wanted.logits.norm())
            for name, m in (("bf16", bf16), ("fp8", model))
        }
    # The tiny models' large weights (init 0.1) let rounding grow through the layers: bf16 ends
    # ~2% off; e4m3's 3 mantissa bits (bf16 has 7) ~20% with these models.
    assert 3 * errors["bf16"] < errors["fp8"] < 0.3, errors


def test_training_steps_in_fp8_lower_the_loss(model_dir: pathlib.Path) -> None:
    model = fp8_model(model_dir)
    optimizer = build_optimizer(model, OptimizerConfig(lr=3e-3, weight_decay=0.0))
    trainer = Trainer(
        model,
        optimizer,
        build_lr_scheduler(optimizer, LRScheduleConfig()),
        spec=BatchSpec(seq_len=128, vocab_size=model.args.vocab_size),
        device=CPU,
        mode="sft",
    )
    # One learnable row: a short pattern repeated, the loss on every token after the first.
    input_ids = random_row(8, seed=1).repeat(1, 3)[0]
    batch = [
        MicroBatch(
            input_ids=input_ids,
            position_ids=torch.arange(input_ids.numel()),
            loss_mask=torch.arange(input_ids.numel()) > 0,
            temperatures=torch.ones(input_ids.numel()),
        )
    ]
    losses = [trainer.train_step(batch)["loss"] for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < 0.9 * losses[0], losses
    # the weights trained are the model's own parameters, still in FP8 layers
    assert any(isinstance(module, Fp8Linear) for module in model.modules())


def test_a_compiled_block_keeps_the_fp8_products_whole(moe_dir: pathlib.Path) -> None:
    """fullgraph: the FP8 products (and the experts' loop over host-side sizes) are custom ops."""
    model = fp8_model(moe_dir)
    eager = copy.deepcopy(model.layers["0"])
    compiled = torch.compile(model.layers["0"], fullgraph=True, backend="aot_eager")
    input_ids = random_row(32, seed=2)
    h, rope, mask = model.embed(input_ids, None)
    h = h.detach().requires_grad_()
    results = []
    for block in (eager, compiled):
        out = block(h, rope, mask)[0]
        (grad,) = torch.autograd.grad(out.square().sum(), h)
        results.append((out, grad))
    torch.testing.assert_close(results[1], results[0])


def test_fsdp2_and_activation_checkpointing_keep_the_fp8_forward_and_gradients(dense_dir: pathlib.Path) -> None:
    """One CPU rank (gloo), as the trainer runs alone: the same products, so the same numbers, and
    the same parameter names under the checkpoint wrapper."""
    reference = fp8_model(dense_dir)
    model = load_tiny_model(dense_dir)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model_spec_of(model).parallelize_fn(
            model,
            dp_mesh=init_device_mesh("cpu", (1,)),
            param_dtype=None,
            activation_checkpointing=True,
            fp8_backend="emulated",
        )
        input_ids = random_row(16, seed=3)
        expected, actual = reference(input_ids).logits, model(input_ids).logits
        assert torch.equal(actual, expected)
        expected.square().mean().backward()
        actual.square().mean().backward()
        grads = {name: p.grad for name, p in reference.named_parameters()}
        for name, param in model.named_parameters():
            name = name.replace("_checkpoint_wrapped_module.", "")
            torch.testing.assert_close(param.grad.full_tensor(), grads[name], rtol=1e-5, atol=1e-6, msg=name)
        assert any(isinstance(module, Fp8Linear) for module in model.modules())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_converts_all_but_its_routers_indexers_and_unaligned_layers(family: str) -> None:
    """Each family's tiny shape, built on the meta device (the conversion reads shapes only)."""
    config = FAMILIES[family].config_dict("float32")
    spec = MODEL_SPECS[config["model_type"]]
    with torch.device("meta"):
        model = spec.model_cls(spec.args_cls.from_hf_config(config))
    conversion = convert_to_fp8(model.layers, backend="emulated", device="cpu")

    kept_roots = [
        name for name, m in model.layers.named_modules() if isinstance(m, (TokenChoiceTopKRouter, LightningIndexer))
    ]
    for name, module in model.layers.named_modules():
        kept = any(name.startswith(root + ".") for root in kept_roots)
        if isinstance(module, GroupedExperts):
            assert module.fp8_backend == "emulated", name
        elif isinstance(module, nn.Linear):
            fp8 = isinstance(module, Fp8Linear)
            assert fp8 == (not kept and name not in conversion.unaligned), name
    assert conversion.linears and set(conversion.unaligned) <= {
        name for name, m in model.layers.named_modules() if isinstance(m, nn.Linear)
    }
    assert all(
        any(size % 16 for size in (m.in_features, m.out_features))
        for name, m in model.layers.named_modules()
        if name in conversion.unaligned
    )


@pytest.mark.parametrize("experts_cls", ["gpt_oss", "relu2"])
def test_experts_with_their_own_forward_run_their_products_in_fp8(experts_cls: str) -> None:
    """GPT-OSS's biased experts and Nemotron-H's non-gated ones go through the same FP8 products."""
    generator = torch.Generator().manual_seed(4)
    if experts_cls == "gpt_oss":
        experts = GptOssExperts(dim=64, hidden_dim=32, num_experts=3, alpha=1.702, limit=7.0)
    else:
        experts = Relu2Experts(dim=64, hidden_dim=32, num_experts=3)
    for param in experts.parameters():
        param.data = torch.randn(param.shape, generator=generator) * 0.2
    x = torch.randn(20, 64, generator=generator)
    offsets = torch.tensor([7, 7, 20], dtype=torch.int32)  # the middle expert gets no rows
    wanted = experts(x, offsets)
    experts.fp8_backend = "emulated"
    got = experts(x, offsets)
    relative = float((got - wanted).detach().norm() / wanted.detach().norm())
    assert 1e-3 < relative < 0.1, relative
    got.square().sum().backward()
    assert experts.w13.grad[1].abs().max() == 0 and experts.w13.grad[0].abs().max() > 0


def test_unaligned_layers_keep_their_dtype_and_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    blocks = nn.ModuleDict({"0": nn.ModuleDict({"aligned": nn.Linear(64, 32), "narrow": nn.Linear(64, 1)})})
    with caplog.at_level(logging.INFO, logger="primerl_trainer.models.fp8"):
        conversion = convert_to_fp8(blocks, backend="emulated", device="cpu")
    assert conversion.linears == ("0.aligned",) and conversion.unaligned == ("0.narrow",)
    assert type(blocks["0"]["narrow"]) is nn.Linear and isinstance(blocks["0"]["aligned"], Fp8Linear)
    assert "0.narrow" in caplog.text


def test_scaled_mm_on_the_cpu_is_refused_when_the_model_is_built_naming_model_fp8(dense_dir: pathlib.Path) -> None:
    model = load_tiny_model(dense_dir)
    with pytest.raises(ValueError, match=r"model\.fp8"):
        model_spec_of(model).parallelize_fn(model, fp8_backend="scaled_mm")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model.fp8", "true", "--model.impl", "hf"], r"model\.fp8 needs the own model implementation.*'hf'"),
        (["--model.fp8", "true", "--lora.enabled", "true"], r"model\.fp8 with lora\.enabled is not supported yet"),
        (["--model.fp8", "true", "--device", "cpu"], r"model\.fp8 with model\.fp8_backend 'scaled_mm'.*device 'cpu'"),
        (["--model.fp8_backend", "triton"], r"model\.fp8_backend"),
        (
            ["--model.fp8", "true", "--model.fp8_backend", "deep_gemm", "--device", "cpu"],
            r"model\.fp8 with model\.fp8_backend 'deep_gemm'.*device 'cpu'",
        ),
        (["--model.fp8_weight_cache", "true"], r"model\.fp8_weight_cache.*needs model\.fp8 true"),
        (["--model.fp8_weight_grad", "model_dtype"], r"model\.fp8_weight_grad.*needs model\.fp8 true"),
        (["--model.fp8", "true", "--model.fp8_weight_grad", "bf16"], r"model\.fp8_weight_grad"),
    ],
)
def test_unusable_fp8_configs_are_refused_naming_the_fields(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(TrainerConfig, ["--model.path", "m", *argv])


def test_fp8_configs_that_can_work_load() -> None:
    emulated = load_config(TrainerConfig, ["--model.path", "m", "--model.fp8", "true", "--device", "cpu",
                                           "--model.fp8_backend", "emulated"])  # fmt: skip
    assert emulated.model.fp8 and emulated.model.fp8_backend == "emulated"
    assert load_config(TrainerConfig, ["--model.path", "m", "--model.fp8", "true"]).model.fp8_backend == "scaled_mm"
    # the config's choices are the kernels' (config.py stays torch-free, so it spells them out)
    assert get_args(ModelConfig.model_fields["fp8_backend"].annotation) == FP8_BACKENDS


def test_the_trainer_built_with_model_fp8_runs_its_blocks_in_fp8_and_trains(
    dense_dir: pathlib.Path, rl_batches: list[list[MicroBatch]]
) -> None:
    """The config reaches the model: build_runtime (FSDP2 on one rank) converts the blocks, and a
    train step runs through them."""
    runtime = build_runtime(trainer_config(dense_dir, model={"fp8": True, "fp8_backend": "emulated"}))
    try:
        converted = [m for m in runtime.trainer.model.modules() if isinstance(m, Fp8Linear)]
        metrics = runtime.trainer.train_step(rl_batches[0])
    finally:
        shutdown_runtime(runtime)
    assert converted and all(m.fp8_backend == "emulated" for m in converted)
    assert torch.isfinite(torch.tensor(metrics["loss"]))
