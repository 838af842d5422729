"""Configuration of the trainer (flags > PRIMERL_TRAINER_* > TOML > defaults)."""

from primerl_common.config import ServerConfig, ServiceConfig, service_settings


class TrainerConfig(ServiceConfig):
    """primerl trainer: PyTorch training of the policy: own Qwen3/Qwen3-MoE models, RL and SFT losses,
    router replay, FSDP2, checkpoints.
    """

    service_name = "trainer"
    model_config = service_settings("trainer")

    server: ServerConfig = ServerConfig(port=50052)
