"""A development certificate authority: the CA, certificates that name their holder as
`spiffe://primerl/<role>/<name>` URI SANs (see _identity), and bearer tokens. `primerl-certs`
(primerl_launcher.certs) is its command line; tests make their certificates with it.

Keys are ECDSA P-256, private files 0600. For production use your own PKI with the same URI SANs.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import pathlib
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from primerl_common.config import TlsConfig
from primerl_common.security._identity import identity_uri

__all__ = ["DEFAULT_HOLDERS", "Authority", "Holder", "make_authority", "make_certificate", "make_token", "tls_of"]

DEFAULT_HOLDERS = (
    "trainer",
    "orchestrator",
    "inference",
    "router",
    "weight_broadcaster",
    "kvstore",
    "operator",
)
_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class Authority:
    certificate: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    path: pathlib.Path  # its PEM certificate


@dataclass(frozen=True)
class Holder:
    """What one certificate is for: NAME[:ROLE[+ROLE]]."""

    name: str
    roles: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Holder:
        name, _, roles = text.partition(":")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise ValueError(f"{text!r}: a name is letters, digits, '_', '.', '-'")
        parsed = tuple(role for role in roles.split("+") if role) or (re.sub(r"-\d+$", "", name),)
        return cls(name, parsed)


def _write(path: pathlib.Path, data: bytes, *, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    os.replace(tmp, path)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_authority(directory: pathlib.Path, *, days: int = 3650, name: str = "primerl development CA") -> Authority:
    """The CA in `directory` (ca.pem, ca-key.pem): the one there, else a new one."""
    cert_path, key_path = directory / "ca.pem", directory / "ca-key.pem"
    if cert_path.exists() and key_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        return Authority(x509.load_pem_x509_certificate(cert_path.read_bytes()), key, cert_path)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(key_path, _pem_key(key), private=True)
    _write(cert_path, certificate.public_bytes(serialization.Encoding.PEM))
    return Authority(certificate, key, cert_path)


def _alternative_names(holder: Holder, hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(identity_uri(role, holder.name)) for role in holder.roles
    ]
    seen = set()
    for host in (holder.name, holder.name.replace("_", "-"), *_LOCAL_HOSTS, *hosts):
        if host in seen or "_" in host:
            continue
        seen.add(host)
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def make_certificate(
    authority: Authority,
    directory: pathlib.Path,
    holder: Holder,
    *,
    hosts: Sequence[str] = (),
    days: int = 365,
    readable_key: bool = False,
) -> tuple[pathlib.Path, pathlib.Path]:
    """DIR/NAME.pem and DIR/NAME-key.pem for `holder`, signed by `authority` (server and client
    use). The key is 0600 unless `readable_key` (0644: for containers that run as another user)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.COMMON_NAME, holder.name),
                    x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "+".join(holder.roles)),
                ]
            )
        )
        .issuer_name(authority.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.SubjectAlternativeName(_alternative_names(holder, hosts)), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(authority.key.public_key()), critical=False)
        .sign(authority.key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{holder.name}.pem", directory / f"{holder.name}-key.pem"
    _write(key_path, _pem_key(key), private=not readable_key)
    _write(cert_path, certificate.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def make_token(directory: pathlib.Path, spec: str) -> str:
    """A bearer token for NAME:ROLES[@PEER]: the secret in DIR/tokens/NAME.token, its entry
    added to (or replaced in) DIR/tokens.toml. Returns the token."""
    head, _, peer = spec.partition("@")
    holder = Holder.parse(head)
    token = secrets.token_urlsafe(32)
    _write(directory / "tokens" / f"{holder.name}.token", token.encode() + b"\n", private=True)
    path = directory / "tokens.toml"
    blocks = path.read_text().split("\n[[tokens]]\n") if path.exists() else ["# bearer tokens (primerl-certs)"]
    kept = [block for block in blocks[1:] if not block.startswith(f'name = "{holder.name}"\n')]
    roles = ", ".join(f'"{role}"' for role in holder.roles)
    entry = f'name = "{holder.name}"\nroles = [{roles}]\nsha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\n'
    if peer:
        entry += f'peers = ["{peer}"]\n'
    _write(path, "\n[[tokens]]\n".join([blocks[0], *kept, entry]).encode(), private=True)
    return token


def tls_of(directory: pathlib.Path, name: str, *, tokens_file: pathlib.Path | None = None) -> TlsConfig:
    """The mtls section of the holder `name` whose files primerl-certs wrote to `directory`."""
    return TlsConfig(
        mode="mtls",
        cert=directory / f"{name}.pem",
        key=directory / f"{name}-key.pem",
        ca=directory / "ca.pem",
        tokens_file=tokens_file,
    )
