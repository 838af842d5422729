"""primerl router: fronts the inference replicas: routing policies, prefill/decode groups, health,
failover and policy versions.
"""

from importlib.metadata import version as _version

__version__ = _version("primerl-router")
