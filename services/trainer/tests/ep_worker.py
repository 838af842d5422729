"""Run by test_expert_parallel.py under torchrun: trains the tiny MoE model with expert parallel on
the mesh of ParallelDims(world, ep) (gloo on the CPU, NCCL on GPUs) and has rank 0 save what the
test compares with one process.

    torchrun --standalone --nproc-per-node N ep_worker.py MODEL_DIR BATCHES_FILE OUT_DIR EP

Three steps: two plain ones (checkpointed after the second), then the probe's per-token logprobs
and expert choice with replayed experts, then a third step with router replay. With "resume" in
the batches file, the checkpoint of step 2 is then loaded into the model sharded by plain FSDP over
the same ranks (ep 1), which trains the third step again; with "lora", a LoRA model (experts
adapted) trains the first batch under the same mesh and is published, merged and as an adapter.
"dispatch": DispatchOptions fields for every MoE layer's dispatcher. "fp8": model.fp8's backend
(with model.fp8_weight_grad "model_dtype") for the blocks' products, the experts' included.
"""

import pathlib
import sys

import torch
import torch.distributed as dist
from tiny_training import DP_SCHEDULE, load_tiny_model, micro_batches_from_dicts
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from primerl_trainer.batch import BatchSpec
from primerl_trainer.checkpoint import Checkpointer
from primerl_trainer.config import LoRAConfig
from primerl_trainer.config_types import OptimizerConfig
from primerl_trainer.distributed.expert_parallel import DispatchOptions
from primerl_trainer.distributed.parallel_dims import ParallelDims
from primerl_trainer.export import exported_tensors, gather_state_dict
from primerl_trainer.lora import apply_lora
from primerl_trainer.losses import token_logprobs
from primerl_trainer.models import model_spec_of
from primerl_trainer.models.moe import MoE
from primerl_trainer.optim import build_lr_scheduler, build_optimizer
from primerl_trainer.process_group import init_distributed
from primerl_trainer.train import Trainer


def build_trainer(
    model_dir: pathlib.Path,
    device: torch.device,
    dims: ParallelDims,
    spec: BatchSpec,
    optimizer_config: OptimizerConfig,
    lora: LoRAConfig | None = None,
    compute_dtype: torch.dtype = torch.float32,
    fp8_backend: str | None = None,
) -> Trainer:
    model = load_tiny_model(model_dir).to(device)
    if lora is not None:
        apply_lora(model, lora)
    dims.build_mesh(device.type)
    model_spec_of(model).parallelize_fn(
        model,
        dp_mesh=dims.mesh("dp_shard_cp"),
        ep_mesh=dims.mesh("ep") if dims.ep_enabled else None,
        efsdp_mesh=dims.mesh("efsdp"),
        param_dtype=compute_dtype,
        fp8_backend=fp8_backend,
        fp8_weight_grad="model_dtype",
    )
    optimizer = build_optimizer(model, optimizer_config)
    scheduler = build_lr_scheduler(optimizer, DP_SCHEDULE)
    return Trainer(model, optimizer, scheduler, spec=spec, device=device, dp_group=dims.group("dp_shard"))


def main(model_dir: pathlib.Path, batches_file: pathlib.Path, out_dir: pathlib.Path, ep: int) -> None:
    device = init_distributed()
    world_size = dist.get_world_size()
    data = torch.load(batches_file)
    batches = [micro_batches_from_dicts(batch) for batch in data["batches"]]
    probe = micro_batches_from_dicts([data["probe"]])[0]
    plain_spec, replay_spec = BatchSpec(**data["spec"]), BatchSpec(**data["replay_spec"])
    optimizer_config = OptimizerConfig(**data["optimizer"])
    # float32 as the one-process reference computes, unless the batches file asks for another.
    compute_dtype = getattr(torch, data.get("compute_dtype", "float32"))
    dims = ParallelDims(world_size=world_size, ep=ep)
    fp8 = data.get("fp8")
    trainer = build_trainer(model_dir, device, dims, plain_spec, optimizer_config, None, compute_dtype, fp8)
    trainer.accumulate_unsharded = data.get("accumulate_unsharded", False)
    for module in trainer.model.modules():
        if isinstance(module, MoE):
            module.dispatcher.options = DispatchOptions(**data.get("dispatch", {}))
    checkpointer = Checkpointer(out_dir / "checkpoints", interval=2)
    metrics = []
    for batch in batches[:2]:
        metrics.append(trainer.train_step(batch))
        checkpointer.maybe_save(trainer)

    with torch.no_grad():
        output = trainer.model(
            probe.input_ids[None].to(device),
            probe.position_ids[None].to(device),
            routed_experts=probe.routed_experts.to(device),
        )
        logprobs, _ = token_logprobs(output.logits[0], probe.input_ids.to(device), probe.temperatures.to(device))
    trainer.spec = replay_spec
    metrics.append(trainer.train_step(batches[2]))

    weights = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    is_rank0 = dist.get_rank() == 0
    published = {name: t.cpu() for name, t in gather_state_dict(trainer.model, kind="full", is_destination=is_rank0)}

    resumed_metrics = None
    if data.get("resume"):
        # The ep checkpoint of step 2 into plain FSDP over the same ranks.
        resumed = build_trainer(model_dir, device, ParallelDims(world_size=world_size), replay_spec, optimizer_config)
        assert Checkpointer(out_dir / "checkpoints").load_latest(resumed) == 2
        resumed_metrics = resumed.train_step(batches[2])
    lora = None
    if data.get("lora") is not None:
        # LoRA on the attention and the experts, split over the ep ranks: one step, then what a
        # publish of the merged weights and of the adapter alone sends.
        config = LoRAConfig(**data["lora"])
        dims = ParallelDims(world_size=world_size, ep=ep)
        lora_trainer = build_trainer(model_dir, device, dims, plain_spec, optimizer_config, lora=config)
        lora = {"metrics": lora_trainer.train_step(batches[0])}
        for kind in ("full", "adapter"):
            source = gather_state_dict(lora_trainer.model, kind=kind, is_destination=is_rank0)
            tensors = exported_tensors(
                lora_trainer.model, source, kind=kind, dtype=torch.float32, lora_scale=config.alpha / config.rank
            )
            lora[kind] = {name: t.cpu() for name, t in tensors}
    if is_rank0:
        result = {
            "lora": lora,
            "metrics": metrics,
            "logprobs": logprobs.cpu(),
            "routed_experts": output.routed_experts.cpu(),
            "weights": weights,
            "published": published,
            "resumed_metrics": resumed_metrics,
        }
        torch.save(result, out_dir / "result.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*(pathlib.Path(arg) for arg in sys.argv[1:4]), int(sys.argv[4]))
