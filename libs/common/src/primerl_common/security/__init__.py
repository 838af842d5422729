"""Mutual TLS, caller identities and per-RPC roles for every primerl service.

- `TlsConfig` (the `tls` section of every service's config, in primerl_common.config):
  `mode = "mtls"` (default: cert, key and ca required) or `"plaintext"` (loopback only).
- Identities: a certificate names its holder as `spiffe://primerl/<role>/<name>` URI SANs
  (`primerl-certs` makes them); bearer tokens (`authorization: Bearer <t>`) from the tokens
  file name environments and tenants. `caller_of(context)` -> `Caller(name, roles)`.
- Permissions: each ServiceDefinition lists the roles of each RPC (`method_roles`);
  `AuthorizationInterceptor` refuses the rest (UNAUTHENTICATED / PERMISSION_DENIED).
- The process identity (`setup_process_tls`) is what every channel the process opens shows.
"""

from primerl_common.security import _credentials, _identity, _permissions
from primerl_common.security._credentials import *  # noqa: F403
from primerl_common.security._identity import *  # noqa: F403
from primerl_common.security._permissions import *  # noqa: F403

# Each module lists what it exports (its __all__); the package exports them all.
__all__ = [*_credentials.__all__, *_identity.__all__, *_permissions.__all__]
