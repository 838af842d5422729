"""Weight transport shared by the trainer, the weight broadcaster and inference replicas:
`manifest` (a version's weights as a published folder of safetensors files),
`shared_memory` (such a folder in shared memory of one host, and how a writer tells that a
reader shares it), `collective` (a version broadcast over a process group),
`engine_modules` (which engine module a tensor name loads into, so a delta carries whole
modules) and `fp8` (block FP8 quantization: the weights the broadcaster publishes in vLLM's
block-FP8 layout, the operands of the trainer's FP8 matrix products)."""
