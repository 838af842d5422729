"""`primerl-register-replicas`: keeps inference replicas registered with the
weight broadcaster (and the router).

The broadcaster pushes new policies only to the replicas registered with it,
and keeps its registrations in memory; so does the router for replicas not in
its config file. This command registers each replica with each peer, checks
every --interval seconds that each peer still lists it (a restarted peer has
forgotten it) and registers it again when not. On SIGTERM (or Ctrl-C) it
deregisters them, so that a replica taken away is neither routed to nor pushed
to any more.

With --once it registers and exits: 0 once every peer lists every replica; 1
at once when a peer refuses a registration (any gRPC code but UNAVAILABLE or
DEADLINE_EXCEEDED, which are retried), or when a peer is still unreachable
after --timeout-s.

Every primerl image and install has it (it comes with primerl-common): the
inference pods' sidecar (Kubernetes), the Slurm job, the systemd unit and the
compose one-shot run it.

    primerl-register-replicas --broadcaster HOST:PORT [--router HOST:PORT [--role ROLE]] \\
        --replica ID=HOST:PORT [--replica ...] [--once [--timeout-s S]]

--role (both, prefill, decode) is what the router sends the replicas: whole requests, or the
prefill or decode half of a disaggregated one (the replicas' own replica.role).

Under mutual TLS it shows the certificate PRIMERL_TLS_CERT / _KEY / _CA name (with
PRIMERL_TLS_MODE=mtls; an operator certificate from `primerl-certs`): registering is an
operator's call. Without PRIMERL_TLS_MODE it speaks plaintext (the local demo).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from primerl.common.v1 import generation_pb2
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as wb_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc as wb_pb2_grpc
from primerl_common import observability, security
from primerl_common.server import channel_options
from primerl_launcher import __version__

__all__ = ["Broadcaster", "RegistrationFailed", "Router", "main", "parse_args", "register_once"]

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 5.0
ROLES = {
    "both": generation_pb2.REPLICA_ROLE_BOTH,
    "prefill": generation_pb2.REPLICA_ROLE_PREFILL,
    "decode": generation_pb2.REPLICA_ROLE_DECODE,
}
# Codes that mean "not reachable (yet)": --once retries them until --timeout-s.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
ONCE_RETRY_S = 1.0
# A peer that comes back (restarted, having forgotten the replicas) is found within seconds:
# channel_options caps gRPC's reconnect backoff.
_CHANNEL_OPTIONS = channel_options(4 * 1024 * 1024)


def parse_replica(text: str) -> tuple[str, str]:
    replica_id, sep, address = text.partition("=")
    host, colon, port = address.rpartition(":")
    if not sep or not replica_id or not colon or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not ID=HOST:PORT")
    return replica_id, address


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="primerl-register-replicas",
        description="Keeps inference replicas registered with the weight broadcaster (and the router); "
        "deregisters them on SIGTERM. With --once: registers them and exits.",
    )
    parser.add_argument("--broadcaster", required=True, metavar="HOST:PORT", help="the weight broadcaster")
    parser.add_argument(
        "--router", metavar="HOST:PORT", help="the router; unset: the router's config lists the replicas"
    )
    parser.add_argument(
        "--role",
        choices=sorted(ROLES),
        default="both",
        help="with --router: the replicas' role there (both: whole requests; prefill, decode: the halves of "
        "a disaggregated request); default both",
    )
    parser.add_argument(
        "--replica",
        action="append",
        required=True,
        type=parse_replica,
        metavar="ID=HOST:PORT",
        help="a replica's id and the address its peers reach it at (repeatable)",
    )
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between checks (default 10)")
    parser.add_argument("--once", action="store_true", help="register, then exit (0: registered, 1: not)")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=120.0,
        help="with --once: give up when a peer is still unreachable after this long (default 120)",
    )
    parser.add_argument("--no-deregister", action="store_true", help="leave the registrations on SIGTERM")
    args = parser.parse_args(argv)
    if args.interval <= 0 or args.timeout_s <= 0:
        parser.error("--interval and --timeout-s must be positive")
    return args


class Broadcaster:
    name = "weight broadcaster"

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = security.secure_channel(address, options=_CHANNEL_OPTIONS)
        self.stub = wb_pb2_grpc.WeightBroadcasterServiceStub(self.channel)

    def lists(self, replica_id: str, address: str) -> bool:
        replicas = self.stub.GetStatus(wb_pb2.GetStatusRequest(), timeout=CALL_TIMEOUT_S).replicas
        return any(r.replica_id == replica_id and r.address == address for r in replicas)

    def register(self, replica_id: str, address: str) -> None:
        # policy_version -1: the version the replica serves is unknown to this command.
        request = wb_pb2.RegisterReplicaRequest(replica_id=replica_id, address=address, policy_version=-1)
        self.stub.RegisterReplica(request, timeout=CALL_TIMEOUT_S)

    def deregister(self, replica_id: str) -> None:
        self.stub.DeregisterReplica(wb_pb2.DeregisterReplicaRequest(replica_id=replica_id), timeout=CALL_TIMEOUT_S)


class Router:
    name = "router"

    def __init__(self, address: str, role: int = generation_pb2.REPLICA_ROLE_BOTH) -> None:
        self.address = address
        self.role = role
        self.channel = security.secure_channel(address, options=_CHANNEL_OPTIONS)
        self.stub = router_pb2_grpc.RouterServiceStub(self.channel)

    def lists(self, replica_id: str, address: str) -> bool:
        replicas = self.stub.ListReplicas(router_pb2.ListReplicasRequest(), timeout=CALL_TIMEOUT_S).replicas
        return any(r.replica_id == replica_id and r.address == address and r.role == self.role for r in replicas)

    def register(self, replica_id: str, address: str) -> None:
        request = router_pb2.RegisterReplicaRequest(replica_id=replica_id, address=address, role=self.role)
        self.stub.RegisterReplica(request, timeout=CALL_TIMEOUT_S)

    def deregister(self, replica_id: str) -> None:
        self.stub.DeregisterReplica(router_pb2.DeregisterReplicaRequest(replica_id=replica_id), timeout=CALL_TIMEOUT_S)


Peer = Broadcaster | Router


@dataclass
class Failure:
    """A replica a peer does not list and could not be registered with."""

    peer: Peer
    replica_id: str
    replica_address: str
    error: grpc.RpcError

    @property
    def code(self) -> grpc.StatusCode:
        return self.error.code()

    def __str__(self) -> str:
        return (
            f"registering {self.replica_id} ({self.replica_address}) with the {self.peer.name} "
            f"{self.peer.address}: {self.code.name}: {self.error.details()}"
        )


class RegistrationFailed(RuntimeError):
    """register_once left replicas unregistered: a peer refused one, or stayed unreachable."""

    def __init__(self, failures: Sequence[Failure], why: str = "") -> None:
        self.failures = list(failures)
        self.why = why
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        return [f"{failure} ({self.why})" if self.why else str(failure) for failure in self.failures]


def register_missing(peers: Sequence[Peer], replicas: Sequence[tuple[str, str]]) -> list[Failure]:
    """One pass: registers each replica with each peer that does not list it; returns what failed."""
    failures = []
    for peer in peers:
        for replica_id, replica_address in replicas:
            try:
                if not peer.lists(replica_id, replica_address):
                    peer.register(replica_id, replica_address)
                    logger.info(
                        "registered %s at %s with the %s %s", replica_id, replica_address, peer.name, peer.address
                    )
            except grpc.RpcError as error:
                failures.append(Failure(peer, replica_id, replica_address, error))
    return failures


def register_once(
    peers: Sequence[Peer], replicas: Sequence[tuple[str, str]], timeout_s: float, stop: threading.Event
) -> None:
    """Registers every replica with every peer. RegistrationFailed at once on a refusal, or
    when a peer is still unreachable after `timeout_s` (or `stop` was set first)."""
    give_up_at = time.monotonic() + timeout_s
    while True:
        failures = register_missing(peers, replicas)
        if not failures:
            return
        refused = [f for f in failures if f.code not in RETRYABLE]
        if refused:
            raise RegistrationFailed(refused)
        if stop.is_set() or time.monotonic() + ONCE_RETRY_S > give_up_at:
            raise RegistrationFailed(failures, "stopped" if stop.is_set() else f"gave up after {timeout_s:g} s")
        stop.wait(ONCE_RETRY_S)


def keep_registered(
    peers: Sequence[Peer], replicas: Sequence[tuple[str, str]], interval_s: float, stop: threading.Event
) -> None:
    """Registers every replica with every peer that does not list it, every `interval_s`, until `stop`."""
    while not stop.is_set():
        for failure in register_missing(peers, replicas):
            logger.warning("%s (retrying in %g s)", failure, interval_s)
        stop.wait(interval_s)


def deregister_all(peers: Sequence[Peer], replicas: Sequence[tuple[str, str]]) -> None:
    for peer in peers:
        for replica_id, _ in replicas:
            try:
                peer.deregister(replica_id)
                logger.info("deregistered %s from the %s %s", replica_id, peer.name, peer.address)
            except grpc.RpcError as error:
                logger.warning(
                    "deregistering %s from the %s %s: %s: %s",
                    replica_id,
                    peer.name,
                    peer.address,
                    error.code().name,
                    error.details(),
                )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    observability.setup_logging(service="register-replicas", version=__version__, json=False)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    peers: list[Peer] = [Broadcaster(args.broadcaster)]
    if args.router:
        peers.append(Router(args.router, ROLES[args.role]))
    try:
        if args.once:
            try:
                register_once(peers, args.replica, args.timeout_s, stop)
            except RegistrationFailed as failed:
                for line in failed.lines():
                    logger.error("%s", line)
                return 1
            return 0
        keep_registered(peers, args.replica, args.interval, stop)
        if not args.no_deregister:
            deregister_all(peers, args.replica)
        return 0
    finally:
        for peer in peers:
            peer.channel.close()


if __name__ == "__main__":
    sys.exit(main())
