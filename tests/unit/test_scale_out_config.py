"""Scale-out's pieces that need no model: what an in-process engine refuses, the replica rule's hashes on
token blocks, a group's merged stats, the KV transfer connectors on plain bytes."""

import numpy as np
import pytest

from sobrio import LLM
from sobrio.distributed.balance import Balanced, chained_hashes, choose
from sobrio.distributed.kv_connector import KVConnector
from sobrio.engine.core_groups import merge_stats
from sobrio.errors import ConfigError


@pytest.mark.parametrize("kwargs, option", [
    (dict(data_parallel_size=2), "--data-parallel-size"),
    (dict(kv_transfer_config={"kv_connector": "SharedMemoryConnector"}), "--kv-transfer-config")])
def test_an_offline_engine_refuses_what_needs_engine_processes(kwargs, option):
    with pytest.raises(ConfigError, match="behind `sobrio serve`") as exc:
        LLM("smollm2-135m", **kwargs)
    assert exc.value.option == option


def test_token_block_hashes_share_a_prefix_and_differ_by_salt():
    a = chained_hashes(list(range(40)), 16, 64, "acme")
    b = chained_hashes(list(range(32)) + [7] * 16, 16, 64, "acme")
    assert len(a) == 2 and a[:2] == b[:2] and len(b) == 3  # whole blocks only
    assert chained_hashes(list(range(40)), 16, 64, "globex")[0] != a[0]


def test_a_replica_that_saw_the_prefix_wins_unless_it_is_much_busier():
    seen, idle = Balanced(), Balanced()
    hashes = chained_hashes(list(range(64)), 16, 64)
    seen.remember(hashes)
    assert choose([idle, seen], hashes, slack=4) is seen
    seen.in_flight = 5
    assert choose([idle, seen], hashes, slack=4) is idle


def test_group_stats_add_counts_and_average_usage():
    merged = merge_stats([{"num_requests_running": 2, "kv_cache_usage_perc": 0.5, "tables": {"a": 1}},
                          {"num_requests_running": 1, "kv_cache_usage_perc": 0.1, "tables": {"a": 2}}])
    assert merged["num_requests_running"] == 3 and merged["kv_cache_usage_perc"] == pytest.approx(0.3)
    assert merged["tables"] == {"a": 3} and len(merged["members"]) == 2


@pytest.mark.parametrize("connector", ["SharedMemoryConnector", "TcpConnector"])
def test_exported_blocks_come_back_once_in_order(connector):
    sender, receiver = KVConnector(connector, "127.0.0.1", 0), KVConnector(connector, "127.0.0.1", 0)
    blocks = [np.full(1024, i, dtype=np.uint8) for i in range(3)]
    params = sender.export(blocks, [bytes([i]) * 16 for i in range(3)])
    got = receiver.fetch(params)
    assert [bytes(b) for b in got] == [b.tobytes() for b in blocks]
    assert receiver.fetch(params) == []  # taken once: a second fetch finds nothing (and fails soft)
    assert sender.bytes_sent == receiver.bytes_received == 3 * 1024
    sender.close()
