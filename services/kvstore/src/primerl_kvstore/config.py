"""Configuration of the kvstore (flags > PRIMERL_KVSTORE_* > TOML > defaults)."""

from primerl_common.config import ServerConfig, ServiceConfig, service_settings


class KvstoreConfig(ServiceConfig):
    """primerl kvstore: a pooled KV-cache store in DRAM and disk, keyed by model, rank, policy-version
    namespace and block hash.
    """

    service_name = "kvstore"
    model_config = service_settings("kvstore")

    server: ServerConfig = ServerConfig(port=50056)
