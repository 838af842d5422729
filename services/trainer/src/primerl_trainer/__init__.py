"""primerl trainer: PyTorch training of the policy: own Qwen3/Qwen3-MoE models, RL and SFT losses,
router replay, FSDP2, checkpoints.
"""

from importlib.metadata import version as _version

__version__ = _version("primerl-trainer")
