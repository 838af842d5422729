"""The process that plays a `kind = "verifiers"` environment (verifiers_env.py): started by the
orchestrator as `python -m primerl_orchestrator.environments.verifiers_process`, it talks to it
through its gRPC API only."""
