"""The KV cache pool settings: an enabled pool needs its metadata address; the vLLM KV
transfer config made from them. (The pool itself, with real kvstore processes, is tested in
the top-level tests/test_kv_connector.py.)"""

import pytest
from pydantic import ValidationError

from primerl_inference.config import KvCachePoolConfig
from primerl_inference.kv_connector import kv_transfer_config


def test_an_enabled_pool_needs_its_metadata_address() -> None:
    with pytest.raises(ValidationError, match=r"kv_cache_pool\.metadata_address is required"):
        KvCachePoolConfig(enabled=True)
    assert kv_transfer_config(KvCachePoolConfig(), model="m") is None
    transfer = kv_transfer_config(KvCachePoolConfig(enabled=True, metadata_address="h:1", mode="load"), model="m")
    assert transfer is not None and transfer.is_kv_consumer and not transfer.is_kv_producer
    assert transfer.kv_connector_extra_config["model"] == "m"
