"""The trainer's weights as a Hugging Face model folder (`export.hf_dir`), written when it stops.

The folder is what `model.path` holds with the trained weights in it: config.json, the
tokenizer and generation files copied from model.path, and the weights under the hub's names
in safetensors (one file, or shards and model.safetensors.index.json above
`export.max_shard_bytes`), LoRA merged in. vLLM, transformers and the trainer itself load it
like the original checkpoint.

It is written into a hidden sibling folder and renamed into place once complete, so a reader
never sees half an export: it sees the previous folder, briefly none, or the new one.
`primerl_export.json` records the step and the source.

Collective: every rank gathers its shards (export.gather_state_dict); rank 0 writes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from primerl_common.weights.manifest import group_by_size
from primerl_trainer.export import exported_tensors, gather_state_dict

__all__ = [
    "EXPORT_INFO_FILE",
    "export_dtype",
    "export_hf_model",
    "staged_folder",
    "write_export_info",
    "write_hf_folder",
    "write_json",
]

logger = logging.getLogger(__name__)

EXPORT_INFO_FILE = "primerl_export.json"
# The stamp primerl-make-tiny-model writes (primerl_launcher.tiny_model.STAMP_FILE; test_export_hf checks they agree).
TINY_MODEL_STAMP_FILE = "primerl_tiny_model.json"
# Weights of the source checkpoint (replaced) and its tiny-model stamp (which would claim the
# folder holds the seed's untrained weights).
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_NOT_COPIED_NAMES = {
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    TINY_MODEL_STAMP_FILE,
    EXPORT_INFO_FILE,
}


def export_dtype(name: str, hf_config: dict[str, Any]) -> torch.dtype:
    """The dtype called `name`; "auto": the checkpoint's (config.json's dtype, else bfloat16)."""
    if name == "auto":
        name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "bfloat16"
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def export_hf_model(
    model: nn.Module,
    *,
    source_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: torch.dtype,
    lora_scale: float | None,
    is_destination: bool,
    step: int,
    max_shard_bytes: int = 5 * 1024**3,
) -> pathlib.Path | None:
    """Gathers the model's full weights and, on the destination rank, writes them as a Hugging Face
    folder at `out_dir`; returns it there (None elsewhere). Every rank must call it."""
    source = gather_state_dict(model, kind="full", is_destination=is_destination)
    tensors = exported_tensors(model, source, kind="full", dtype=dtype, lora_scale=lora_scale)
    if not is_destination:
        for _ in tensors:
            pass
        return None
    return write_hf_folder(
        tensors, source_dir=source_dir, out_dir=out_dir, dtype=dtype, step=step, max_shard_bytes=max_shard_bytes
    )


def write_hf_folder(
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    source_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: torch.dtype,
    step: int,
    max_shard_bytes: int = 5 * 1024**3,
) -> pathlib.Path:
    """Writes (name, tensor) pairs and `source_dir`'s other files as the folder `out_dir`, replacing
    it whole. Holds at most one shard's tensors at a time."""
    source = pathlib.Path(source_dir)
    out = pathlib.Path(out_dir)
    with staged_folder(out) as staging:
        _copy_model_files(source, staging, dtype=dtype)
        weight_map = _write_shards(tensors, staging, max_shard_bytes=max_shard_bytes)
        write_export_info(staging, step=step, source=source, num_tensors=len(weight_map))
    logger.info("exported the weights of step %d as a Hugging Face folder", step, extra={"path": str(out)})
    return out


@contextlib.contextmanager
def staged_folder(out: pathlib.Path) -> Iterator[pathlib.Path]:
    """A hidden empty sibling folder of `out` to fill; renamed to `out` (replacing it whole) when
    the block ends without an exception, deleted when it raises: never half a folder at `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    try:
        yield staging
        staging.chmod(0o755)
        _replace_folder(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_export_info(folder: pathlib.Path, *, step: int, source: pathlib.Path, num_tensors: int) -> None:
    """primerl_export.json: which step of which source model the folder holds."""
    write_json(folder / EXPORT_INFO_FILE, {"step": step, "source": str(source.resolve()), "num_tensors": num_tensors})


def _copy_model_files(source: pathlib.Path, staging: pathlib.Path, *, dtype: torch.dtype) -> None:
    config_path = source / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{source} is not a Hugging Face model folder: no config.json")
    for path in sorted(source.iterdir()):
        if (
            not path.is_file()
            or path.name.startswith(".")
            or path.name in _NOT_COPIED_NAMES
            or path.name.endswith(_NOT_COPIED_SUFFIXES)
        ):
            continue
        shutil.copyfile(path, staging / path.name)
    config = json.loads(config_path.read_text())
    # The weights written are never quantized (the own models dequantize an MXFP4 source on loading):
    # a quantization_config kept from the source would make transformers and vLLM misread them.
    config.pop("quantization_config", None)
    dtype_name = str(dtype).removeprefix("torch.")
    config["dtype"] = dtype_name
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype_name
    write_json(staging / "config.json", config)


def _write_shards(
    tensors: Iterable[tuple[str, torch.Tensor]], staging: pathlib.Path, *, max_shard_bytes: int
) -> dict[str, str]:
    """Writes the tensors into shard files; returns tensor name -> file name."""
    shard_names: list[list[str]] = []
    total_bytes = 0
    for shard in group_by_size(tensors, max_shard_bytes):
        if not shard:
            break
        save_file(shard, staging / f".shard-{len(shard_names)}", metadata={"format": "pt"})
        shard_names.append(list(shard))
        total_bytes += sum(tensor.numel() * tensor.element_size() for tensor in shard.values())
    if not shard_names:
        raise ValueError("the model has no weights to export")

    if len(shard_names) == 1:
        os.replace(staging / ".shard-0", staging / "model.safetensors")
        return dict.fromkeys(shard_names[0], "model.safetensors")
    weight_map = {}
    for index, names in enumerate(shard_names):
        file_name = f"model-{index + 1:05d}-of-{len(shard_names):05d}.safetensors"
        os.replace(staging / f".shard-{index}", staging / file_name)
        weight_map |= dict.fromkeys(names, file_name)
    index_data = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(staging / "model.safetensors.index.json", index_data)
    return weight_map


def _replace_folder(staging: pathlib.Path, out: pathlib.Path) -> None:
    """Renames `staging` to `out`; an existing `out` is moved aside first and deleted after."""
    # Readable by services that run as another user (containers).
    for path in staging.iterdir():
        path.chmod(0o644)
    if not out.exists():
        os.replace(staging, out)
        return
    if not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder")
    old = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
    os.replace(out, old / out.name)
    os.replace(staging, out)
    shutil.rmtree(old, ignore_errors=True)


def write_json(path: pathlib.Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
