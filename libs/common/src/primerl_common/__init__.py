"""What every primerl service needs, and the domain pieces two services share.

Plumbing: config loading (`config`), the gRPC server bootstrap (`server`), error mapping
(`errors`), client helpers (`client`), the tensor codec (`tensors`) and observability.
Two domain subpackages, each shared by the services named in its docstring: `weights`
(the weight manifest, the collective transport, the engine module map) and `kvpool` (the
KV-cache pool's keys, framing and clients). The plumbing imports neither, and nothing here
imports a service package (import-linter contracts keep both so)."""

from importlib.metadata import version as _version

__version__ = _version("primerl-common")
