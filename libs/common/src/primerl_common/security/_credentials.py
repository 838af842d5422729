"""TLS credentials of servers and channels, and the process's own identity.

A service sets its identity up once at start (`server.prepare` calls `setup_process_tls`
with the config's `tls` section); from then on every channel the process opens
(`primerl_common.client.make_channel`, `secure_channel`, `secure_aio_channel`) shows that
certificate and trusts that CA, without call sites passing anything. The identity is also
exported as PRIMERL_TLS_MODE / _CERT / _KEY / _CA, so processes the service starts (engine
workers, training ranks) and command-line tools inherit it. A process that never set one
up and has none in its environment opens plaintext channels.
"""

from __future__ import annotations

import os
import pathlib
import ssl
import threading
from collections.abc import Sequence
from typing import Any

import grpc

from primerl_common.config import TlsConfig

__all__ = [
    "ENV_PREFIX",
    "MAX_RECONNECT_BACKOFF_MS",
    "channel_credentials",
    "process_tls",
    "secure_aio_channel",
    "secure_channel",
    "server_credentials",
    "setup_process_tls",
    "ssl_client_context",
    "ssl_server_context",
]

ENV_PREFIX = "PRIMERL_TLS_"
_lock = threading.Lock()
_process: TlsConfig | None = None
_credentials: dict[tuple[Any, ...], grpc.ChannelCredentials] = {}


def _read(path: pathlib.Path | None, field: str) -> bytes:
    if path is None:
        raise ValueError(f"tls.{field} is not set (needed by tls.mode mtls)")
    return pathlib.Path(path).read_bytes()


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """A server that requires each client's certificate, signed by tls.ca."""
    return grpc.ssl_server_credentials(
        [(_read(tls.key, "key"), _read(tls.cert, "cert"))],
        root_certificates=_read(tls.ca, "ca"),
        require_client_auth=True,
    )


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """The client side: trusts servers signed by tls.ca and shows tls.cert."""
    key = (tls.cert, tls.key, tls.ca)
    with _lock:
        if key not in _credentials:
            _credentials[key] = grpc.ssl_channel_credentials(
                root_certificates=_read(tls.ca, "ca"),
                private_key=_read(tls.key, "key"),
                certificate_chain=_read(tls.cert, "cert"),
            )
        return _credentials[key]


def setup_process_tls(tls: TlsConfig, *, export: bool = True) -> None:
    """Makes `tls` the identity of every channel this process (and, with `export`, what it
    starts) opens. Without `export` the processes it starts do not inherit it (the launcher:
    its services have identities of their own and must not hold the operator's key)."""
    global _process
    with _lock:
        _process = tls
    if not export:
        return
    os.environ[ENV_PREFIX + "MODE"] = tls.mode
    for name in ("cert", "key", "ca"):
        path = getattr(tls, name)
        if path is None:
            os.environ.pop(ENV_PREFIX + name.upper(), None)
        else:
            os.environ[ENV_PREFIX + name.upper()] = str(pathlib.Path(path).resolve())


def process_tls() -> TlsConfig | None:
    """This process's identity: set up by setup_process_tls, else from PRIMERL_TLS_*; None
    when neither says anything (plaintext channels)."""
    if _process is not None:
        return _process
    mode = os.environ.get(ENV_PREFIX + "MODE")
    if mode is None:
        return None
    return TlsConfig(
        mode=mode,  # type: ignore[arg-type]
        **{name: os.environ.get(ENV_PREFIX + name.upper()) for name in ("cert", "key", "ca")},
    )


def _resolve(tls: TlsConfig | None) -> TlsConfig | None:
    tls = tls if tls is not None else process_tls()
    return tls if tls is not None and tls.mode == "mtls" else None


# gRPC waits longer and longer between attempts to reach a server that is down (x1.6 each,
# up to 120 s by default), and calls made meanwhile fail at once without trying: a service
# restarted after a minute away would be reached only some tens of seconds after it is back.
# Services here are restarted on their own, so every channel tries again at least this often.
MAX_RECONNECT_BACKOFF_MS = 2_000
_RECONNECT_OPTION = "grpc.max_reconnect_backoff_ms"


def _with_reconnect_cap(options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """`options`, with the reconnect cap unless they set one."""
    options = list(options)
    if all(name != _RECONNECT_OPTION for name, _ in options):
        options.append((_RECONNECT_OPTION, MAX_RECONNECT_BACKOFF_MS))
    return options


def secure_aio_channel(
    address: str,
    *,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
    tls: TlsConfig | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel with `tls` (default: the process's identity): mutual TLS, or
    plaintext where the identity says plaintext or there is none. Its reconnect backoff is
    capped (MAX_RECONNECT_BACKOFF_MS) unless `options` set it."""
    resolved, options = _resolve(tls), _with_reconnect_cap(options)
    if resolved is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, channel_credentials(resolved), options=options, interceptors=interceptors)


def secure_channel(
    address: str, *, options: Sequence[tuple[str, Any]] = (), tls: TlsConfig | None = None
) -> grpc.Channel:
    """A blocking grpc channel, as secure_aio_channel."""
    resolved, options = _resolve(tls), _with_reconnect_cap(options)
    if resolved is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, channel_credentials(resolved), options=options)


def ssl_server_context(tls: TlsConfig) -> ssl.SSLContext:
    """For a raw TLS listener (the kvstore's bulk channel): as server_credentials, every
    client must show a certificate of tls.ca."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(_path(tls.cert, "cert"), _path(tls.key, "key"))
    context.load_verify_locations(_path(tls.ca, "ca"))
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def ssl_client_context(tls: TlsConfig | None = None) -> ssl.SSLContext | None:
    """For a raw TLS connection with `tls` (default: the process's identity); None where
    that is plaintext or unset."""
    resolved = _resolve(tls)
    if resolved is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(_path(resolved.cert, "cert"), _path(resolved.key, "key"))
    context.load_verify_locations(_path(resolved.ca, "ca"))
    return context


def _path(path: pathlib.Path | None, field: str) -> str:
    if path is None:
        raise ValueError(f"tls.{field} is not set (needed by tls.mode mtls)")
    return str(path)
