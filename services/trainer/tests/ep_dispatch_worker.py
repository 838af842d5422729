"""Run by test_expert_parallel.py under torchrun (2 ranks, gloo): one MoE layer's dispatch in bf16,
float32 and float64, with an odd row width (the packed buffer's padding column), packed and
unpacked, each with the dense send grid and the deduplicated rows, and the grid with padded copies
(DispatchOptions): outputs and gradients must be bitwise equal, since packing only moves the same
bits in other exchanges, the grid's extra rows only add exact zeros and the padded copies are never
read.

    torchrun --standalone --nproc-per-node 2 ep_dispatch_worker.py
"""

import torch
import torch.distributed as dist

from primerl_trainer.distributed.expert_parallel import AllToAllDispatcher, DispatchOptions

NUM_EXPERTS, TOP_K, NUM_TOKENS, DIM = 8, 3, 37, 11


class PaddedExperts:
    """Experts that take padded rows (GroupedExperts.takes_padded_rows): the rows past the last
    offset come out as NaN, which must never reach an output or a gradient."""

    def __init__(self, experts) -> None:
        self.experts = experts

    def takes_padded_rows(self, x: torch.Tensor) -> bool:
        return True

    def __call__(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        end = int(offsets[-1])
        assert rows.shape[0] >= end
        out = torch.full((rows.shape[0], DIM), float("nan"), dtype=rows.dtype)
        out[:end] = self.experts(rows[:end], offsets)
        return out


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(rank)
    weights = torch.randn(NUM_EXPERTS // 2, DIM, DIM, generator=generator)
    # Ranks with different token counts (the dense grid's splits then differ by direction).
    num_tokens = NUM_TOKENS + 5 * rank
    x = torch.randn(num_tokens, DIM, generator=generator)
    scores = torch.rand(num_tokens, TOP_K, generator=generator)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:TOP_K] for _ in range(num_tokens)])
    for dtype in (torch.bfloat16, torch.float32, torch.float64):

        def experts(rows: torch.Tensor, offsets: torch.Tensor, dtype=dtype) -> torch.Tensor:
            ends = offsets.tolist()
            starts = [0, *ends[:-1]]
            return torch.cat(
                [rows[s:e] @ weights[i].to(dtype) for i, (s, e) in enumerate(zip(starts, ends, strict=True))]
            )

        results = []
        configs = [(packed, grid, False) for grid in (False, True) for packed in (True, False)]
        configs += [(True, True, True), (False, True, True)]
        for packed, dense_grid, padded in configs:
            x_in = x.to(dtype).clone().requires_grad_()
            scores_in = scores.to(dtype).clone().requires_grad_()
            dispatcher = AllToAllDispatcher(
                dist.group.WORLD,
                num_experts=NUM_EXPERTS,
                options=DispatchOptions(packed=packed, dense_grid=dense_grid),
            )
            out, _ = dispatcher(x_in, scores_in, ids, PaddedExperts(experts) if padded else experts)
            (out.double() * torch.arange(DIM, dtype=torch.float64)).sum().backward()
            results.append((out.detach(), x_in.grad, scores_in.grad))
        for index, other in enumerate(results[1:], 1):
            for name, got, wanted in zip(("output", "x grad", "scores grad"), other, results[0], strict=True):
                assert got.abs().sum() > 0, (dtype, index, name)
                assert torch.equal(got, wanted), (dtype, index, name, (got - wanted).abs().max())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
