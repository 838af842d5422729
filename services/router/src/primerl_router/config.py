"""Configuration of the router (flags > PRIMERL_ROUTER_* > TOML > defaults)."""

from primerl_common.config import ServerConfig, ServiceConfig, service_settings


class RouterConfig(ServiceConfig):
    """primerl router: fronts the inference replicas: routing policies, prefill/decode groups, health,
    failover and policy versions.
    """

    service_name = "router"
    model_config = service_settings("router")

    server: ServerConfig = ServerConfig(port=50054)
