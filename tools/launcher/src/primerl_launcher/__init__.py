"""primerl's launcher and deployment tools, outside every service image.

- `primerl up` / `primerl demo-config` (cli, run, spec, wiring, progress, report,
  warm_start, processes): the six services of a run started from one TOML file, followed
  and stopped. Services are separate processes (`python -m primerl_<service>`), each
  configured by its own table of the launch file; the launcher talks to them only through
  their gRPC APIs. An orchestrator started beside a running `primerl up` (one run of a
  trainer with runs) gets its config filled as the launcher's own (run_orchestrator).
- `primerl-register-replicas` (register_replicas): registers inference replicas with the
  router and the weight broadcaster in deployments that run no launcher.
- `primerl-make-tiny-model` (tiny_model): the tiny test models, made locally from a seed.

Imports primerl-common and the stubs only, never a service package (an import-linter
contract keeps it so).
"""

from importlib.metadata import version as _version

__version__ = _version("primerl-launcher")
