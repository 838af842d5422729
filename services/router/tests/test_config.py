import pathlib

import pytest

from primerl_common.config import ConfigError, load_config
from primerl_router.config import RouterConfig

EXAMPLE = pathlib.Path(__file__).parents[1] / "config.example.toml"


def test_example_config_loads():
    config = load_config(RouterConfig, ["-c", str(EXAMPLE)])
    assert config.policy.name == "consistent_hash"
    assert [replica.replica_id for replica in config.replicas] == ["inference-0", "inference-1"]


def test_policy_and_its_options_are_checked(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text('[policy]\nname = "fastest"\n')
    with pytest.raises(ConfigError, match="unknown routing policy 'fastest'; known: cache_aware"):
        load_config(RouterConfig, ["-c", str(path)])
    path.write_text('[policy]\nname = "cache_aware"\n[policy.options]\nblock_bytes = 1\nblocks = 2\n')
    with pytest.raises(ConfigError, match="block_bytes: Input should be greater than or equal to 8; blocks: Extra"):
        load_config(RouterConfig, ["-c", str(path)])


def test_duplicate_replica_ids_are_refused(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text(
        '[[replicas]]\nreplica_id = "a"\naddress = "h:1"\n[[replicas]]\nreplica_id = "a"\naddress = "h:2"\n'
    )
    with pytest.raises(ConfigError, match="duplicate replica_id a"):
        load_config(RouterConfig, ["-c", str(path)])
