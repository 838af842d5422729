"""The trainer service with context parallel (parallel.cp = 2, torchrun, gloo on the CPU): a pushed
batch trains as in one process, and the publish sends every weight whole (HF names and shapes),
equal to what one process publishes after the same step."""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib

import pytest
import torch

from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.processes import free_port
from primerl_common.tensors import TensorAssembler
from primerl_common.testing import bare_server

from .serving import METRICS, push, serving, start_on_two_ranks, trainer_config, watch
from .test_broadcaster_restart import status_when
from .tiny_training import load_tiny_model, make_samples, pack_into

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Receiver(weight_broadcaster_pb2_grpc.WeightBroadcasterServiceServicer):
    """The broadcaster's side of PublishWeights as the protocol defines it: keeps each version's
    tensors, assembled from the chunks."""

    def __init__(self) -> None:
        self.versions: dict[int, tuple[pb2.PublishBegin, dict[str, torch.Tensor]]] = {}

    def serving(self) -> contextlib.AbstractAsyncContextManager[str]:
        register = functools.partial(weight_broadcaster_pb2_grpc.add_WeightBroadcasterServiceServicer_to_server, self)
        return bare_server(register)

    async def PublishWeights(self, request_iterator, context):
        requests = aiter(request_iterator)
        begin = (await anext(requests)).begin
        assembler, tensors = TensorAssembler(), {}
        async for request in requests:
            if (item := assembler.feed(request.chunk)) is not None:
                tensors[item[0]] = item[1]
        assembler.finish()
        self.versions[begin.policy_version] = (begin, tensors)
        return pb2.PublishWeightsResponse(policy_version=begin.policy_version)

    async def GetStatus(self, request, context):
        return pb2.GetStatusResponse(latest_policy_version=max(self.versions, default=-1))


async def _train_one_step(stub: trainer_pb2_grpc.TrainerServiceStub, batch) -> trainer_pb2.StepMetrics:
    await push(stub, 1, batch)
    (step,) = await watch(stub, after_step=0, count=1)
    await status_when(stub, lambda status: status.published_policy_version == 1, timeout_s=120)
    return step


async def test_cp2_service_trains_a_step_and_publishes_whole_tensors(
    dense_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    model = load_tiny_model(dense_dir)
    # Two micro-batches of several samples: both cp ranks train both, each on half of every row.
    batch = pack_into(make_samples(model, seed=20, num_samples=5), 2)
    distributed, single = Receiver(), Receiver()
    async with distributed.serving() as distributed_address, single.serving() as single_address:
        port = free_port()
        config = trainer_config(
            dense_dir,
            server={"port": port},
            observability={"log_level": "INFO"},
            parallel={"cp": 2},
            publish={"weight_broadcaster": distributed_address},
        )
        process = await start_on_two_ranks(config, tmp_path)
        try:
            async with make_channel(process.address) as channel:
                got = await _train_one_step(trainer_pb2_grpc.TrainerServiceStub(channel), batch)
        finally:
            await process.stop()
        output = process.output()
        process.close()
        assert "ChildFailedError" not in output, output[-5000:]

        one_process = config.model_copy(
            update={
                "server": config.server.model_copy(update={"port": 0}),
                "parallel": config.parallel.model_copy(update={"cp": 1}),
                "publish": config.publish.model_copy(update={"weight_broadcaster": single_address}),
            }
        )
        async with serving(one_process) as stub:
            wanted = await _train_one_step(stub, batch)

    for key in METRICS:
        assert got.metrics[key] == pytest.approx(wanted.metrics[key], rel=1e-5, abs=1e-5), key
    begin, tensors = distributed.versions[1]
    wanted_begin, wanted_tensors = single.versions[1]
    assert (begin.num_tensors, begin.num_bytes) == (wanted_begin.num_tensors, wanted_begin.num_bytes)
    assert tensors.keys() == wanted_tensors.keys() and len(tensors) == begin.num_tensors
    for name, tensor in wanted_tensors.items():
        assert tensors[name].shape == tensor.shape, name
        # One Adam step: float32 rounding of gradients summed in another order (test_context_parallel).
        torch.testing.assert_close(tensors[name], tensor, rtol=0, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(autouse=True)
def _no_inherited_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if name in os.environ:
            monkeypatch.delenv(name)
