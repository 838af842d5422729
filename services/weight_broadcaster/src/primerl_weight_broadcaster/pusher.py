"""The task that keeps one registered inference replica on the latest version.

One asyncio task per replica (`ReplicaPusher`): it probes the replica (GetServiceInfo for its instance id and
capabilities, GetLoad for the version it serves), pushes the latest version over
inference.v1 UpdateWeights when the replica is behind (striped over `push.streams` streams on
connections of their own where the replica takes striped updates), and retries a failed push with
exponential backoff; a replica that does not answer at all (restarting) is probed again every
probe interval, and its version is unknown meanwhile. Replicas never wait on each other. A
replica that restarts comes back on its checkpoint's version; the periodic probe sees it behind
(or a new instance id) and pushes the latest version again without anyone asking.

A TRANSPORT_NCCL replica's task also makes it join the collective group a version is broadcast
in (collective.py), when the trainer announces one; if that fails, the replica is pushed over
gRPC like any other once the broadcaster holds data newer than what it serves.

A TRANSPORT_AUTO replica (the default) takes, at each push, the transport `ReplicaPusher.route`
picks from what its last probe said: shared memory (shm.py) when it lists "weights.shm" and
advertises this host's boot id and this shared memory, else the collective group where the
broadcaster has one and the replica can join it, else gRPC. A push over shared memory that
fails is made again at once over gRPC as a full update (all or nothing either way: a replica
applies an update whole or not at all); a replica that could not read the folder gets gRPC
until it restarts. The pick, and why, is in the replica's status and in metrics.py.

LoRA adapters (adapters.py) ride on the same task: after each probe, `AdapterSync`
(adapter_sync.py) unloads the removed adapters the replica holds and pushes the adapters it
lacks over LoadAdapter, with a backoff of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import TYPE_CHECKING

import grpc
import torch
from google.rpc import error_details_pb2

from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl_common.client import make_channel
from primerl_common.errors import error_details, field_violations
from primerl_common.sealed_streams import SealedCaller
from primerl_common.server import channel_options
from primerl_common.stripes import stripe_channel_options
from primerl_weight_broadcaster import metrics
from primerl_weight_broadcaster.adapter_sync import AdapterSync
from primerl_weight_broadcaster.formats import format_name
from primerl_weight_broadcaster.replicas import (
    CAPABILITY_REPLICA_DELTA,
    CAPABILITY_REPLICA_FORMAT,
    CAPABILITY_REPLICA_SHARED_FS,
    CAPABILITY_REPLICA_STRIPED,
    Replica,
    UnsupportedByReplica,
    pick_transport,
    split_stripes,
)
from primerl_weight_broadcaster.store import PublishedVersion
from primerl_weight_broadcaster.wire import UPDATE_WEIGHTS_METHOD, update_weights_call

if TYPE_CHECKING:
    from primerl_weight_broadcaster.replica_set import ReplicaSet

__all__ = ["ReplicaPusher"]

logger = logging.getLogger(__name__)

# A replica's refusals of a shared-memory update that say it cannot take one at all.
_CANNOT_READ_SHM = {"SHM_UNREADABLE", "CAPABILITY_MISSING"}


class ReplicaPusher:
    """The task keeping one replica current."""

    def __init__(self, replica: Replica, replicas: ReplicaSet) -> None:
        self.replica = replica
        self._replicas = replicas
        self._settings = replicas.settings
        self._channel = make_channel(replica.address, max_attempts=1)
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)
        # One channel (a connection of its own) per stripe of a striped push.
        self._stripe_channels = [
            make_channel(replica.address, max_attempts=1, extra_options=stripe_channel_options(index))
            for index in range(self._settings.streams if self._settings.streams > 1 else 0)
        ]
        # Pushes as sealed streams where the replica serves a sealed port (else over mTLS).
        self._sealed = SealedCaller(
            self._channel, replica.address.rpartition(":")[0], options=channel_options(64 << 20)
        )
        self.wake = asyncio.Event()
        # The `begin` that makes the replica join the next version's collective group.
        self.collective: inference_pb2.WeightUpdateBegin | None = None
        self.adapters = AdapterSync(
            replica.replica_id,
            self._stub,
            replicas.adapters,
            retry_initial_s=self._settings.retry_initial_s,
            retry_max_s=self._settings.retry_max_s,
            timeout_s=self._settings.push_timeout_s,
            on_change=lambda held: self._set(adapter_versions=held, adapter_owners=replicas.adapters.owners_of(held)),
        )
        self.task = asyncio.create_task(self._run(), name=f"replica-{replica.replica_id}")

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self._channel.close()
        for channel in self._stripe_channels:
            await channel.close()
        await self._sealed.close()

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), timeout=seconds)
        self.wake.clear()

    async def _run(self) -> None:
        replica = self.replica
        while True:
            latest = self._replicas.store.latest
            probed = False
            try:
                if self.collective is not None:
                    # A failed group update leaves it unprobed: it joins no other group until a
                    # probe answers again (a dead member would hold the next group to its timeout).
                    begin, self.collective = self.collective, None
                    await self._push_collective(begin)
                    continue
                await self._probe()
                probed = True
                # Adapters first: a few MB, and their failures back off on their own.
                await self.adapters.sync(replica.instance_id, replica.capabilities)
                if latest is None or replica.policy_version >= latest.policy_version:
                    # Nothing published yet counts as current: there is nothing newer to serve (a
                    # version broadcast without data to the broadcaster comes with the next one).
                    behind = replica.policy_version < self._replicas.latest_policy_version
                    self._set(
                        state=pb2.REPLICA_STATE_BEHIND if behind else pb2.REPLICA_STATE_CURRENT,
                        last_error="",
                        num_consecutive_failures=0,
                        next_retry_at=0.0,
                    )
                    await self._sleep(self._settings.probe_interval_s)
                    continue
                await self._push(latest)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures = replica.num_consecutive_failures + 1
                backoff = min(self._settings.retry_initial_s * 2 ** (failures - 1), self._settings.retry_max_s)
                if not probed:
                    # Down (restarting): probing is cheap, and once it is back every probe interval
                    # lost keeps it on old weights. Failed pushes back off in full.
                    backoff = min(backoff, self._settings.probe_interval_s)
                if isinstance(exc, grpc.aio.AioRpcError):
                    message = f"{exc.code().name}: {exc.details()}"
                else:
                    message = str(exc) if isinstance(exc, (UnsupportedByReplica, ValueError)) else repr(exc)
                # A replica that is down fails every probe: said at the first failure, then now and then.
                log = logger.warning if probed or failures == 1 or failures % 20 == 0 else logger.debug
                log("replica %s: %s (failure %d, retry in %.1fs)", replica.replica_id, message, failures, backoff)
                # A replica that does not answer serves nothing anyone can count on, and may come back
                # as a new process on its checkpoint's weights: its version is unknown until it answers.
                version = replica.policy_version if probed else -1
                replica.reachable = probed
                if not probed:
                    self.adapters.forget()
                self._set(
                    state=pb2.REPLICA_STATE_FAILED,
                    policy_version=version,
                    last_error=message,
                    num_consecutive_failures=failures,
                    next_retry_at=time.time() + backoff,
                )
                await self._sleep(backoff)

    async def _probe(self) -> None:
        timeout = self._settings.probe_timeout_s
        info = (await self._stub.GetServiceInfo(inference_pb2.GetServiceInfoRequest(), timeout=timeout)).info
        load = (await self._stub.GetLoad(inference_pb2.GetLoadRequest(), timeout=timeout)).load
        replica = self.replica
        replica.reachable = True
        if info.instance_id != replica.instance_id:
            if replica.instance_id:
                logger.info("replica %s restarted (instance %s)", replica.replica_id, info.instance_id)
            replica.instance_id = info.instance_id
            replica.capabilities = frozenset(info.capabilities)
            replica.attributes = dict(info.attributes)
            replica.shm_failed = ""
            transport, reason = self.route()
            if replica.transport == pb2.TRANSPORT_AUTO:
                logger.info(
                    "replica %s: transport %s (%s)", replica.replica_id, metrics.transport_name(transport), reason
                )
                self._set(transport_reason=reason)
        if load.policy_version != replica.policy_version:
            self._set(policy_version=load.policy_version)

    def route(self) -> tuple[int, str]:
        """The transport the next push takes, and why (`pick_transport`)."""
        return pick_transport(self.replica, self._replicas.shm, self._replicas.collective)

    async def _push(self, latest: PublishedVersion) -> None:
        replica = self.replica
        transport, reason = self.route()
        shared_fs = transport == pb2.TRANSPORT_SHARED_FS
        name = format_name(replica.format)
        for capability, what in (
            (CAPABILITY_REPLICA_FORMAT.format(name), f"load {name} weights"),
            *([(CAPABILITY_REPLICA_SHARED_FS, "read weights from a shared folder")] if shared_fs else []),
        ):
            if capability not in replica.capabilities:
                raise UnsupportedByReplica(f"the replica cannot {what} (no capability {capability})")
        self._set(
            state=pb2.REPLICA_STATE_UPDATING, target_policy_version=latest.policy_version, transport_reason=reason
        )
        latest = await self._replicas.store.in_format(latest, replica.format)
        delta = (
            replica.delta
            and CAPABILITY_REPLICA_DELTA in replica.capabilities
            and replica.pushed == (replica.instance_id, replica.policy_version)
            and len(latest.tensors_since(replica.policy_version)) < len(latest.tensors)
        )
        base = replica.policy_version if delta else None
        begin = inference_pb2.WeightUpdateBegin(
            policy_version=latest.policy_version,
            format=replica.format,
            delta=delta,
            base_policy_version=base or 0,
        )
        started = time.monotonic()
        sealed = False  # whether the tensors went as sealed streams (logged)
        if shared_fs:
            assert self._replicas.shared is not None  # registration checks it
            async with self._replicas.shared.use(latest, base) as (path, manifest):
                begin.shared_fs_path = str(path)
                begin.num_tensors, begin.num_bytes = manifest.num_tensors, manifest.num_bytes
                await self._stub.UpdateWeights(
                    iter([inference_pb2.UpdateWeightsRequest(begin=begin)]), timeout=self._settings.push_timeout_s
                )
        elif transport == pb2.TRANSPORT_SHM:
            try:
                await self._push_shm(latest, begin, base)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                transport, reason = pb2.TRANSPORT_GRPC, self._shm_failed(exc)
                self._set(transport_reason=reason)
                # Full: after a load that failed half way, the replica holds no version to build on.
                begin = inference_pb2.WeightUpdateBegin(policy_version=latest.policy_version, format=replica.format)
                delta, base = False, None
                sealed = await self._push_grpc(latest, begin, base)
        else:
            sealed = await self._push_grpc(latest, begin, base)
        folder = begin.shared_fs_path or begin.shm_path
        logger.info(
            "replica %s: pushed policy version %d (%d tensors, %.1f MiB, %s, %s, %s%s)",
            replica.replica_id,
            latest.policy_version,
            begin.num_tensors,
            begin.num_bytes / 2**20,
            format_name(replica.format),
            f"delta from {base}" if delta else "full",
            metrics.transport_name(transport) + (" sealed" if sealed else ""),
            f", folder {folder}" if folder else "",
        )
        self._pushed(begin, started, sent=transport != pb2.TRANSPORT_SHM, transport=transport)

    async def _push_grpc(
        self, latest: PublishedVersion, begin: inference_pb2.WeightUpdateBegin, base: int | None
    ) -> bool:
        """The tensors streamed over UpdateWeights (striped where the replica takes it; as
        sealed streams where it serves a sealed port: then True)."""
        tensors = latest.tensors_since(base)
        begin.num_tensors = len(tensors)
        begin.num_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
        # The replicas pushed the same tensors at once share their serialization.
        key = (latest.policy_version, latest.format, base)
        striped = self._stripe_channels and CAPABILITY_REPLICA_STRIPED in self.replica.capabilities
        parts = split_stripes(tensors, len(self._stripe_channels)) if striped and len(tensors) > 1 else [tensors]
        sealed = await self._sealed.open(UPDATE_WEIGHTS_METHOD, len(parts), timeout_s=self._settings.probe_timeout_s)
        if len(parts) > 1:
            await self._push_striped(begin, key, parts, sealed)
        else:
            requests = self._replicas.serializer.update(key, begin, tensors)
            await self._update(sealed, 0, self._channel, requests)
        return sealed is not None

    def _update(self, sealed: tuple[int, list] | None, index: int, channel: grpc.aio.Channel, requests):
        """The UpdateWeights call of stream `index`: sealed with its session's key, or over mTLS."""
        if sealed is None:
            return update_weights_call(channel)(requests, timeout=self._settings.push_timeout_s)
        port, keys = sealed
        return self._sealed.call(
            port,
            keys[index],
            index,
            requests,
            inference_pb2.UpdateWeightsResponse,
            timeout_s=self._settings.push_timeout_s,
        )

    async def _push_shm(
        self, latest: PublishedVersion, begin: inference_pb2.WeightUpdateBegin, base: int | None
    ) -> None:
        """The version's folder in shared memory (written once, however many replicas load it),
        named as the replica sees it; only `begin` goes over gRPC."""
        shm = self._replicas.shm
        assert shm is not None  # route checks it
        folder, why = shm.route(self.replica.attributes)
        if folder is None:
            raise UnsupportedByReplica(why)
        async with shm.use(latest, base) as (path, manifest):
            begin.shm_path = str(folder / path.name)
            begin.num_tensors, begin.num_bytes = manifest.num_tensors, manifest.num_bytes
            await self._stub.UpdateWeights(
                iter([inference_pb2.UpdateWeightsRequest(begin=begin)]), timeout=self._settings.push_timeout_s
            )

    def _shm_failed(self, exc: Exception) -> str:
        """Logs a failed push over shared memory; why the replica gets gRPC instead (from now on,
        if it cannot load from shared memory at all)."""
        replica = self.replica
        if isinstance(exc, grpc.aio.AioRpcError):
            message = f"{exc.code().name}: {exc.details()}"
            reasons = {d.reason for d in error_details(exc) if isinstance(d, error_details_pb2.ErrorInfo)}
            cannot_read = bool(reasons & _CANNOT_READ_SHM) or "begin.shm_path" in field_violations(exc)
        else:
            message, cannot_read = str(exc) or repr(exc), False
        metrics.shm_fallback(replica.replica_id)
        if cannot_read:
            replica.shm_failed = f"it could not load from shared memory ({message})"
        logger.warning(
            "replica %s: the push over shared memory failed (%s): pushing over gRPC%s",
            replica.replica_id,
            message,
            " from now on (until it restarts)" if cannot_read else "",
        )
        return f"the shared-memory push failed ({message}): gRPC" + (" from now on" if cannot_read else "")

    async def _push_striped(
        self,
        begin: inference_pb2.WeightUpdateBegin,
        key: tuple[object, ...],
        parts: list[list[tuple[str, torch.Tensor]]],
        sealed: tuple[int, list] | None,
    ) -> None:
        """`parts` of the tensors over the stripe channels, one UpdateWeights stream each, all
        joined by the replica into one update (applied when all arrived, or not at all)."""
        session = uuid.uuid4().hex
        calls = []
        for index, (channel, part) in enumerate(zip(self._stripe_channels, parts, strict=False)):
            stripe_begin = inference_pb2.WeightUpdateBegin()
            stripe_begin.CopyFrom(begin)
            stripe_begin.stripe_session, stripe_begin.num_stripes = session, len(parts)
            stripe_begin.stripe_index = index
            requests = self._replicas.serializer.update((*key, len(parts), index), stripe_begin, part)
            calls.append(self._update(sealed, index, channel, requests))
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        errors = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        if errors:
            # The stripe that failed says why; the others only that another one failed (ABORTED).
            errors.sort(key=lambda exc: isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.ABORTED)
            raise errors[0]

    async def _push_collective(self, begin: inference_pb2.WeightUpdateBegin) -> None:
        """Makes the replica join a collective group and receive the version from the trainer."""
        self._set(state=pb2.REPLICA_STATE_UPDATING, target_policy_version=begin.policy_version)
        started = time.monotonic()
        try:
            await self._stub.UpdateWeights(
                iter([inference_pb2.UpdateWeightsRequest(begin=begin)]), timeout=self._settings.push_timeout_s
            )
        except BaseException:
            self._replicas.collective_failed(begin.policy_version)
            raise
        logger.info(
            "replica %s: received policy version %d over collective group %s (rank %d of %d)",
            self.replica.replica_id,
            begin.policy_version,
            begin.collective.group_name,
            begin.collective.rank,
            begin.collective.world_size,
        )
        self._pushed(begin, started, sent=False, transport=pb2.TRANSPORT_NCCL)

    def _pushed(self, begin: inference_pb2.WeightUpdateBegin, started: float, *, sent: bool, transport: int) -> None:
        """The replica serves `begin`'s version now, which came over `transport`; `sent`: the
        broadcaster sent its bytes."""
        replica = self.replica
        metrics.pushed(replica.replica_id, transport)
        self._set(
            last_push_transport=transport,
            state=pb2.REPLICA_STATE_CURRENT,
            policy_version=begin.policy_version,
            last_error="",
            num_consecutive_failures=0,
            next_retry_at=0.0,
            last_push_s=time.monotonic() - started,
            num_bytes_sent_total=replica.num_bytes_sent_total + (begin.num_bytes if sent else 0),
            num_tensors_last_push=begin.num_tensors,
            num_bytes_last_push=begin.num_bytes,
            last_push_delta=begin.delta,
        )
        replica.pushed = (replica.instance_id, begin.policy_version)

    def _set(self, **changes: object) -> None:
        if all(getattr(self.replica, key) == value for key, value in changes.items()):
            return
        for key, value in changes.items():
            setattr(self.replica, key, value)
        self._replicas.changed(self.replica)
