#!/opt/venv/bin/python
"""Container health probe: asks the service's grpc.health.v1 Check (overall
status, service "") on 127.0.0.1 and exits 0 only when it answers SERVING.

Installed in every image as `primerl-healthcheck`; the Dockerfiles' HEALTHCHECK
runs `primerl-healthcheck <default port>`. The port comes from, in order:
PRIMERL_HEALTHCHECK_PORT, the service's PRIMERL_<SERVICE>_SERVER__PORT, the argument.
"""

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def port(default: str) -> str:
    if "PRIMERL_HEALTHCHECK_PORT" in os.environ:
        return os.environ["PRIMERL_HEALTHCHECK_PORT"]
    for key, value in os.environ.items():
        if key.startswith("PRIMERL_") and key.endswith("_SERVER__PORT"):
            return value
    return default


def main() -> int:
    address = f"127.0.0.1:{port(sys.argv[1] if len(sys.argv) > 1 else '50051')}"
    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError as exc:
            print(f"{address}: {exc.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    print(f"{address}: {status}")
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
