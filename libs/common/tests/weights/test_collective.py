"""Weights over a collective group (primerl_common.weights.collective): rank 0's sender and the
receiver the inference worker runs, over real process groups formed through a TCPStore:
gloo between threads on CPU, NCCL between two processes on two GPUs."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist

from primerl_common.weights.collective import (
    CollectiveReceiver,
    GroupCache,
    GroupSpec,
    TensorSpec,
    buckets,
    send_tensors,
)

TENSORS = {
    "embed": torch.randn(33, 7),
    "norm": torch.randn(7).to(torch.bfloat16),
    "ids": torch.arange(300, dtype=torch.int64).reshape(3, 100),
    "mask": torch.tensor([True, False, True]),
    "scale": torch.randn(2, 2).to(torch.float8_e4m3fn),
}
SPECS = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in TENSORS.items()]


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _spec(store: dist.TCPStore, rank: int, world_size: int, *, backend: str = "gloo", **kw: object) -> GroupSpec:
    fields = {"group_name": "test/gen1", "timeout_s": 20.0, "bucket_bytes": 1024, **kw}
    return GroupSpec(f"127.0.0.1:{store.port}", rank=rank, world_size=world_size, backend=backend, **fields)


def _wait(receiver: CollectiveReceiver, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while (state := receiver.poll()) is None:
        assert time.monotonic() < deadline, "the receive did not end"
        time.sleep(0.01)
    return state


def test_buckets_pack_in_order_and_align():
    packed = buckets(SPECS, 1024)
    assert [i for bucket in packed for i, _ in bucket] == list(range(len(SPECS)))
    for bucket in packed:
        assert all(offset % 64 == 0 for _, offset in bucket)
        end = bucket[-1][1] + SPECS[bucket[-1][0]].num_bytes
        assert end <= 1024 or len(bucket) == 1  # the 2400-byte `ids` goes alone
    # embed (924 bytes) + norm at 960; ids alone; mask + scale at 64.
    assert packed == [[(0, 0), (1, 960)], [(2, 0)], [(3, 0), (4, 64)]]


def test_two_receivers_get_every_tensor_and_keep_the_group():
    store = _store()
    receivers = [CollectiveReceiver(), CollectiveReceiver()]
    groups = GroupCache()
    for version in range(2):  # the second version reuses the groups the first one formed
        tensors = {name: t if version == 0 else t.clone() for name, t in TENSORS.items()}
        for rank, receiver in enumerate(receivers, start=1):
            receiver.start(_spec(store, rank, 3), SPECS)
        spec = _spec(store, 0, 3)
        sent = list(send_tensors(groups.get(spec), spec, SPECS, tensors.items()))
        assert [name for name, _ in sent] == list(TENSORS)
        for receiver in receivers:
            assert _wait(receiver) == ""
            received = dict(receiver.take())
            assert list(received) == list(TENSORS)
            for name, t in TENSORS.items():
                assert received[name].dtype == t.dtype and torch.equal(
                    received[name].view(torch.uint8), t.view(torch.uint8)
                )
    groups.drop()


def test_a_receiver_that_never_joins_times_out():
    store = _store()
    receiver = CollectiveReceiver()
    receiver.start(_spec(store, 1, 3, timeout_s=1.0), SPECS)  # rank 2 never comes
    started = time.monotonic()
    error = _wait(receiver)
    assert error and time.monotonic() - started < 15
    with pytest.raises(RuntimeError):
        receiver.take()


def test_the_sender_refuses_a_tensor_other_than_announced():
    store = _store()
    receiver = CollectiveReceiver()
    receiver.start(_spec(store, 1, 2, timeout_s=2.0), SPECS)
    spec = _spec(store, 0, 2, timeout_s=2.0)
    wrong = {**TENSORS, "norm": TENSORS["norm"].float()}
    with pytest.raises(ValueError, match="'norm'"):
        list(send_tensors(GroupCache().get(spec), spec, SPECS, wrong.items()))
    assert _wait(receiver)  # the receiver gives up: nothing half-received is handed over


# ----------------------------------------------------------------------------- NCCL (2 GPUs)


def _nccl_rank(port: int, rank: int, num_bytes: int, results: multiprocessing.Queue) -> None:
    try:
        results.put((rank, _nccl_round_trips(port, rank, num_bytes)))
    except Exception as exc:
        results.put((rank, repr(exc)))


def _nccl_round_trips(port: int, rank: int, num_bytes: int) -> object:
    """Two versions of `num_bytes` each from GPU 0 to GPU 1: the sender returns the seconds of
    the second (the group formed by the first is reused), the receiver whether all arrived."""
    torch.cuda.set_device(rank)
    spec = GroupSpec(f"127.0.0.1:{port}", "test/nccl", rank, 2, "nccl", 60.0, 256 * 2**20)
    generator = torch.Generator(device="cuda").manual_seed(0)
    tensors = {
        "a": torch.randn(num_bytes // 4, device="cuda", generator=generator).to(torch.bfloat16),
        "b": torch.randint(0, 255, (num_bytes // 4,), dtype=torch.int16, device="cuda", generator=generator),
    }
    specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    if rank == 0:
        groups = GroupCache()
        for _ in range(2):
            started = time.monotonic()
            list(send_tensors(groups.get(spec), spec, specs, tensors.items()))
            torch.cuda.synchronize()
            elapsed = time.monotonic() - started
        return elapsed
    receiver = CollectiveReceiver()
    for _ in range(2):
        receiver.start(spec, specs)
        while (state := receiver.poll()) is None:
            time.sleep(0.001)
        if state:
            return state
        received = dict(receiver.take())
    return all(received[name].is_cuda and torch.equal(received[name], t) for name, t in tensors.items())


@pytest.mark.gpu
def test_nccl_between_two_processes():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (NCCL ranks cannot share one)")
    store = _store()
    num_bytes = 1 << 30
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_nccl_rank, args=(store.port, r, num_bytes, results)) for r in range(2)]
    for process in processes:
        process.start()
    outcome = dict(results.get(timeout=300) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    assert outcome[1] is True, outcome
    assert isinstance(outcome[0], float), outcome
    print(f"NCCL weights broadcast GPU0->GPU1: {num_bytes / outcome[0] / 1e9:.1f} GB/s ({num_bytes >> 20} MiB)")


def test_group_specs_are_checked():
    with pytest.raises(ValueError, match="backend"):
        GroupSpec("127.0.0.1:1", "g", 1, 2, "mpi", 1.0, 1)
    with pytest.raises(ValueError, match="rank"):
        GroupSpec("127.0.0.1:1", "g", 2, 2, "gloo", 1.0, 1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="GPU"):
            _ = GroupSpec("127.0.0.1:1", "g", 1, 2, "nccl", 1.0, 1).device
