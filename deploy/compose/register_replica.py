"""Registers inference replicas with the weight broadcaster, which then pushes
each new policy version to them (the latest one first, when one exists).

A one-shot container of deploy/compose.yaml runs it in a primerl image (any:
the stubs are in primerl-common) once the replicas and the broadcaster report
healthy; it retries while the broadcaster is unreachable and exits 0 once every
replica is registered.

    python register_replica.py --weight-broadcaster HOST:PORT REPLICA_ID=HOST:PORT ...
"""

from __future__ import annotations

import argparse
import sys
import time

import grpc

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2, weight_broadcaster_pb2_grpc


def parse_replica(text: str) -> tuple[str, str]:
    replica_id, sep, address = text.partition("=")
    if not sep or not replica_id or not address:
        raise argparse.ArgumentTypeError(f"{text!r}: expected REPLICA_ID=HOST:PORT")
    return replica_id, address


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weight-broadcaster", required=True, help="HOST:PORT of the weight broadcaster")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="give up after this long (default 120)")
    parser.add_argument("replicas", nargs="+", type=parse_replica, metavar="REPLICA_ID=HOST:PORT")
    args = parser.parse_args()

    give_up_at = time.monotonic() + args.timeout_s
    with grpc.insecure_channel(args.weight_broadcaster) as channel:
        stub = weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(channel)
        for replica_id, address in args.replicas:
            request = weight_broadcaster_pb2.RegisterReplicaRequest(replica_id=replica_id, address=address)
            while True:
                try:
                    reply = stub.RegisterReplica(request, timeout=10, wait_for_ready=True)
                    break
                except grpc.RpcError as error:
                    retry = error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                    if not retry or time.monotonic() > give_up_at:
                        print(f"{replica_id} at {address}: {error.code().name}: {error.details()}", file=sys.stderr)
                        return 1
                    time.sleep(1.0)
            print(
                f"registered {replica_id} at {address} with {args.weight_broadcaster} "
                f"(latest policy version {reply.latest_policy_version})",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
