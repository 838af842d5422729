"""primerl inference: one vLLM engine behind gRPC: token-in/token-out generation with per-token policy
versions, in-place weight updates, routed-expert capture, LoRA adapters.
"""

from importlib.metadata import version as _version

__version__ = _version("primerl-inference")
