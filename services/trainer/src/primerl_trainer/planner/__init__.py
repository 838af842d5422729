"""Capacity planner: per-GPU memory and step time of the trainer's meshes, from a model shape and
measured per-kernel rates (`primerl-trainer plan`). Torch-free."""

from primerl_trainer.planner.memory import MemoryEstimate, estimate_memory
from primerl_trainer.planner.mesh import Mesh, Workload, candidate_meshes
from primerl_trainer.planner.plan import PlanRow, format_table, plan
from primerl_trainer.planner.rates import GpuRates, load_rates
from primerl_trainer.planner.shapes import ModelShape, builtin_shape, shape_from_hf_config
from primerl_trainer.planner.timing import StepTime, estimate_step_time, model_flops_per_token

__all__ = [
    "GpuRates",
    "MemoryEstimate",
    "Mesh",
    "ModelShape",
    "PlanRow",
    "StepTime",
    "Workload",
    "builtin_shape",
    "candidate_meshes",
    "estimate_memory",
    "estimate_step_time",
    "format_table",
    "load_rates",
    "model_flops_per_token",
    "plan",
    "shape_from_hf_config",
]
