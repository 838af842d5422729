"""Who is calling: the identity a peer's certificate names, bearer tokens, and the `Caller`
a servicer (or the admission limits) asks for with `caller_of(context)`.

A certificate names its holder in URI subject alternative names of the form
`spiffe://primerl/<role>/<name>`, one per role (a certificate may carry several, all with the
same name). A bearer token (`authorization: Bearer <token>` metadata), for environments and
tenants, names a caller of its own: it is looked up in the service's tokens file and, when
valid, the call is made as the token's name and roles (not in addition to the
certificate's). A token may be bound to the certificates it may come with (`peers`): presented
over another peer's connection it is a replay and refused.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import hmac
import pathlib
import tomllib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import grpc
from cryptography import x509

from primerl_common.config import ConfigError
from primerl_common.errors import ServiceError

__all__ = [
    "LOCAL",
    "TRUST_DOMAIN",
    "Caller",
    "CallerResolver",
    "PermissionDenied",
    "TokenEntry",
    "Unauthenticated",
    "acting_as",
    "caller_of",
    "certificate_identity",
    "identity_uri",
    "load_tokens",
]

TRUST_DOMAIN = "primerl"
_URI_PREFIX = f"spiffe://{TRUST_DOMAIN}/"


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


@dataclasses.dataclass(frozen=True)
class Caller:
    """The caller of one RPC. `peer` is the name its certificate gives ("" in plaintext);
    `via`: "certificate", "token" or "plaintext"."""

    name: str
    roles: frozenset[str]
    peer: str = ""
    via: str = "certificate"

    def describe(self) -> str:
        roles = ",".join(sorted(self.roles)) or "none"
        shown = self.name if self.peer in ("", self.name) else f"{self.name} (token, over {self.peer})"
        return f"{shown} [roles {roles}]"


# Plaintext has no identities: every caller is this one, and permissions are not enforced.
LOCAL = Caller(name="local", roles=frozenset({"*"}), via="plaintext")


def identity_uri(role: str, name: str) -> str:
    """The URI SAN that names `name` in `role` (what primerl-certs writes)."""
    return f"{_URI_PREFIX}{role}/{name}"


@functools.lru_cache(maxsize=256)
def certificate_identity(certificate_bytes: bytes) -> tuple[str, frozenset[str]] | None:
    """(name, roles) a certificate (PEM or DER) names in its `spiffe://primerl/<role>/<name>`
    URI SANs; None without one. Cached by the bytes."""
    if certificate_bytes.startswith(b"-----"):
        certificate = x509.load_pem_x509_certificate(certificate_bytes)
    else:
        certificate = x509.load_der_x509_certificate(certificate_bytes)
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    return _uri_identity(tuple(names.get_values_for_type(x509.UniformResourceIdentifier)))


@functools.lru_cache(maxsize=256)
def _uri_identity(names: tuple[str, ...]) -> tuple[str, frozenset[str]] | None:
    """(name, roles) of the `spiffe://primerl/<role>/<name>` URIs among a certificate's
    subject alternative names (others are skipped): the first such URI's name, with the
    roles of every one naming it. None without one. Cached by the names: a connection's calls
    all show the same."""
    found: list[tuple[str, str]] = []
    for uri in names:
        if uri.startswith(_URI_PREFIX):
            role, _, name = uri[len(_URI_PREFIX) :].partition("/")
            if role and name and "/" not in name:
                found.append((role, name))
    if not found:
        return None
    name = found[0][1]
    return name, frozenset(role for role, other in found if other == name)


# What gRPC names a TLS peer by when its certificate has subject alternative names (all of
# them: URIs, DNS names, addresses); without any it names the common name instead.
_SAN_PROPERTY = "x509_subject_alternative_name"


def _certificate_caller(context: grpc.aio.ServicerContext) -> Caller:
    """The caller the call's verified client certificate names, from the names gRPC kept at
    the handshake (peer_identities: a few microseconds, where auth_context() copies every
    property, the PEM included, on each call). Raises Unauthenticated without a client
    certificate or without an identity in it."""
    names = context.peer_identities()
    if not names:
        raise Unauthenticated("no client certificate", reason="NO_CLIENT_CERTIFICATE")
    caller = _san_caller(tuple(names)) if context.peer_identity_key() == _SAN_PROPERTY else None
    if caller is None:
        raise Unauthenticated(
            f"the client certificate names no identity (a URI SAN {_URI_PREFIX}<role>/<name>)",
            reason="NO_IDENTITY",
        )
    return caller


@functools.lru_cache(maxsize=256)
def _san_caller(names: tuple[bytes, ...]) -> Caller | None:
    identity = _uri_identity(tuple(name.decode(errors="replace") for name in names))
    return None if identity is None else Caller(name=identity[0], roles=identity[1], peer=identity[0])


@dataclasses.dataclass(frozen=True)
class TokenEntry:
    name: str
    roles: frozenset[str]
    sha256: bytes
    peers: frozenset[str] = frozenset()  # certificate names it may come with; empty: any


def load_tokens(path: pathlib.Path | None) -> tuple[TokenEntry, ...]:
    """The `[[tokens]]` tables of a tokens file: name, roles, sha256 (hex digest of the token),
    optional peers. Raises ConfigError naming the bad entry."""
    if path is None:
        return ()
    try:
        tables = tomllib.loads(path.read_text()).get("tokens", [])
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"invalid configuration:\n  tls.tokens_file: cannot read {path}: {exc}") from None
    entries = []
    for index, table in enumerate(tables):
        where = f"tls.tokens_file: {path} tokens[{index}]"
        unknown = set(table) - {"name", "roles", "sha256", "peers"}
        if unknown:
            raise ConfigError(f"invalid configuration:\n  {where}: unknown key(s) {sorted(unknown)}")
        try:
            digest = bytes.fromhex(table["sha256"])
            name, roles = str(table["name"]), frozenset(map(str, table["roles"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"invalid configuration:\n  {where}: needs name, roles and a hex sha256 ({exc})"
            ) from None
        if len(digest) != 32 or not name:
            raise ConfigError(f"invalid configuration:\n  {where}: sha256 must be 64 hex digits and name non-empty")
        entries.append(TokenEntry(name, roles, digest, frozenset(map(str, table.get("peers", ())))))
    return tuple(entries)


def _match_token(token: str, entries: Sequence[TokenEntry]) -> TokenEntry | None:
    """The entry of `token`, comparing with every entry in constant time (no early exit)."""
    digest = hashlib.sha256(token.encode()).digest()
    match = None
    for entry in entries:
        if hmac.compare_digest(digest, entry.sha256):
            match = entry
    return match


def _metadata_value(metadata: Iterable[tuple[str, Any]] | None, key: str) -> str | None:
    for name, value in metadata or ():
        if name == key:
            return value.decode() if isinstance(value, bytes) else value
    return None


class CallerResolver:
    """Finds the caller of a call: in mtls from the peer certificate and the bearer token, in
    plaintext always LOCAL. Raises Unauthenticated when there is no valid identity."""

    def __init__(self, *, mode: str, tokens: Sequence[TokenEntry] = ()) -> None:
        self.mode = mode
        self.tokens = tuple(tokens)

    def resolve(self, context: grpc.aio.ServicerContext) -> Caller:
        if self.mode == "plaintext":
            return LOCAL
        certified = _certificate_caller(context)
        header = _metadata_value(context.invocation_metadata(), "authorization")
        if header is None:
            return certified
        peer = certified.peer
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("authorization metadata must be 'Bearer <token>'", reason="BAD_AUTHORIZATION")
        entry = _match_token(token.strip(), self.tokens)
        if entry is None:
            raise Unauthenticated(f"unknown bearer token (from {peer})", reason="UNKNOWN_TOKEN")
        if entry.peers and peer not in entry.peers:
            raise Unauthenticated(
                f"the bearer token of {entry.name} came from {peer}, not from a peer it is bound to (a replay)",
                reason="TOKEN_REPLAYED",
                metadata={"token": entry.name, "peer": peer},
            )
        return Caller(name=entry.name, roles=entry.roles, peer=peer, via="token")


# Set by the authorization interceptor for the duration of each call.
_current: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("primerl_caller", default=None)


@contextlib.contextmanager
def acting_as(caller: Caller) -> Iterator[None]:
    """Within it, `caller_of` answers `caller`: for a handler that authenticated its caller
    itself (a sealed stream's session key) and calls another handler as that caller."""
    token = _current.set(caller)
    try:
        yield
    finally:
        _current.reset(token)


def caller_of(context: grpc.aio.ServicerContext) -> Caller:
    """The caller of the call `context` belongs to, as the service's authorization found it.
    Outside a primerl server's interceptor chain: the certificate's identity (no tokens), or
    LOCAL on a connection without TLS. Raises Unauthenticated without an identity."""
    caller = _current.get()
    if caller is not None:
        return caller
    secure = (context.auth_context() or {}).get("transport_security_type") == [b"ssl"]
    return CallerResolver(mode="mtls" if secure else "plaintext").resolve(context)
