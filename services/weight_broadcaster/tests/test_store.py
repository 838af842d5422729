import grpc
import pytest
import torch

from primerl_common.errors import FailedPrecondition, InvalidArgument
from primerl_weight_broadcaster.store import WeightStore


def weights(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {"a": torch.ones(4) * scale, "b": torch.arange(6.0).reshape(2, 3), "c": torch.zeros(3, dtype=torch.int64)}


def test_versions_must_increase():
    store = WeightStore()
    assert store.latest_policy_version == -1
    store.publish(3, weights())
    for stale in (3, 2):
        with pytest.raises(FailedPrecondition) as error:
            store.publish(stale, weights())
        assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "not newer than the latest published 3" in error.value.message
    with pytest.raises(InvalidArgument):
        store.check_version(-1)
    assert store.latest_policy_version == 3


def test_delta_tracks_the_version_each_tensor_last_changed():
    store = WeightStore()
    first = store.publish(1, weights())
    assert first.num_changed_tensors == 3
    second = store.publish(2, {**weights(), "a": torch.ones(4) * 2})
    assert second.num_changed_tensors == 1
    third = store.publish(5, {**weights(), "a": torch.ones(4) * 2, "b": torch.zeros(2, 3)})
    assert third.num_changed_tensors == 1
    assert third.last_changed == {"a": 2, "b": 5, "c": 1}

    def names(base):
        return sorted(name for name, _ in third.tensors_since(base))

    assert names(1) == ["a", "b"]
    assert names(2) == names(4) == ["b"]
    assert names(5) == []
    assert names(None) == names(0) == names(-1) == ["a", "b", "c"]  # unknown base: everything


def test_a_changed_dtype_or_shape_counts_as_a_change_and_a_dropped_tensor_forces_full():
    store = WeightStore()
    store.publish(1, weights())
    second = store.publish(2, {**weights(), "c": torch.zeros(3, dtype=torch.int32)})
    assert second.last_changed["c"] == 2
    third = store.publish(3, {"a": torch.ones(4), "b": torch.arange(6.0).reshape(2, 3)})
    assert sorted(name for name, _ in third.tensors_since(2)) == ["a", "b"]
