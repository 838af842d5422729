import torch

from primerl.inference.v1 import inference_pb2
from primerl_common.tensors import iter_tensor_chunks
from primerl_weight_broadcaster.wire import serialized_update


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
        for data in serialized_update(begin, tensors, chunk_bytes=5000)
    ]
    expected = [inference_pb2.UpdateWeightsRequest(begin=begin)] + [
        inference_pb2.UpdateWeightsRequest(chunk=chunk) for chunk in iter_tensor_chunks(tensors, chunk_bytes=5000)
    ]
    assert len(got) == len(expected) == 1 + 3 + 1 + 1 + 1 + 1
    assert got == expected
