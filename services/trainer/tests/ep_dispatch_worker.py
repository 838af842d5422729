"""Run by test_expert_parallel.py under torchrun (2 ranks, gloo): one MoE layer's dispatch in bf16,
float32 and float64, with an odd row width (the packed buffer's padding column), packed and
unpacked (DispatchOptions): outputs and gradients must be bitwise equal, since packing only moves
the same bits in other exchanges.

    torchrun --standalone --nproc-per-node 2 ep_dispatch_worker.py
"""

import torch
import torch.distributed as dist

from primerl_trainer.distributed.expert_parallel import AllToAllDispatcher, DispatchOptions

NUM_EXPERTS, TOP_K, NUM_TOKENS, DIM = 8, 3, 37, 11


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(rank)
    weights = torch.randn(NUM_EXPERTS // 2, DIM, DIM, generator=generator)
    x = torch.randn(NUM_TOKENS, DIM, generator=generator)
    scores = torch.rand(NUM_TOKENS, TOP_K, generator=generator)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:TOP_K] for _ in range(NUM_TOKENS)])
    for dtype in (torch.bfloat16, torch.float32, torch.float64):

        def experts(rows: torch.Tensor, offsets: torch.Tensor, dtype=dtype) -> torch.Tensor:
            ends = offsets.tolist()
            starts = [0, *ends[:-1]]
            return torch.cat(
                [rows[s:e] @ weights[i].to(dtype) for i, (s, e) in enumerate(zip(starts, ends, strict=True))]
            )

        results = []
        for packed in (True, False):
            x_in = x.to(dtype).clone().requires_grad_()
            scores_in = scores.to(dtype).clone().requires_grad_()
            dispatcher = AllToAllDispatcher(
                dist.group.WORLD,
                num_experts=NUM_EXPERTS,
                options=DispatchOptions(packed=packed),
            )
            out, _ = dispatcher(x_in, scores_in, ids, experts)
            (out.double() * torch.arange(DIM, dtype=torch.float64)).sum().backward()
            results.append((out.detach(), x_in.grad, scores_in.grad))
        for other in results[1:]:
            for name, got, wanted in zip(("output", "x grad", "scores grad"), other, results[0], strict=True):
                assert got.abs().sum() > 0, (dtype, name)
                assert torch.equal(got, wanted), (dtype, name, (got - wanted).abs().max())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
