"""primerl kvstore: a pooled KV-cache store in DRAM and disk, keyed by model, rank, policy-version
namespace and block hash.
"""

from importlib.metadata import version as _version

__version__ = _version("primerl-kvstore")
