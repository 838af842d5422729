"""The trainer's device mesh: one mesh over all ranks with named dimensions, from the degrees of
context parallel (cp) and expert parallel (ep); FSDP2 shards over every rank.

Layout (outermost first, the innermost dimension on neighbouring ranks, i.e. one host's GPUs):

    ep == 1:   dp_shard x cp
    ep > 1:    dp_shard_mod_ep x dp_shard_in_ep x cp,   ep = dp_shard_in_ep * cp

with dp_shard = world / cp. Named sub-meshes (`ParallelDims.mesh(name)`):

    dp_shard      ranks that train different micro-batches (the batch is split over it)
    cp            ranks that share one sequence
    dp_shard_cp   FSDP2 of every parameter but the experts' (all ranks)
    ep            expert parallel: a MoE layer's experts are split over it (ep > 1)
    efsdp         FSDP2 of the expert parameters: dp_shard_mod_ep (ep > 1); dp_shard_cp when ep == 1

Expert parallel borrows the cp ranks first, then data-parallel ones: tokens of one sequence
meet in the same ep group, and the experts are sharded by FSDP2 only across ep groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["MESH_NAMES", "ParallelDims"]

MESH_NAMES = ("dp_shard", "cp", "dp_shard_cp", "ep", "efsdp")


@dataclass(frozen=True)
class ParallelDims:
    """Validated degrees; `build_mesh` makes the mesh (collective: every rank calls it)."""

    world_size: int
    cp: int = 1
    ep: int = 1
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, degree in (("world_size", self.world_size), ("parallel.cp", self.cp), ("parallel.ep", self.ep)):
            if degree < 1:
                raise ValueError(f"{name} must be positive, got {degree}")
        if self.world_size % self.cp:
            raise ValueError(f"parallel.cp {self.cp} must divide the world size {self.world_size}")
        if self.world_size % self.ep:
            raise ValueError(f"parallel.ep {self.ep} must divide the world size {self.world_size}")
        if self.ep > 1 and self.cp > 1 and self.ep % self.cp:
            raise ValueError(
                f"parallel.ep {self.ep} must be a multiple of parallel.cp {self.cp}: expert parallel spans the cp ranks"
            )

    @property
    def dp_shard(self) -> int:
        """Data-parallel degree: how many ranks train different micro-batches."""
        return self.world_size // self.cp

    @property
    def efsdp(self) -> int:
        """FSDP degree of the expert parameters."""
        return self.world_size // self.ep

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    def check_num_experts(self, num_experts: int) -> None:
        """ValueError unless ep splits `num_experts` evenly (each rank holds num_experts / ep)."""
        if num_experts % self.ep:
            raise ValueError(f"parallel.ep {self.ep} must divide the model's number of experts {num_experts}")

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The mesh over all ranks (its sub-meshes: `mesh`). Needs a process group of world_size ranks."""
        if self._meshes:
            return self._meshes["world"]
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"world_size {self.world_size} differs from the process group's {dist.get_world_size()}")
        if self.ep_enabled:
            in_ep = self.ep // self.cp
            names = ("dp_shard_mod_ep", "dp_shard_in_ep", "cp")
            world = init_device_mesh(device_type, (self.dp_shard // in_ep, in_ep, self.cp), mesh_dim_names=names)
            meshes = {
                "dp_shard": world["dp_shard_mod_ep", "dp_shard_in_ep"]._flatten("dp_shard"),
                "cp": world["cp"],
                "dp_shard_cp": world[names]._flatten("dp_shard_cp"),
                "ep": world["dp_shard_in_ep", "cp"]._flatten("ep"),
                "efsdp": world["dp_shard_mod_ep"],
            }
        else:
            names = ("dp_shard", "cp")
            world = init_device_mesh(device_type, (self.dp_shard, self.cp), mesh_dim_names=names)
            dp_shard_cp = world[names]._flatten("dp_shard_cp")
            meshes = {
                "dp_shard": world["dp_shard"],
                "cp": world["cp"],
                "dp_shard_cp": dp_shard_cp,
                "efsdp": dp_shard_cp,
            }
        # The flattened meshes are kept here: slicing them from the world mesh is deprecated.
        self._meshes.update(meshes, world=world)
        return world

    def mesh(self, name: str) -> DeviceMesh:
        """A named 1-D sub-mesh (see the module docstring); after `build_mesh`."""
        if name not in MESH_NAMES:
            raise ValueError(f"no mesh named {name!r}; one of {MESH_NAMES}")
        if not self._meshes:
            raise RuntimeError("build_mesh first")
        if name not in self._meshes:
            raise ValueError(f"mesh {name!r} exists only with parallel.ep > 1")
        return self._meshes[name]

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group of a named sub-mesh."""
        return self.mesh(name).get_group()
