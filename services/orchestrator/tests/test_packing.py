import torch

from primerl_orchestrator.packing import TrainingSample, pack
from primerl_orchestrator.samples import Sample


def sample(length: int, *, first_loss: int = 1, version: int = 0, routed: bool = False) -> Sample:
    s = Sample(
        token_ids=[100 + i for i in range(length)],
        loss_mask=[i >= first_loss for i in range(length)],
        logprobs=[-0.1 * i if i >= first_loss else 0.0 for i in range(length)],
        policy_versions=[version] * length,
        temperatures=[1.0] * length,
    )
    if routed:
        s.routed_segments.append(torch.full((length, 2, 2), length, dtype=torch.uint8))
    return s


def test_first_fit_decreasing_with_positions_restarting():
    samples = [TrainingSample(sample(n), advantage=float(n)) for n in (3, 6, 4, 2)]
    packed = pack(samples, seq_len=8, with_routed_experts=False)
    # Longest first: 6 then 2 fill the first micro-batch; 4 then 3 the second.
    assert [mb.input_ids.numel() for mb in packed.micro_batches] == [8, 7]
    first = packed.micro_batches[0]
    assert first.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 0, 1]
    assert first.input_ids.tolist() == [100, 101, 102, 103, 104, 105, 100, 101]
    assert first.loss_mask.tolist() == [False, True, True, True, True, True, False, True]
    # Advantages on loss tokens only.
    assert first.advantages.tolist() == [0.0, 6.0, 6.0, 6.0, 6.0, 6.0, 0.0, 2.0]
    assert (packed.num_samples, packed.num_tokens, packed.num_loss_tokens) == (4, 15, 11)
    assert (packed.num_truncated, packed.num_dropped_empty) == (0, 0)
    assert first.input_ids.dtype == torch.int32 and first.policy_versions.dtype == torch.int64
    assert first.routed_experts is None


def test_long_samples_are_truncated_and_empty_ones_dropped():
    samples = [
        TrainingSample(sample(10, first_loss=2, version=3), 1.0),
        TrainingSample(sample(10, first_loss=9, version=1), 1.0),  # no loss token in its first 6
    ]
    packed = pack(samples, seq_len=6, with_routed_experts=False)
    assert (packed.num_truncated, packed.num_dropped_empty, packed.num_samples) == (2, 1, 1)
    [micro_batch] = packed.micro_batches
    assert micro_batch.input_ids.numel() == 6
    assert (packed.min_policy_version, packed.max_policy_version) == (3, 3)


def test_routed_experts_follow_their_samples():
    samples = [TrainingSample(sample(n, routed=True), 0.5) for n in (2, 3)]
    [micro_batch] = pack(samples, seq_len=8, with_routed_experts=True).micro_batches
    assert micro_batch.routed_experts.shape == (5, 2, 2)
    assert micro_batch.routed_experts[:, 0, 0].tolist() == [3, 3, 3, 2, 2]
    assert set(micro_batch.named_tensors()) >= {"routed_experts", "policy_versions", "temperatures"}


def test_policy_version_range_covers_loss_tokens():
    samples = [TrainingSample(sample(4, version=v), 1.0) for v in (2, 5)]
    packed = pack(samples, seq_len=16, with_routed_experts=False)
    assert (packed.min_policy_version, packed.max_policy_version) == (2, 5)
