"""Configuration of the orchestrator (flags > PRIMERL_ORCHESTRATOR_* > TOML > defaults)."""

from primerl_common.config import ServerConfig, ServiceConfig, service_settings


class OrchestratorConfig(ServiceConfig):
    """primerl orchestrator: the RL loop and the API environments call: tasks, episodes, rewards,
    advantages, staleness control, batches to the trainer.
    """

    service_name = "orchestrator"
    model_config = service_settings("orchestrator")

    server: ServerConfig = ServerConfig(port=50051)
