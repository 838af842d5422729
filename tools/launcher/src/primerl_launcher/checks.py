"""Checks across the services of a run, made before any of them starts: every peer address
that no table of the run serves must answer (a short health probe), and the trainer and
inference must compute in the same dtype unless the run file allows otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from typing import Any

from primerl_common.client import wait_for_serving
from primerl_launcher.spec import LaunchConfigError, ServiceSpec
from primerl_launcher.wiring import address_of, get_path

__all__ = ["check_dtypes", "check_outside_peers", "outside_peers"]

# The keys of each service's table that name a peer's address.
PEER_KEYS = {
    "orchestrator": ("peers.router", "peers.trainer", "peers.weight_broadcaster"),
    "trainer": ("publish.weight_broadcaster",),
    "router": ("versions.weight_broadcaster_address",),
}
_LOCAL_HOSTS = ("", "localhost", "127.0.0.1", "0.0.0.0", "::", "[::]", "::1", "[::1]")


def _peer_addresses(spec: ServiceSpec) -> Iterator[tuple[str, str]]:
    for key in PEER_KEYS.get(spec.service, ()):
        address = get_path(spec.table, key)
        if address:
            yield key, str(address)
    if spec.service == "router":
        for index, replica in enumerate(spec.table.get("replicas") or []):
            if isinstance(replica, Mapping) and replica.get("address"):
                yield f"replicas[{index}].address", str(replica["address"])
    if spec.service == "inference" and get_path(spec.table, "kv_cache_pool.enabled"):
        address = get_path(spec.table, "kv_cache_pool.metadata_address")
        if address:
            yield "kv_cache_pool.metadata_address", str(address)


def _endpoint(address: str) -> tuple[str, str]:
    host, _, port = address.rpartition(":")
    return ("127.0.0.1" if host in _LOCAL_HOSTS else host), port


def outside_peers(services: Mapping[str, ServiceSpec]) -> list[tuple[str, str]]:
    """(`[table] key`, address) of each peer address (after wiring) that no service of the run serves."""
    inside = {_endpoint(address_of(spec)) for spec in services.values()}
    return [
        (f"{spec.where} {key}", address)
        for spec in services.values()
        for key, address in _peer_addresses(spec)
        if _endpoint(address) not in inside
    ]


async def check_outside_peers(services: Mapping[str, ServiceSpec], *, timeout_s: float = 3.0) -> list[str]:
    """Probes every outside peer at once; LaunchConfigError naming each one that does not
    answer SERVING within timeout_s. Returns the peers that answered, as `[table] key = address`."""
    peers = outside_peers(services)

    async def serving(address: str) -> str | None:
        try:
            await wait_for_serving(address, timeout_s=timeout_s)
        except TimeoutError as exc:
            return str(exc)
        return None

    failures = await asyncio.gather(*(serving(address) for _, address in peers))
    errors = [
        f"  {where} = {address!r}: nothing serves there ({failure}), and no table of the run file starts it"
        for (where, address), failure in zip(peers, failures, strict=True)
        if failure is not None
    ]
    if errors:
        raise LaunchConfigError("a peer outside the run does not answer:\n" + "\n".join(errors))
    return [f"{where} = {address}" for where, address in peers]


def check_dtypes(
    services: Mapping[str, ServiceSpec], configs: Mapping[str, Mapping[str, Any]], *, allowed: bool
) -> str | None:
    """Inference sampling in another dtype than the trainer computes in makes the trainer's
    logprobs differ from inference's (mismatch_kl > 0). `configs`: each service's validated
    config (`--print-config`, where inference's engine.dtype auto is already the model's).
    LaunchConfigError naming both keys; with `allowed`, the same words as a warning (None when
    they agree)."""
    trainers = [name for name, spec in services.items() if spec.service == "trainer" and name in configs]
    if not trainers:
        return None
    [trainer] = trainers
    compute_dtype = configs[trainer]["model"]["compute_dtype"]
    differing = [
        (services[name], configs[name]["engine"]["dtype"])
        for name, spec in services.items()
        if spec.service == "inference" and name in configs and configs[name]["engine"]["dtype"] != compute_dtype
    ]
    if not differing:
        return None
    spec, dtype = differing[0]
    auto = " (auto: the model's config.json)" if get_path(spec.table, "engine.dtype") in (None, "auto") else ""
    message = (
        f"{spec.where} engine.dtype = {dtype}{auto} differs from {services[trainer].where} model.compute_dtype = "
        f"{compute_dtype}: the trainer's logprobs would not match inference's (mismatch_kl > 0)"
    )
    if allowed:
        return message + " ([launcher] allow_dtype_mismatch = true)"
    raise LaunchConfigError(
        f"{message}. Set both to one dtype, or [launcher] allow_dtype_mismatch = true to run like this."
    )
