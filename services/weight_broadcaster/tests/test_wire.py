import torch

from primerl.inference.v1 import inference_pb2
from primerl_common.tensors import iter_tensor_chunks
from primerl_weight_broadcaster.wire import SharedSerializer


def test_hand_serialized_requests_parse_as_the_codec_would_build_them():
    tensors = [
        ("multi", torch.randn(3000, dtype=torch.float32)),  # three chunks, the last one short
        ("exact", torch.arange(256, dtype=torch.uint8)),  # exactly one chunk
        ("empty", torch.zeros(0, 4, dtype=torch.bfloat16)),
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("fp8", torch.randn(16, 8).to(torch.float8_e4m3fn).t()),  # not contiguous
    ]
    begin = inference_pb2.WeightUpdateBegin(policy_version=7, num_tensors=len(tensors))
    got = [
        inference_pb2.UpdateWeightsRequest.FromString(data)
        for data in SharedSerializer(chunk_bytes=5000).update("v7", begin, tensors)
    ]
    expected = [inference_pb2.UpdateWeightsRequest(begin=begin)] + [
        inference_pb2.UpdateWeightsRequest(chunk=chunk) for chunk in iter_tensor_chunks(tensors, chunk_bytes=5000)
    ]
    assert len(got) == len(expected) == 1 + 3 + 1 + 1 + 1 + 1
    assert got == expected


def test_concurrent_pushes_share_each_serialized_chunk_within_a_bounded_window():
    tensors = [("a", torch.randn(10_000)), ("b", torch.arange(3000, dtype=torch.int16))]
    begin = inference_pb2.WeightUpdateBegin(policy_version=3, num_tensors=len(tensors))
    serializer = SharedSerializer(chunk_bytes=1000, window=4)
    expected = list(serializer.update("v3", begin, tensors))  # a push alone
    assert serializer.num_kept == 0
    ahead, behind = serializer.update("v3", begin, tensors), serializer.update("v3", begin, tensors)
    first = [next(ahead), next(ahead)]  # begin, then chunk 0 before the other push started
    second = [next(behind), next(behind)]
    kept = []
    for _ in range(6):  # the first push runs 6 chunks ahead: the next 4 are kept for the second
        first.append(next(ahead))
        kept.append(serializer.num_kept)
    second += list(behind)
    first += list(ahead)

    assert first == second == expected
    assert kept == [1, 2, 3, 4, 4, 4]  # chunks 1 to 4: `window` at most
    assert sum(a is b for a, b in zip(first, second, strict=True)) >= 4
    assert serializer.num_kept == 0  # both ended: nothing held
