"""Shared plumbing of the primerl services: config loading, the gRPC server
bootstrap, error mapping, client helpers, the tensor codec and observability.

Imports no service package (an import-linter contract keeps it so)."""

from importlib.metadata import version as _version

__version__ = _version("primerl-common")
