"""Configuration of the weight broadcaster (flags > PRIMERL_WEIGHT_BROADCASTER_* > TOML > defaults)."""

from __future__ import annotations

import os
import pathlib
import tempfile
from typing import Literal

from pydantic import Field, field_validator, model_validator

from primerl_common.config import Section, ServerConfig, ServiceConfig, service_settings
from primerl_common.stripes import DEFAULT_STREAMS


class PushConfig(Section):
    """How versions reach the replicas."""

    retry_initial_s: float = Field(default=0.5, gt=0, description="first backoff after a failed push or probe")
    retry_max_s: float = Field(default=30.0, gt=0, description="longest backoff (it doubles per failure)")
    probe_interval_s: float = Field(
        default=2.0, gt=0, description="how often a current replica is checked (a restarted one gets pushed again)"
    )
    probe_timeout_s: float = Field(default=5.0, gt=0, description="deadline of a replica's GetLoad/GetServiceInfo")
    push_timeout_s: float = Field(default=600.0, gt=0, description="deadline of one UpdateWeights stream")
    streams: int = Field(
        default=DEFAULT_STREAMS,
        ge=1,
        le=64,
        description="parallel UpdateWeights streams (each its own connection) a gRPC push is striped over, so that "
        "TLS runs on several cores; used with replicas listing weights.striped (1: a single stream)",
    )


class PublishLimitsConfig(Section):
    """Caps on PublishWeights, checked before anything of a publish is held: what `begin` announces,
    then each tensor's header before its bytes are allocated. A publish past one is refused
    RESOURCE_EXHAUSTED naming the field. Sized for a trillion-parameter model (~10^5 tensors,
    ~2 TB in bf16, ~4 TB in float32)."""

    max_tensors: int = Field(default=1_000_000, gt=0, description="tensors of one publish")
    max_bytes: int = Field(default=8 * 1024**4, gt=0, description="bytes of one publish (all its tensors)")
    max_concurrent: int = Field(
        default=1,
        ge=1,
        description="publishes received at once (each holds a whole version in memory until stored); "
        "another one is refused RESOURCE_EXHAUSTED with a retry hint",
    )
    max_stripes: int = Field(
        default=16, ge=1, le=256, description="streams one striped publish may be split over (begin.num_stripes)"
    )
    stripe_join_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="a striped publish whose streams have not all begun this long after its first fails, nothing "
        "stored",
    )


class ReplicaConfig(Section):
    """An inference replica registered at start (others register at run time): a restarted
    broadcaster knows it again without anyone registering it."""

    replica_id: str = Field(min_length=1)
    address: str = Field(min_length=1, description="host:port of its inference.v1 server")
    delta: bool = Field(default=False, description="push only the tensors changed since its version, when it can")
    format: Literal["hf", "kernel", "kernel_fp8"] = Field(
        default="hf", description="weights it loads: HF names, vLLM kernel layout, or kernel layout in block FP8"
    )
    transport: Literal["auto", "grpc", "shared_fs", "nccl"] = Field(
        default="auto",
        description="auto: the broadcaster picks per push: shared memory (shm.folder) when the replica is on this "
        "host and reads that memory, else nccl where collective.backend is set and the replica can join, else "
        "grpc; or one of: UpdateWeights stream, a folder of shared_fs.folder named in the stream, a collective "
        "group with the trainer (needs collective.backend and format hf)",
    )


class StoreConfig(Section):
    """Where the latest version is kept."""

    spill_folder: pathlib.Path | None = Field(
        default=None,
        description="folder (created if missing) each published version is written to and memory-mapped from, "
        "instead of held in RAM; a restarted broadcaster starts on the newest version there; empty: RAM only",
    )

    @field_validator("spill_folder")
    @classmethod
    def _usable_folder(cls, folder: pathlib.Path | None) -> pathlib.Path | None:
        if folder is None:
            return None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):  # permissions alone do not tell (root, read-only mounts)
                pass
        except OSError as exc:
            raise ValueError(f"{folder} cannot be created or written: {exc}") from None
        return folder.resolve()


def _check_writable_folder(folder: pathlib.Path) -> None:
    """A ValueError naming `folder` unless it is an existing folder this process may create files in."""
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{folder} is not writable")


class SharedFsConfig(Section):
    """The shared-filesystem transport: versions written once into a folder that replicas read."""

    folder: pathlib.Path | None = Field(
        default=None,
        description="existing, writable folder the broadcaster owns, readable by the replicas at the same path; "
        "empty: replicas cannot register with the shared_fs transport",
    )
    keep_versions: int = Field(default=2, ge=1, description="versions whose folders are kept (older ones deleted)")

    @field_validator("folder")
    @classmethod
    def _writable_folder(cls, folder: pathlib.Path | None) -> pathlib.Path | None:
        if folder is None:
            return None
        _check_writable_folder(folder)
        return folder.resolve()


def _default_shm_folder() -> pathlib.Path | None:
    shm = pathlib.Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else None


class ShmConfig(Section):
    """The same-host transport: each version placed once in shared memory, which replicas on this
    host load from (transport auto picks it for them)."""

    folder: pathlib.Path | None = Field(
        default_factory=_default_shm_folder,
        description="shared-memory filesystem (tmpfs) the broadcaster keeps a folder of its own in (removed when it "
        "stops; one a broadcaster that died left is removed by the next one); replicas that advertise the same "
        "one load from it; default /dev/shm when present; empty: no same-host transport",
    )
    keep_versions: int = Field(
        default=1, ge=1, description="versions whose folders are kept (older ones deleted once no push needs them)"
    )

    @field_validator("folder")
    @classmethod
    def _writable_folder(cls, folder: pathlib.Path | None) -> pathlib.Path | None:
        if folder is None:
            return None
        _check_writable_folder(folder)
        # absolute, not resolved: replicas compare the path they were given (/dev/shm may be a link)
        return folder.absolute()


class CollectiveConfig(Section):
    """The nccl transport: the trainer broadcasts each version to the replicas in a collective group
    that the broadcaster forms (it hosts the group's TCPStore)."""

    backend: Literal["nccl", "gloo"] | None = Field(
        default=None,
        description="nccl (GPU buffers; replicas on GPUs) or gloo (CPU buffers, any replica); empty: replicas "
        "cannot register with the nccl transport",
    )
    store_host: str = Field(
        default="127.0.0.1", description="address the TCPStore listens on, as the trainer and replicas reach it"
    )
    store_port: int = Field(default=0, ge=0, le=65535, description="TCPStore port; 0: any free one")
    timeout_s: float = Field(default=120.0, gt=0, description="deadline of forming a group and of each broadcast")
    bucket_mib: int = Field(default=256, gt=0, description="tensors are broadcast packed in buffers of this size")
    keep_data: bool = Field(
        default=False,
        description="ask the trainer for every version's data too, so that a replica that fails or restarts "
        "catches up at once over gRPC (otherwise only when some replica is not in the group)",
    )


class WeightBroadcasterConfig(ServiceConfig):
    """primerl weight broadcaster: receives each new policy from the trainer and pushes it, in HF, kernel
    or FP8 format, to every inference replica.
    """

    service_name = "weight_broadcaster"
    model_config = service_settings("weight_broadcaster")

    server: ServerConfig = ServerConfig(port=50055)
    push: PushConfig = PushConfig()
    publish: PublishLimitsConfig = PublishLimitsConfig()
    store: StoreConfig = StoreConfig()
    shared_fs: SharedFsConfig = SharedFsConfig()
    shm: ShmConfig = ShmConfig()
    collective: CollectiveConfig = CollectiveConfig()
    replicas: list[ReplicaConfig] = Field(
        default=[], description="replicas registered at start (others register with RegisterReplica)"
    )

    @model_validator(mode="after")
    def _unique_replica_ids(self) -> WeightBroadcasterConfig:
        ids = [replica.replica_id for replica in self.replicas]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"replicas: duplicate replica_id {', '.join(duplicates)}")
        shared = [r.replica_id for r in self.replicas if r.transport == "shared_fs"]
        if shared and self.shared_fs.folder is None:
            raise ValueError(f"replicas: {', '.join(shared)} use transport shared_fs, which needs shared_fs.folder")
        nccl = [r.replica_id for r in self.replicas if r.transport == "nccl"]
        if nccl and self.collective.backend is None:
            raise ValueError(f"replicas: {', '.join(nccl)} use transport nccl, which needs collective.backend")
        not_hf = [r.replica_id for r in self.replicas if r.transport == "nccl" and r.format != "hf"]
        if not_hf:
            raise ValueError(f"replicas: {', '.join(not_hf)} use transport nccl, which carries format hf only")
        return self
