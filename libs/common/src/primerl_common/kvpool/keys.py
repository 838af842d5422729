"""Block keys: (model, parallel rank, policy-version namespace, content hash), checked at the
edge; and the cache salt a replica gives each request, which names the policy version the
request is served at (its namespace in the pool) before the caller's own salt."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from primerl.kvstore.v1 import kvstore_pb2
from primerl_common.errors import InvalidArgument

__all__ = [
    "MAX_CONTENT_HASH_BYTES",
    "MAX_NAME_CHARS",
    "BlockKey",
    "keys_from_proto",
    "namespace_of_salt",
    "policy_version_namespace",
    "policy_version_of_namespace",
    "served_cache_salt",
]

MAX_NAME_CHARS = 512
MAX_CONTENT_HASH_BYTES = 64
_NAMESPACE_PREFIX = "v"
_SALT_SEPARATOR = ":"


def policy_version_namespace(policy_version: int) -> str:
    """The pool namespace of the KV computed with one policy version's weights."""
    return f"{_NAMESPACE_PREFIX}{policy_version}"


def policy_version_of_namespace(namespace: str) -> int | None:
    """The policy version a namespace holds the KV of; None for one that names no version."""
    digits = namespace.removeprefix(_NAMESPACE_PREFIX)
    if namespace == digits or not digits.isdigit():
        return None
    return int(digits)


def served_cache_salt(policy_version: int, caller_salt: str) -> str:
    """The cache salt of a request served at `policy_version`: the version's namespace, then
    the caller's salt (which keeps prefixes of different callers apart within a version)."""
    namespace = policy_version_namespace(policy_version)
    return f"{namespace}{_SALT_SEPARATOR}{caller_salt}" if caller_salt else namespace


def namespace_of_salt(salt: str) -> str:
    """The pool namespace of a request's cache salt: its policy version's for a salt that
    `served_cache_salt` made, else the salt itself."""
    return salt.split(_SALT_SEPARATOR, 1)[0]


@dataclass(frozen=True, slots=True)
class BlockKey:
    """(model, parallel rank, policy-version namespace, content hash)."""

    model: str
    parallel_rank: int
    namespace: str
    content_hash: bytes

    @property
    def namespace_id(self) -> tuple[str, str]:
        return self.model, self.namespace

    def to_proto(self) -> kvstore_pb2.BlockKey:
        return kvstore_pb2.BlockKey(
            model=self.model, parallel_rank=self.parallel_rank, namespace=self.namespace, content_hash=self.content_hash
        )

    def file_stem(self) -> str:
        """A file name unique to the key (the key itself is kept in the file's header)."""
        digest = hashlib.blake2b(digest_size=20)
        for part in (self.model.encode(), str(self.parallel_rank).encode(), self.namespace.encode()):
            digest.update(len(part).to_bytes(4, "little"))
            digest.update(part)
        digest.update(self.content_hash)
        return digest.hexdigest()

    def __str__(self) -> str:
        return f"{self.model}/rank{self.parallel_rank}/{self.namespace!r}/{self.content_hash.hex()[:16]}"

    @classmethod
    def from_proto(cls, key: kvstore_pb2.BlockKey, field: str = "key") -> BlockKey:
        """The key a request names; InvalidArgument naming `field` when it is malformed."""
        if not key.model:
            raise InvalidArgument("model must not be empty", field=f"{field}.model")
        if len(key.model) > MAX_NAME_CHARS:
            raise InvalidArgument(f"longer than {MAX_NAME_CHARS} characters", field=f"{field}.model")
        if len(key.namespace) > MAX_NAME_CHARS:
            raise InvalidArgument(f"longer than {MAX_NAME_CHARS} characters", field=f"{field}.namespace")
        if not key.content_hash:
            raise InvalidArgument("content_hash must not be empty", field=f"{field}.content_hash")
        if len(key.content_hash) > MAX_CONTENT_HASH_BYTES:
            raise InvalidArgument(
                f"{len(key.content_hash)} bytes; at most {MAX_CONTENT_HASH_BYTES}", field=f"{field}.content_hash"
            )
        return cls(key.model, key.parallel_rank, key.namespace, bytes(key.content_hash))


def keys_from_proto(
    keys: Sequence[kvstore_pb2.BlockKey], *, field: str = "keys", max_keys: int | None = None
) -> list[BlockKey]:
    if max_keys is not None and len(keys) > max_keys:
        raise InvalidArgument(f"{len(keys)} keys; at most {max_keys} per request", field=field)
    return [BlockKey.from_proto(key, f"{field}[{index}]") for index, key in enumerate(keys)]
