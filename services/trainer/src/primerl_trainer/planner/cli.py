"""`primerl-trainer plan`: which meshes of N GPUs fit a model and how fast each would train.

    primerl-trainer plan -c config.toml --gpus 16 --gpu h200
    primerl-trainer plan --shape GLM-5 --gpus 224 --gpu h200 --seq-len 131072 --tokens-per-step 8388608

The model shape comes from the config's model.path (its config.json) or a built-in --shape; the
sequence length and dtypes from the config unless given. Torch is not imported.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence
from dataclasses import asdict

from primerl_common.config import ConfigError, load_config
from primerl_trainer.planner.mesh import Mesh, Workload
from primerl_trainer.planner.plan import format_table, plan
from primerl_trainer.planner.rates import load_rates
from primerl_trainer.planner.shapes import BUILTIN_SHAPES, ModelShape, builtin_shape, shape_from_model_path

__all__ = ["main"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="primerl-trainer plan",
        description="Predict per-GPU memory and step time of every mesh (dp x cp x ep) of --gpus GPUs, "
        "with and without activation checkpointing, from measured per-kernel rates.",
    )
    parser.add_argument("-c", "--config", type=pathlib.Path, help="trainer TOML config (model.path, seq_len, dtypes)")
    parser.add_argument("--config-section", help="read only this table of the TOML file")
    parser.add_argument("--shape", help=f"a built-in model shape instead of model.path: {', '.join(BUILTIN_SHAPES)}")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of the trainer (the world size)")
    parser.add_argument("--gpu", default="h200", help="GPU kind whose rates file to use (h100, h200)")
    parser.add_argument("--rates", type=pathlib.Path, help="a rates file (bench/parallel_throughput.py --calibrate)")
    parser.add_argument("--seq-len", type=int, help="tokens per packed row (default: the config's seq_len, or 4096)")
    parser.add_argument("--tokens-per-step", type=int, help="tokens per optimizer step (default: one row per GPU)")
    parser.add_argument("--master-dtype", choices=sorted(_DTYPE_BYTES), help="default: the config's model.dtype")
    parser.add_argument("--loss", choices=["logits", "fused"], default="logits", help="the trainer's path: logits")
    parser.add_argument("--fp8", action="store_true", help="model.fp8 (default: the config's)")
    parser.add_argument("--top", type=int, default=20, help="rows shown (0: all)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        shape, workload, configured = _resolve(args)
        rates = load_rates(args.rates or args.gpu)
    except (ValueError, ConfigError) as exc:
        print(f"primerl-trainer plan: {exc}", file=sys.stderr)
        return 2
    rows = plan(shape, args.gpus, workload, rates)
    if args.json:
        print(json.dumps([asdict(row) | {"mesh": str(row.mesh)} for row in rows], indent=1))
    else:
        print(format_table(rows, shape, args.gpus, workload, rates, limit=args.top or None, configured=configured))
    return 0


def _resolve(args: argparse.Namespace) -> tuple[ModelShape, Workload, Mesh | None]:
    if args.gpus <= 0:
        raise ValueError("--gpus must be positive")
    seq_len, master, compute, accumulate_unsharded, fp8 = 4096, "float32", "bfloat16", False, args.fp8
    shape = builtin_shape(args.shape) if args.shape else None
    configured = None
    if args.config is not None:
        from primerl_trainer.config import TrainerConfig

        argv = ["-c", str(args.config)] + (["--config-section", args.config_section] if args.config_section else [])
        config = load_config(TrainerConfig, argv, prog="primerl-trainer plan")
        seq_len, master, compute = config.seq_len, config.model.dtype, config.model.compute_dtype
        accumulate_unsharded = config.parallel.accumulate_unsharded
        fp8 = fp8 or config.model.fp8
        if shape is None:
            shape = shape_from_model_path(config.model.path)
        configured = Mesh(world=args.gpus, ep=config.parallel.ep, cp=config.parallel.cp)
    if shape is None:
        raise ValueError("give -c CONFIG (its model.path) or --shape NAME")
    seq_len = args.seq_len or seq_len
    workload = Workload(
        seq_len=seq_len,
        tokens_per_step=args.tokens_per_step or seq_len * args.gpus,
        master_bytes=_DTYPE_BYTES[args.master_dtype or master],
        compute_bytes=_DTYPE_BYTES[compute],
        loss=args.loss,
        accumulate_unsharded=accumulate_unsharded,
        fp8=fp8,
    )
    return shape, workload, configured
