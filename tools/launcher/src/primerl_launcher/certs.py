"""`primerl-certs`: a development certificate authority and one certificate per service.

    primerl-certs DIR [--services NAME[:ROLE[+ROLE]] ...] [--hosts HOST ...] [--days N]
                      [--tokens NAME:ROLE[+ROLE][@PEER] ...] [--readable-keys]

Writes DIR/ca.pem and DIR/ca-key.pem (made once, reused by later runs so that certificates
added later are trusted by the same CA), then for each NAME DIR/NAME.pem and DIR/NAME-key.pem.
Point a service at them with `tls.cert`, `tls.key`, `tls.ca`. Each certificate names its
holder as the URI SAN `spiffe://primerl/<role>/<name>` per role (the role defaults to NAME
without a trailing `-<number>`: `inference-0` is an inference replica), and is valid as a
server for NAME (and NAME with `_` as `-`), localhost, 127.0.0.1, ::1 and each --hosts.

--tokens NAME:ROLES[@PEER] makes a bearer token for an environment or tenant: the secret in
DIR/tokens/NAME.token, its sha256 in DIR/tokens.toml (a service's `tls.tokens_file`); with
@PEER only the holder of PEER's certificate may present it.

Keys are ECDSA P-256, private files 0600. A development CA: for production use your own PKI
with the same URI SANs.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Mapping, Sequence

from primerl_common.config import TlsConfig
from primerl_common.security import identity_uri
from primerl_common.security.certificates import (
    DEFAULT_HOLDERS,
    Holder,
    make_authority,
    make_certificate,
    make_token,
    tls_of,
)

__all__ = ["main", "run_certificates"]


def run_certificates(
    directory: pathlib.Path, holders: Mapping[str, Sequence[str]], *, hosts: Sequence[str] = ()
) -> dict[str, TlsConfig]:
    """What `primerl up` under `[launcher] tls = "mtls"` uses: the CA in `directory` (the one
    there, so a run started again keeps it) and a new certificate for each name -> roles,
    valid for loopback and `hosts`. The tls section of each, by name."""
    authority = make_authority(directory)
    sections = {}
    for name, roles in holders.items():
        make_certificate(authority, directory, Holder(name, tuple(roles)), hosts=hosts)
        sections[name] = tls_of(directory, name)
    return sections


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="primerl-certs", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=pathlib.Path, help="where the CA, certificates and keys go")
    parser.add_argument(
        "--services",
        nargs="+",
        default=list(DEFAULT_HOLDERS),
        metavar="NAME[:ROLE[+ROLE]]",
        help=f"certificates to make (default: {' '.join(DEFAULT_HOLDERS)})",
    )
    parser.add_argument("--hosts", nargs="*", default=[], help="more host names/addresses every certificate serves")
    parser.add_argument("--days", type=int, default=365, help="validity of the certificates (default 365)")
    parser.add_argument(
        "--readable-keys",
        action="store_true",
        help="certificate keys 0644, not 0600 (containers that run as another user; development only)",
    )
    parser.add_argument("--tokens", nargs="*", default=[], metavar="NAME:ROLE[+ROLE][@PEER]", help="bearer tokens")
    args = parser.parse_args(argv)
    try:
        holders = [Holder.parse(text) for text in args.services]
        for spec in args.tokens:
            Holder.parse(spec.partition("@")[0])
    except ValueError as exc:
        parser.error(str(exc))
    authority = make_authority(args.directory)
    for holder in holders:
        cert, _ = make_certificate(
            authority, args.directory, holder, hosts=args.hosts, days=args.days, readable_key=args.readable_keys
        )
        print(f"{cert}  {' '.join(identity_uri(role, holder.name) for role in holder.roles)}")
    for spec in args.tokens:
        make_token(args.directory, spec)
        print(f"{args.directory / 'tokens' / (spec.partition(':')[0] + '.token')}  (tokens.toml: its sha256)")
    print(f"CA: {authority.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
