"""Block keys: (model, parallel rank, policy-version namespace, content hash), checked at the edge.

The key type itself is shared with the pool's clients (primerl_common.kvpool)."""

from __future__ import annotations

from primerl.kvstore.v1 import kvstore_pb2
from primerl_common.errors import InvalidArgument
from primerl_common.kvpool import BlockKey, keys_from_proto

__all__ = ["BlockKey", "keys_from_proto", "namespace_from_request"]


def namespace_from_request(request: kvstore_pb2.RemoveNamespaceRequest) -> tuple[str, str]:
    if not request.model:
        raise InvalidArgument("must not be empty", field="model")
    return request.model, request.namespace
