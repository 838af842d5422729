"""Keeps inference replicas registered with the weight broadcaster (and the router).

The broadcaster pushes new policies only to replicas registered with it, and
keeps its registrations in memory; so does the router for replicas not in its
config file. This loop registers each replica, checks every --interval seconds
that each peer still lists it (a restarted peer has forgotten it) and
registers it again when not. On SIGTERM it deregisters them, so that a
replica taken away is neither routed to nor pushed to any more.

Runs with the Python of any primerl image or install (grpcio and the primerl
stubs): the inference pods' sidecar, the Slurm job, by hand.

    python register_replica.py --broadcaster HOST:PORT [--router HOST:PORT] --replica ID=HOST:PORT ...
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

import grpc

from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as wb_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc as wb_pb2_grpc

logger = logging.getLogger("register_replica")


def parse_replica(text: str) -> tuple[str, str]:
    replica_id, sep, address = text.partition("=")
    if not sep or not replica_id or ":" not in address:
        raise argparse.ArgumentTypeError(f"{text!r} is not ID=HOST:PORT")
    return replica_id, address


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broadcaster", required=True, help="host:port of the weight broadcaster")
    parser.add_argument("--router", help="host:port of the router; unset: the router's config lists the replica")
    parser.add_argument(
        "--replica",
        action="append",
        required=True,
        type=parse_replica,
        metavar="ID=HOST:PORT",
        help="a replica's id and the address its peers reach it at (repeatable)",
    )
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between checks")
    parser.add_argument("--once", action="store_true", help="register, then exit")
    parser.add_argument("--no-deregister", action="store_true", help="leave the registration on SIGTERM")
    return parser.parse_args(argv)


class Broadcaster:
    name = "weight broadcaster"

    def __init__(self, channel: grpc.Channel) -> None:
        self.stub = wb_pb2_grpc.WeightBroadcasterServiceStub(channel)

    def lists(self, replica_id: str, address: str) -> bool:
        replicas = self.stub.GetStatus(wb_pb2.GetStatusRequest(), timeout=5).replicas
        return any(r.replica_id == replica_id and r.address == address for r in replicas)

    def register(self, replica_id: str, address: str) -> None:
        request = wb_pb2.RegisterReplicaRequest(replica_id=replica_id, address=address, policy_version=-1)
        self.stub.RegisterReplica(request, timeout=5)

    def deregister(self, replica_id: str) -> None:
        self.stub.DeregisterReplica(wb_pb2.DeregisterReplicaRequest(replica_id=replica_id), timeout=5)


class Router:
    name = "router"

    def __init__(self, channel: grpc.Channel) -> None:
        self.stub = router_pb2_grpc.RouterServiceStub(channel)

    def lists(self, replica_id: str, address: str) -> bool:
        replicas = self.stub.ListReplicas(router_pb2.ListReplicasRequest(), timeout=5).replicas
        return any(r.replica_id == replica_id and r.address == address for r in replicas)

    def register(self, replica_id: str, address: str) -> None:
        self.stub.RegisterReplica(router_pb2.RegisterReplicaRequest(replica_id=replica_id, address=address), timeout=5)

    def deregister(self, replica_id: str) -> None:
        self.stub.DeregisterReplica(router_pb2.DeregisterReplicaRequest(replica_id=replica_id), timeout=5)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    peers = [(args.broadcaster, Broadcaster(grpc.insecure_channel(args.broadcaster)))]
    if args.router:
        peers.append((args.router, Router(grpc.insecure_channel(args.router))))
    while not stop.is_set():
        done = True
        for address, peer in peers:
            for replica_id, replica_address in args.replica:
                try:
                    if not peer.lists(replica_id, replica_address):
                        peer.register(replica_id, replica_address)
                        logger.info(
                            "registered %s at %s with the %s %s", replica_id, replica_address, peer.name, address
                        )
                except grpc.RpcError as exc:
                    done = False
                    logger.warning("%s %s: %s", peer.name, address, exc.code().name)
        if args.once and done:
            return 0
        stop.wait(args.interval)
    if not args.no_deregister:
        for address, peer in peers:
            for replica_id, _ in args.replica:
                try:
                    peer.deregister(replica_id)
                    logger.info("deregistered %s from the %s %s", replica_id, peer.name, address)
                except grpc.RpcError as exc:
                    logger.warning(
                        "deregistering %s from the %s %s: %s", replica_id, peer.name, address, exc.code().name
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
