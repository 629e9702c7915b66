"""`--kv-transfer-config`: disaggregated prefill and decode (vLLM's `KVTransferConfig`, one JSON object).

`{"kv_connector": "SharedMemoryConnector"}` (or `"TcpConnector"`) starts two engine cores behind the server:
a prefill core that computes each prompt's KV blocks and exports them, and a decode core that imports them
and generates. The shared-memory connector hands the blocks over in a POSIX shared-memory segment (one
host); the TCP one serves them from the prefill core at `kv_ip:kv_port` (0: a free port), which the decode
core pulls from (another host can). `kv_buffer_size`: bytes of imported blocks the decode core holds until
its request takes them (an LRU; vLLM's name).
"""

from dataclasses import dataclass
from typing import Any

from sobrio.config.fields import Checked, flag, json_object_flag, json_object_with_defaults, require

OPTION = "--kv-transfer-config"
CONNECTORS = ("SharedMemoryConnector", "TcpConnector")
ROLES = ("kv_both",)
DEFAULTS: dict[str, Any] = {"kv_connector": None, "kv_role": "kv_both", "kv_ip": "127.0.0.1", "kv_port": 0,
                            "kv_buffer_size": 1 << 30}


def _require(ok: bool, why: str) -> None:
    require(ok, why, OPTION)


@dataclass(frozen=True)
class KVTransferConfig(Checked):
    kv_transfer_config: dict | None = flag(
        None, 'disaggregated prefill and decode as JSON, vLLM\'s keys: {"kv_connector": "SharedMemoryConnector" '
              '(one host) or "TcpConnector" (the decode core pulls from kv_ip:kv_port), "kv_role": "kv_both" (this '
              'server runs a prefill core and a decode core), "kv_buffer_size": bytes the decode core holds for '
              'imported blocks (1 GiB)}', type=json_object_flag(OPTION))

    def __post_init__(self) -> None:
        if self.kv_transfer_config is not None:
            spec = json_object_with_defaults(self.kv_transfer_config, OPTION, DEFAULTS)
            _require(spec["kv_connector"] in CONNECTORS, f"kv_connector must be one of {', '.join(CONNECTORS)}")
            _require(spec["kv_role"] in ROLES, "kv_role must be kv_both (this server runs both roles)")
            _require(isinstance(spec["kv_port"], int) and 0 <= spec["kv_port"] < 65536, "kv_port must be a port")
            _require(isinstance(spec["kv_buffer_size"], int) and spec["kv_buffer_size"] > 0,
                     "kv_buffer_size must be a positive number of bytes")
            object.__setattr__(self, "kv_transfer_config", spec)

    @property
    def enabled(self) -> bool:
        return self.kv_transfer_config is not None

    def get(self, key: str):
        return (self.kv_transfer_config or DEFAULTS)[key]
