"""primerl weight broadcaster: receives each new policy from the trainer and pushes it, in HF, kernel
or FP8 format, to every inference replica.
"""

from importlib.metadata import version as _version

__version__ = _version("primerl-weight-broadcaster")
