"""Weight updates over a collective group (inference.v1 WeightUpdateBegin.collective), on the
service's side: the announced tensor list is checked like a stream's headers before the
replica joins; then the engine process receives the tensors in a thread (generation goes on)
while this side polls it, and the engine loads them through the same path as a streamed
update (worker_extension.WorkerExtension.primerl_collective_*). Nothing is loaded unless
every tensor arrived.
"""

from __future__ import annotations

import asyncio
import dataclasses

from vllm.v1.engine.async_llm import AsyncLLM

from primerl.common.v1 import tensor_pb2
from primerl.inference.v1 import inference_pb2
from primerl_common.errors import InvalidArgument, Unavailable
from primerl_common.tensors import dtype_from_proto, dtype_to_proto
from primerl_common.weights.collective import GroupSpec, TensorSpec
from primerl_inference.weights import StagedTensor, StagedWeights, WeightTable, WeightUpdate

__all__ = ["CollectiveUpdate", "check_collective_update", "collective_update_from_proto", "receive_collective"]

_POLL_S = 0.02


@dataclasses.dataclass(frozen=True)
class CollectiveUpdate:
    group: GroupSpec
    tensors: tuple[TensorSpec, ...]

    def rows(self) -> list[list[object]]:
        """The tensor list in plain lists, as vLLM's RPC serializer carries them."""
        return [[t.name, str(t.dtype).removeprefix("torch."), list(t.shape)] for t in self.tensors]


def collective_update_from_proto(begin: inference_pb2.WeightUpdateBegin) -> CollectiveUpdate | None:
    if not begin.HasField("collective"):
        if begin.collective_tensors:
            raise InvalidArgument("collective_tensors need `collective`", field="begin.collective_tensors")
        return None
    group = begin.collective
    if group.rank == 0:
        raise InvalidArgument("a replica joins with a rank of 1 or more (0 sends)", field="begin.collective.rank")
    if begin.shared_fs_path:
        raise InvalidArgument("set either shared_fs_path or collective", field="begin.collective")
    try:
        spec = GroupSpec.from_proto(group)
    except ValueError as exc:
        raise InvalidArgument(str(exc), field="begin.collective") from None
    tensors = []
    for header in begin.collective_tensors:
        try:
            dtype = dtype_from_proto(header.dtype)
        except ValueError as exc:
            raise InvalidArgument(f"tensor {header.name!r}: {exc}", field="begin.collective_tensors") from None
        tensors.append(TensorSpec(header.name, dtype, tuple(header.shape)))
    return CollectiveUpdate(spec, tuple(tensors))


def check_collective_update(table: WeightTable, update: WeightUpdate, collective: CollectiveUpdate) -> StagedWeights:
    """Refuses a tensor list the model does not take, as a stream's headers would be; the
    update's index (no files: the tensors arrive later) and modules."""
    field = "begin.collective_tensors"
    names = [t.name for t in collective.tensors]
    if len(set(names)) != len(names):
        raise InvalidArgument("a tensor appears twice", field=field)
    for t in collective.tensors:
        table.check(
            tensor_pb2.TensorHeader(name=t.name, dtype=dtype_to_proto(t.dtype), shape=list(t.shape)), field=field
        )
    modules = table.check_complete(set(names), delta=update.delta, field=field)
    num_bytes = sum(t.num_bytes for t in collective.tensors)
    if (len(names), num_bytes) != (update.num_tensors, update.num_bytes):
        raise InvalidArgument(
            f"the list holds {len(names)} tensors of {num_bytes} bytes, "
            f"begin announced {update.num_tensors} and {update.num_bytes}",
            field=field,
        )
    tensors = tuple(StagedTensor("", t.name, str(t.dtype), t.shape, 0, t.num_bytes) for t in collective.tensors)
    return StagedWeights(tensors, modules)


async def receive_collective(llm: AsyncLLM, collective: CollectiveUpdate) -> None:
    """Joins the group and receives every tensor into the engine process; UNAVAILABLE when the
    group fails or times out (nothing is loaded then)."""
    await llm.collective_rpc("primerl_collective_start", args=(dataclasses.asdict(collective.group), collective.rows()))
    while True:
        (error,) = await llm.collective_rpc("primerl_collective_poll")
        if error is not None:
            break
        await asyncio.sleep(_POLL_S)
    if error:
        raise Unavailable(
            f"receiving the weights over collective group {collective.group.group_name!r} failed: {error}",
            reason="COLLECTIVE_FAILED",
        )
