"""Configuration of the inference (flags > PRIMERL_INFERENCE_* > TOML > defaults)."""

from primerl_common.config import ServerConfig, ServiceConfig, service_settings


class InferenceConfig(ServiceConfig):
    """primerl inference: one vLLM engine behind gRPC: token-in/token-out generation with per-token policy
    versions, in-place weight updates, routed-expert capture, LoRA adapters.
    """

    service_name = "inference"
    model_config = service_settings("inference")

    server: ServerConfig = ServerConfig(port=50053)
