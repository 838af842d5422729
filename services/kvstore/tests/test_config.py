import pathlib

import pytest

from primerl_common.config import ConfigError, load_config
from primerl_kvstore.config import KvstoreConfig

EXAMPLE = pathlib.Path(__file__).parents[1] / "config.example.toml"


def test_example_config_loads():
    config = load_config(KvstoreConfig, ["-c", str(EXAMPLE)])
    assert config.role == "both" and config.has_metadata and config.has_storage
    assert config.advertise_address() == "127.0.0.1:50056"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--role", "storage"], "node.metadata_address: required with role storage"),
        (["--node.metadata_address", "h:1"], "node.metadata_address: must be unset with role both"),
        (["--server.port", "0"], "node.advertise_address: required when server.port is 0"),
        (["--eviction.low_watermark", "0.96"], "low_watermark (0.96) must be below high_watermark (0.95)"),
        (["--role", "cache"], "role: Input should be 'both', 'metadata' or 'storage'"),
    ],
)
def test_bad_configs_name_the_key(argv, message):
    with pytest.raises(ConfigError) as error:
        load_config(KvstoreConfig, argv)
    assert message in str(error.value)


def test_metadata_only_may_pick_any_port():
    config = load_config(KvstoreConfig, ["--role", "metadata", "--server.port", "0"])
    assert config.has_metadata and not config.has_storage
