"""Configuration of the weight broadcaster (flags > PRIMERL_WEIGHT_BROADCASTER_* > TOML > defaults)."""

from pydantic import Field

from primerl_common.config import Section, ServerConfig, ServiceConfig, service_settings


class PushConfig(Section):
    """How versions reach the replicas."""

    retry_initial_s: float = Field(default=0.5, gt=0, description="first backoff after a failed push or probe")
    retry_max_s: float = Field(default=30.0, gt=0, description="longest backoff (it doubles per failure)")
    probe_interval_s: float = Field(
        default=2.0, gt=0, description="how often a current replica is checked (a restarted one gets pushed again)"
    )
    probe_timeout_s: float = Field(default=5.0, gt=0, description="deadline of a replica's GetLoad/GetServiceInfo")
    push_timeout_s: float = Field(default=600.0, gt=0, description="deadline of one UpdateWeights stream")


class WeightBroadcasterConfig(ServiceConfig):
    """primerl weight broadcaster: receives each new policy from the trainer and pushes it, in HF, kernel
    or FP8 format, to every inference replica.
    """

    service_name = "weight_broadcaster"
    model_config = service_settings("weight_broadcaster")

    server: ServerConfig = ServerConfig(port=50055)
    push: PushConfig = PushConfig()
