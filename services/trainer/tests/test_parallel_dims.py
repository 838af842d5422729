"""The device mesh: degrees validated naming the config fields, and each named sub-mesh holding the
ranks the layout says (built for 8 ranks in one process on torch's fake backend)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from primerl_trainer.distributed.parallel_dims import MESH_NAMES, ParallelDims


@pytest.mark.parametrize(
    ("world_size", "cp", "ep", "message"),
    [
        (4, 3, 1, "parallel.cp 3 must divide the world size 4"),
        (6, 1, 4, "parallel.ep 4 must divide the world size 6"),
        (8, 4, 2, "parallel.ep 2 must be a multiple of parallel.cp 4"),
        (8, 2, 0, "parallel.ep must be positive"),
    ],
)
def test_degrees_that_do_not_fit_are_refused_naming_the_field(world_size: int, cp: int, ep: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelDims(world_size=world_size, cp=cp, ep=ep)


def test_ep_must_divide_the_experts() -> None:
    dims = ParallelDims(world_size=4, ep=4)
    dims.check_num_experts(8)
    with pytest.raises(ValueError, match=r"parallel.ep 4 must divide the model's number of experts 6"):
        dims.check_num_experts(6)


def _groups(world_size: int, cp: int, ep: int, rank: int) -> dict[str, list[int]]:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        dims = ParallelDims(world_size=world_size, cp=cp, ep=ep)
        dims.build_mesh("cpu")
        names = MESH_NAMES if dims.ep_enabled else ("dp_shard", "cp", "dp_shard_cp", "efsdp")
        return {name: dist.get_process_group_ranks(dims.group(name)) for name in names}
    finally:
        dist.destroy_process_group()


@pytest.fixture
def no_process_group() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group exists in this test process")
    yield


# Rank 5 of 8 (coordinates outermost first): what each mesh holds.
@pytest.mark.parametrize(
    ("cp", "ep", "expected"),
    [
        # dp_shard 8.
        (1, 1, {"dp_shard": list(range(8)), "cp": [5], "dp_shard_cp": list(range(8)), "efsdp": list(range(8))}),
        # dp_shard 4 x cp 2: rank 5 = (2, 1).
        (2, 1, {"dp_shard": [1, 3, 5, 7], "cp": [4, 5], "dp_shard_cp": list(range(8)), "efsdp": list(range(8))}),
        # dp_shard_mod_ep 4 x dp_shard_in_ep 2: rank 5 = (2, 1).
        (
            1,
            2,
            {"dp_shard": list(range(8)), "cp": [5], "dp_shard_cp": list(range(8)), "ep": [4, 5], "efsdp": [1, 3, 5, 7]},
        ),
        # 2 x 2 x cp 2: rank 5 = (1, 0, 1); ep spans dp_shard_in_ep x cp.
        (
            2,
            4,
            {
                "dp_shard": [1, 3, 5, 7],
                "cp": [4, 5],
                "dp_shard_cp": list(range(8)),
                "ep": [4, 5, 6, 7],
                "efsdp": [1, 5],
            },
        ),
        # 4 x 1 x cp 2: ep is the cp ranks.
        (
            2,
            2,
            {
                "dp_shard": [1, 3, 5, 7],
                "cp": [4, 5],
                "dp_shard_cp": list(range(8)),
                "ep": [4, 5],
                "efsdp": [1, 3, 5, 7],
            },
        ),
        # Every rank one expert group.
        (
            1,
            8,
            {"dp_shard": list(range(8)), "cp": [5], "dp_shard_cp": list(range(8)), "ep": list(range(8)), "efsdp": [5]},
        ),
    ],
)
def test_named_meshes_hold_the_ranks_of_the_layout(
    cp: int, ep: int, expected: dict[str, list[int]], no_process_group: None
) -> None:
    assert _groups(8, cp, ep, rank=5) == expected


def test_ep_mesh_is_refused_without_expert_parallel(no_process_group: None) -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        dims = ParallelDims(world_size=2)
        with pytest.raises(RuntimeError, match="build_mesh first"):
            dims.mesh("dp_shard")
        dims.build_mesh("cpu")
        with pytest.raises(ValueError, match=r"parallel.ep > 1"):
            dims.mesh("ep")
    finally:
        dist.destroy_process_group()
