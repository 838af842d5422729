"""The attacker of the security tests (test_security_*.py): each role's certificate and token
made by a development CA and an impostor CA (make_certs), channels as each holder (Target), and
`attack`, which calls an RPC as every intruder (no certificate, another CA's, one naming no
identity, each role the RPC does not admit, a replayed and an unknown token) and checks each
refusal's status."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from primerl_common.client import make_channel
from primerl_common.config import TlsConfig
from primerl_common.errors import error_details
from primerl_common.security.certificates import Holder, make_authority, make_certificate, make_token, tls_of
from primerl_common.testing import in_process_service

REPO = pathlib.Path(__file__).resolve().parents[1]
# The holder of each role's certificate.
HOLDERS = {
    "trainer": "trainer",
    "orchestrator": "orchestrator",
    "inference": "inference-0",
    "router": "router",
    "weight_broadcaster": "weight_broadcaster",
    "kvstore": "kvstore",
    "operator": "operator",
    "environment": "env-a",
    "tenant": "tenant-1",
}
UNAVAILABLE, UNAUTHENTICATED, DENIED = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
)


def make_certs(directory: pathlib.Path) -> pathlib.Path:
    """A CA and each role's certificate and token in `directory`; another CA and an impostor of
    each role under `directory / "other"`; a certificate naming no identity ("anonymous")."""
    authority = make_authority(directory)
    other = make_authority(directory / "other", name="another CA")
    for role, name in HOLDERS.items():
        make_certificate(authority, directory, Holder(name, (role,)))
        make_certificate(other, directory / "other", Holder(name, (role,)))  # an impostor of each
        make_token(directory, f"stolen-{role}:{role}@{name}")
    make_certificate(authority, directory, Holder("anonymous", ()))
    return directory


def service_tls(certs: pathlib.Path, role: str) -> TlsConfig:
    return tls_of(certs, HOLDERS[role], tokens_file=certs / "tokens.toml")


@dataclasses.dataclass
class Target:
    address: str
    certs: pathlib.Path
    channels: dict[str, grpc.aio.Channel] = dataclasses.field(default_factory=dict)

    def channel(self, who: str) -> grpc.aio.Channel:
        """A channel as `who`: a holder name, "other:<name>" (another CA), or "no certificate"."""
        if who not in self.channels:
            if who == "no certificate":
                ca = (self.certs / "ca.pem").read_bytes()
                credentials = grpc.ssl_channel_credentials(root_certificates=ca)
                self.channels[who] = grpc.aio.secure_channel(self.address, credentials)
            elif who.startswith("other:"):
                impostor = tls_of(self.certs / "other", who.removeprefix("other:"))
                self.channels[who] = make_channel(
                    self.address, tls=impostor.model_copy(update={"ca": self.certs / "ca.pem"}), max_attempts=1
                )
            else:
                self.channels[who] = make_channel(self.address, tls=tls_of(self.certs, who), max_attempts=1)
        return self.channels[who]

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()


def token(certs: pathlib.Path, role: str) -> str:
    return (certs / "tokens" / f"stolen-{role}.token").read_text().strip()


Invoke = Callable[[grpc.aio.Channel, list[tuple[str, str]]], Awaitable[object]]


async def attack(target: Target, rpc: str, allowed: set[str], invoke: Invoke) -> None:
    """Every intruder's call of `rpc` (which admits the roles `allowed`) is refused as it should be."""
    legit = HOLDERS[sorted(allowed)[0]]
    intruders: list[tuple[str, str, list[tuple[str, str]], grpc.StatusCode]] = [
        ("no certificate", "no certificate", [], UNAVAILABLE),
        (f"{legit}'s name from another CA", f"other:{legit}", [], UNAVAILABLE),
        ("a certificate without identity", "anonymous", [], UNAUTHENTICATED),
        *[(f"{name} (wrong role)", name, [], DENIED) for role, name in HOLDERS.items() if role not in allowed],
        *[
            (
                f"{role}'s token replayed by {replayer}",
                replayer,
                [("authorization", f"Bearer {token(target.certs, role)}")],
                UNAUTHENTICATED,
            )
            for role in allowed
            for replayer in [HOLDERS["tenant"] if role != "tenant" else HOLDERS["environment"]]
        ],
        (f"{legit} with an unknown token", legit, [("authorization", "Bearer forged")], UNAUTHENTICATED),
    ]
    for label, who, metadata, expected in intruders:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await invoke(target.channel(who), metadata)
        assert refused.value.code() == expected, f"{rpc} by {label}: {refused.value.code()} {refused.value.details()}"
        if expected == DENIED:
            details = refused.value.details()
            assert rpc in details and all(role in details for role in allowed), details
            assert error_details(refused.value)[0].reason == "MISSING_ROLE"


def unary(stub_class, method: str, request) -> Invoke:
    async def invoke(channel, metadata):
        return await getattr(stub_class(channel), method)(request, metadata=metadata, timeout=10)

    return invoke


def server_stream(stub_class, method: str, request) -> Invoke:
    async def invoke(channel, metadata):
        return [item async for item in getattr(stub_class(channel), method)(request, metadata=metadata, timeout=10)]

    return invoke


def client_stream(stub_class, method: str, messages: Callable[[], list]) -> Invoke:
    async def invoke(channel, metadata):
        async def requests():
            for message in messages():
                yield message

        return await getattr(stub_class(channel), method)(requests(), metadata=metadata, timeout=10)

    return invoke


@contextlib.asynccontextmanager
async def served(definition, config, certs: pathlib.Path) -> AsyncIterator[Target]:
    async with in_process_service(definition, config, client_tls=tls_of(certs, "operator")) as service:
        target = Target(service.address, certs)
        try:
            yield target
        finally:
            await target.close()
