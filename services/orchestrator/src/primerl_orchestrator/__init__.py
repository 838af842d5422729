"""primerl orchestrator: the RL loop and the API environments call: tasks, episodes, rewards,
advantages, staleness control, batches to the trainer.
"""

from importlib.metadata import version as _version

__version__ = _version("primerl-orchestrator")
