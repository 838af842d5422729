"""LoRA for the own models: low-rank updates of chosen weights, trained while the rest is frozen.

Each adapted weight W becomes W + (alpha / rank) * B @ A through a `torch.nn.utils.parametrize`
parametrization, so the models keep reading `self.wq.weight` (they concatenate q, k and v
weights, and gate and up, into one product) and see the adapted weight. The parametrization
moves W to `<module>.parametrizations.<param>.original` and holds A and B beside it, as plain
parameters FSDP2 shards like any other. A starts random (PEFT's init), B at zero: the adapted
model starts equal to the base.

Targets (`LoRAConfig.target_modules`), by module:
    q, k, v, o        attention.wq / wk / wv / wo               (HF q_proj, k_proj, v_proj, o_proj)
    g                 attention.wg, the attention's output gate (AFMoE's self_attn.gate_proj,
                      Laguna's self_attn.g_proj)
    gate, up, down    feed_forward.w1 / w3 / w2 of dense layers and shared_experts.w1 / w3 / w2
                      of MoE layers with shared experts (GLM-4.5), as PEFT's gate_proj, up_proj and
                      down_proj match both (HF mlp.gate_proj, mlp.shared_experts.gate_proj, ...)
    experts           moe.experts.w13 (gate and up of each expert) and w2 (down), one A and B
                      per expert and projection, as PEFT names them per expert; experts whose
                      checkpoint fuses gate and up (GPT-OSS: `lora_fused_gate_up`) get one A
                      and B for both, PEFT's 3D layout of fused experts (as vLLM reads it)
    in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj
                      the Gated DeltaNet layers' projections (Qwen3.5: attention.<name>, HF
                      linear_attn.<name>)
    in_proj, out_proj the Mamba-2 layers' projections (Nemotron-H: attention.<name>, HF
                      mixer.<name>); up, down also adapt its dense and shared-expert MLPs and
                      experts adapts its non-gated experts (`gated` False: up and down)
    q_a, q_b, kv_a, kv_b
                      multi-head latent attention's low-rank projections (GLM-5: attention.wq_a,
                      wq_b, wkv_a, wkv_b; HF self_attn.q_a_proj, q_b_proj, kv_a_proj_with_mqa,
                      kv_b_proj; its output projection is o); the sparse-attention indexers are frozen
The routers stay frozen and untouched. Unknown names are ignored with a warning.

Several runs on one model (runs.py): the modules are built at the largest rank of any run, and a
run's step sets each module's `scale` and `active_rank` (the rank of the run, whose A and B are the
leading rows and columns; `initial_lora_tensors` gives a run's zero-padded start).

Export: `merge_lora` turns a stream of (own name, full tensor) from the model's state dict into
merged weights under the base names; `lora_adapter_tensors` into the adapter alone under PEFT's
names (`base_model.model.<HF module>.lora_A.weight` [rank, in], `lora_B.weight` [out, rank]).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.utils import parametrize

from primerl_trainer.models import HFCausalLM
from primerl_trainer.models.moe import GroupedExperts

if TYPE_CHECKING:
    from primerl_trainer.config import LoRAConfig

__all__ = [
    "LINEAR_TARGETS",
    "TARGETS",
    "ExpertsLoRA",
    "LinearLoRA",
    "apply_lora",
    "initial_lora_tensors",
    "is_lora_key",
    "lora_adapter_tensors",
    "lora_parametrizations",
    "merge_lora",
]

logger = logging.getLogger(__name__)

# Target name -> the module path suffixes of the nn.Linear layers it adapts.
LINEAR_TARGETS = {
    "q": ("attention.wq",),
    "k": ("attention.wk",),
    "v": ("attention.wv",),
    "o": ("attention.wo",),
    "g": ("attention.wg",),
    "gate": ("feed_forward.w1", "shared_experts.w1"),
    "up": ("feed_forward.w3", "shared_experts.w3"),
    "down": ("feed_forward.w2", "shared_experts.w2"),
    **{name: (f"attention.{name}",) for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")},
    "in_proj": ("attention.in_proj",),
    **{name: (f"attention.w{name}",) for name in ("q_a", "q_b", "kv_a", "kv_b")},
}
TARGETS = (*LINEAR_TARGETS, "experts")
_HF_ALIASES = {f"{name}_proj": name for name in LINEAR_TARGETS} | {"kv_a_proj_with_mqa": "kv_a"}
# <module>.parametrizations.<param>.original, or .0.<lora parameter>
_PARAMETRIZED = re.compile(r"(?P<module>.+)\.parametrizations\.(?P<param>[^.]+)\.(?:original|0\.(?P<lora>[^.]+))")
_HF_EXPERT = re.compile(
    r"(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
)
# Fused expert stacks (GPT-OSS): one tensor per layer and projection.
_HF_FUSED_EXPERTS = re.compile(r"(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)")
# Mixtral-style checkpoints (MiniMax-M2) name an expert's projections w1 (gate), w3 (up), w2 (down).
_MIXTRAL_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class LinearLoRA(nn.Module):
    """Parametrization W [out, in] -> W + scale * B @ A, A [rank, in], B [out, rank] (their first
    `active_rank` rows and columns when it is set)."""

    def __init__(
        self,
        out_features: int,
        in_features: int,
        *,
        rank: int,
        alpha: float,
        generator: torch.Generator,
        like: torch.Tensor,
    ) -> None:
        super().__init__()
        self.scale = alpha / rank
        # Multi-tenant runs (runs.py): the rank of the run being trained, whose A and B are the first
        # rows and columns of these (the rest zero); None: all of them.
        self.active_rank: int | None = None
        self.lora_A = nn.Parameter(_kaiming_uniform((rank, in_features), generator=generator, like=like))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, dtype=like.dtype, device=like.device))

    @property
    def rank(self) -> int:
        return self.lora_A.shape[0]

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_A, self.lora_B
        if self.active_rank is not None:
            # Contiguous: the products then run the kernels of a model built at that rank.
            a, b = a[: self.active_rank].contiguous(), b[:, : self.active_rank].contiguous()
        return weight + self.scale * (b @ a).to(weight.dtype)


class ExpertsLoRA(nn.Module):
    """Parametrization of stacked expert weights [E, sum(out sizes), in]: each named projection
    (rows, in order) of each expert gets its own A [E, rank, in] and B [E, out, rank]."""

    def __init__(
        self,
        projections: dict[str, int],
        in_features: int,
        *,
        num_experts: int,
        rank: int,
        alpha: float,
        generator: torch.Generator,
        like: torch.Tensor,
    ) -> None:
        super().__init__()
        self.scale = alpha / rank
        self.active_rank: int | None = None  # as LinearLoRA's
        self.projections = tuple(projections)
        for name, out_features in projections.items():
            a = _kaiming_uniform((num_experts, rank, in_features), generator=generator, like=like)
            self.register_parameter(f"{name}_lora_A", nn.Parameter(a))
            b = torch.zeros(num_experts, out_features, rank, dtype=like.dtype, device=like.device)
            self.register_parameter(f"{name}_lora_B", nn.Parameter(b))

    @property
    def rank(self) -> int:
        return getattr(self, f"{self.projections[0]}_lora_A").shape[-2]

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        deltas = []
        for name in self.projections:
            a, b = getattr(self, f"{name}_lora_A"), getattr(self, f"{name}_lora_B")
            if self.active_rank is not None:
                a, b = a[:, : self.active_rank].contiguous(), b[..., : self.active_rank].contiguous()
            deltas.append(b @ a)
        return weight + self.scale * torch.cat(deltas, dim=1).to(weight.dtype)


def _kaiming_uniform(shape: tuple[int, ...], *, generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    """PEFT's (and nn.Linear's) init of A, drawn on the CPU from `generator` so that every rank
    draws the same values."""
    fan_in = shape[-1]
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_ with a = sqrt(5)
    values = torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
    return values.to(dtype=like.dtype, device=like.device)


def apply_lora(model: nn.Module, config: LoRAConfig, *, seed: int = 0) -> list[str]:
    """Adapt the targeted weights of an own model in place and freeze everything else; return
    the adapted parameters' names. Apply after loading and before parallelizing."""
    if isinstance(model, HFCausalLM):
        raise ValueError("LoRA needs the own model implementation (model.impl 'auto' or 'custom')")
    targets = set()
    for name in config.target_modules:
        name = _HF_ALIASES.get(name, name)
        if name in TARGETS:
            targets.add(name)
        else:
            logger.warning("lora.target_modules: ignoring unknown name %r (known: %s)", name, ", ".join(TARGETS))
    if not targets:
        raise ValueError(f"lora.target_modules {config.target_modules} names no known target ({', '.join(TARGETS)})")

    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    suffixes = [suffix for name in targets if name in LINEAR_TARGETS for suffix in LINEAR_TARGETS[name]]
    adapted = []
    # A list first: registering parametrizations adds modules while named_modules walks them.
    for module_name, module in list(model.named_modules()):
        suffix = next((s for s in suffixes if module_name == s or module_name.endswith(f".{s}")), None)
        if suffix is not None and isinstance(module, nn.Linear):
            out_features, in_features = module.weight.shape
            lora = LinearLoRA(
                out_features, in_features, rank=config.rank, alpha=config.alpha, generator=generator, like=module.weight
            )
            parametrize.register_parametrization(module, "weight", lora)
            adapted.append(f"{module_name}.weight")
        elif "experts" in targets and isinstance(module, GroupedExperts):
            num_experts, two_hidden, dim = module.w13.shape
            common = {"num_experts": num_experts, "rank": config.rank, "alpha": config.alpha, "generator": generator}
            hidden = two_hidden // 2
            projections = (
                {"gate_up": two_hidden}
                if getattr(module, "lora_fused_gate_up", False)
                else {"gate": hidden, "up": hidden}
            )
            if not getattr(module, "gated", True):  # w13 holds the up projections only (Nemotron-H)
                hidden, projections = two_hidden, {"up": two_hidden}
            gate_up = ExpertsLoRA(projections, dim, like=module.w13, **common)
            parametrize.register_parametrization(module, "w13", gate_up)
            parametrize.register_parametrization(
                module, "w2", ExpertsLoRA({"down": dim}, hidden, like=module.w2, **common)
            )
            adapted += [f"{module_name}.w13", f"{module_name}.w2"]
    if not adapted:
        raise ValueError(f"lora.target_modules {sorted(targets)} match no module of {type(model).__name__}")
    logger.info(
        "LoRA on %d weights (rank %d, alpha %g)",
        len(adapted),
        config.rank,
        config.alpha,
        extra={"targets": sorted(targets)},
    )
    return adapted


def lora_parametrizations(model: nn.Module) -> dict[str, LinearLoRA | ExpertsLoRA]:
    """The model's LoRA parametrizations by module name (`<module>.parametrizations.<param>.0`),
    in the order `apply_lora` created them (and drew their A)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, LinearLoRA | ExpertsLoRA)}


def initial_lora_tensors(model: nn.Module, *, rank: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The LoRA tensors `apply_lora(rank=rank, seed=seed)` would start from (the same values of
    A, B zero), zero-padded to the rank the model's LoRA modules have: A's rows and B's columns
    past `rank` are zero. By parameter name, in named_parameters' order, as full tensors on the
    CPU in the parameters' dtype."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module_name, lora in lora_parametrizations(model).items():
        if rank > lora.rank:
            raise ValueError(f"rank {rank} exceeds the rank {lora.rank} of the model's LoRA modules")
        for name, param in lora.named_parameters():
            padded = torch.zeros(param.shape, dtype=param.dtype)
            if name.endswith("lora_A"):  # [rank, in] or [E, rank, in]
                shape = (*param.shape[:-2], rank, param.shape[-1])
                padded[..., :rank, :] = _kaiming_uniform(shape, generator=generator, like=padded)
            tensors[f"{module_name}.{name}"] = padded
    return tensors


def is_lora_key(key: str) -> bool:
    """Whether a state-dict key is a LoRA A or B (not the adapted base weight)."""
    match = _PARAMETRIZED.fullmatch(key)
    return match is not None and match["lora"] is not None


def _split_key(key: str) -> tuple[str, str | None] | None:
    """('layers.0.attention.wq.weight', None | 'lora_A') for a parametrized key, else None."""
    match = _PARAMETRIZED.fullmatch(key)
    if match is None:
        return None
    return f"{match['module']}.{match['param']}", match["lora"]


def _delta(parts: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """scale * B @ A of one adapted weight from its LoRA tensors, in float32 at least."""

    def product(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(a.dtype, torch.float32)
        return b.to(dtype) @ a.to(dtype)

    if "lora_A" in parts:
        return scale * product(parts["lora_B"], parts["lora_A"])
    names = [name for name in ("gate", "up", "gate_up", "down") if f"{name}_lora_A" in parts]
    return scale * torch.cat([product(parts[f"{n}_lora_B"], parts[f"{n}_lora_A"]) for n in names], dim=1)


def merge_lora(
    named_tensors: Iterable[tuple[str, torch.Tensor]], *, scale: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """Own state-dict entries in, model weights out: an adapted weight's base and LoRA tensors
    (consecutive in a state dict) leave as one merged tensor W + scale * B @ A under the base
    name, in W's dtype; other entries pass through."""
    pending: str | None = None
    base: torch.Tensor | None = None
    parts: dict[str, torch.Tensor] = {}

    def merged() -> tuple[str, torch.Tensor]:
        assert pending is not None and base is not None, f"{pending}: LoRA tensors without their base weight"
        return pending, (base.to(torch.promote_types(base.dtype, torch.float32)) + _delta(parts, scale)).to(base.dtype)

    for key, tensor in named_tensors:
        split = _split_key(key)
        name = None if split is None else split[0]
        if pending is not None and name != pending:
            yield merged()
            pending, base, parts = None, None, {}
        if split is None:
            yield key, tensor
            continue
        pending = name
        if split[1] is None:
            base = tensor
        else:
            parts[split[1]] = tensor
    if pending is not None:
        yield merged()


def lora_adapter_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    base_shapes: dict[str, tuple[torch.Size, torch.dtype]],
    to_hf: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """LoRA tensors (own state-dict keys) in, the adapter under PEFT's names out.

    `base_shapes`: each adapted weight's own name -> its shape and dtype, from which `to_hf` (the
    model's state-dict adapter) gives the Hugging Face module names without touching data."""
    for key, tensor in named_tensors:
        split = _split_key(key)
        if split is None or split[1] is None:
            continue
        base_name, part = split
        shape, dtype = base_shapes[base_name]
        hf_names = list(to_hf({base_name: torch.empty(shape, dtype=dtype, device="meta")}))
        if part in ("lora_A", "lora_B"):
            (hf_name,) = hf_names
            yield f"base_model.model.{hf_name.removesuffix('.weight')}.{part}.weight", tensor
            continue
        projection, ab = part.split("_lora_")
        fused = _HF_FUSED_EXPERTS.fullmatch(hf_names[0]) if len(hf_names) == 1 else None
        if fused is not None:
            yield _fused_experts_adapter(fused, ab, tensor, base_name, to_hf)
            continue
        # One tensor per expert: [E, rank, in] or [E, out, rank].
        modules = {}
        for hf_name in hf_names:
            match = _HF_EXPERT.fullmatch(hf_name)
            assert match is not None, hf_name
            proj = _MIXTRAL_EXPERT_PROJ.get(match["proj"], match["proj"])
            modules[int(match["expert"]), proj] = f"{match['prefix']}.{match['expert']}.{match['proj']}"
        for expert, per_expert in enumerate(tensor.unbind(0)):
            yield f"base_model.model.{modules[expert, f'{projection}_proj']}.lora_{ab}.weight", per_expert


def _fused_experts_adapter(
    fused: re.Match[str],
    ab: str,
    tensor: torch.Tensor,
    base_name: str,
    to_hf: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
) -> tuple[str, torch.Tensor]:
    """PEFT's layout of a fused expert stack's adapter, as vLLM loads it: gate_up under
    `<experts>.base_layer`, down under `<experts>`; A [E * rank, in] (expert-major), B [out,
    rank * E] (expert-minor) with the output rows in the checkpoint's order, which the state-dict
    adapter gives by converting B [E, out, rank] as if it were the weight (rank for in)."""
    name = f"base_model.model.{fused['prefix']}{'.base_layer' if fused['proj'] == 'gate_up_proj' else ''}"
    if ab == "A":
        return f"{name}.lora_A.weight", tensor.reshape(-1, tensor.shape[-1])
    (hub_b,) = to_hf({base_name: tensor}).values()  # [E, rank, out], the checkpoint's input-major layout
    return f"{name}.lora_B.weight", hub_b.permute(2, 1, 0).reshape(hub_b.shape[2], -1)
