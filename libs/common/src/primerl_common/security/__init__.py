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

from primerl_common.security._credentials import (
    ENV_PREFIX,
    channel_credentials,
    process_tls,
    secure_aio_channel,
    secure_channel,
    server_credentials,
    setup_process_tls,
    ssl_client_context,
    ssl_server_context,
)
from primerl_common.security._identity import (
    LOCAL,
    TRUST_DOMAIN,
    Caller,
    CallerResolver,
    PermissionDenied,
    TokenEntry,
    Unauthenticated,
    caller_of,
    certificate_identity,
    identity_uri,
    load_tokens,
)
from primerl_common.security._permissions import (
    ANY,
    ENVIRONMENT,
    INFERENCE,
    KVSTORE,
    OPEN_METHODS,
    OPERATOR,
    ORCHESTRATOR,
    ROUTER,
    TENANT,
    TRAINER,
    WEIGHT_BROADCASTER,
    AuthorizationInterceptor,
    method_roles,
)

__all__ = [
    "ANY",
    "ENVIRONMENT",
    "ENV_PREFIX",
    "INFERENCE",
    "KVSTORE",
    "LOCAL",
    "OPEN_METHODS",
    "OPERATOR",
    "ORCHESTRATOR",
    "ROUTER",
    "TENANT",
    "TRAINER",
    "TRUST_DOMAIN",
    "WEIGHT_BROADCASTER",
    "AuthorizationInterceptor",
    "Caller",
    "CallerResolver",
    "PermissionDenied",
    "TokenEntry",
    "Unauthenticated",
    "caller_of",
    "certificate_identity",
    "channel_credentials",
    "identity_uri",
    "load_tokens",
    "method_roles",
    "process_tls",
    "secure_aio_channel",
    "secure_channel",
    "server_credentials",
    "setup_process_tls",
    "ssl_client_context",
    "ssl_server_context",
]
