"""Configuration of the weight broadcaster (flags > PRIMERL_WEIGHT_BROADCASTER_* > TOML > defaults)."""

from primerl_common.config import ServerConfig, ServiceConfig, service_settings


class WeightBroadcasterConfig(ServiceConfig):
    """primerl weight broadcaster: receives each new policy from the trainer and pushes it, in HF, kernel
    or FP8 format, to every inference replica.
    """

    service_name = "weight_broadcaster"
    model_config = service_settings("weight_broadcaster")

    server: ServerConfig = ServerConfig(port=50055)
