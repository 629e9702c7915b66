"""The typed view of an engine's stats, as a client hands them to the server (`/metrics`, load balancing,
the stats log). The core keeps plain dicts (they cross the process boundary as msgpack); the client turns
them into these once, so no reader above the seam indexes a dict by a key it hopes is there."""

from dataclasses import dataclass, field, fields

from sobrio.engine.stats import ITERATION_TOKENS_BUCKETS
from sobrio.structured.backend import COMPILE_SECONDS_BUCKETS


@dataclass
class EmbeddingRequestStats:
    """What /metrics records of a finished embedding request (monotonic seconds)."""

    num_prompt_tokens: list[int]
    arrival_time: float
    first_scheduled_time: float
    finished_time: float

@dataclass(frozen=True)
class HistogramCounts:
    """Per-bucket counts (the last past the largest bound) and their sum."""

    bounds: tuple[float, ...]
    counts: list[int]
    total: float

    @classmethod
    def of(cls, bounds: tuple[float, ...], snapshot: tuple[list[int], float] | list | None) -> "HistogramCounts":
        counts, total = snapshot or ([0] * (len(bounds) + 1), 0)
        return cls(bounds, list(counts), total)


def _from_dict(cls, values: dict | None):
    """A plain stats section as its dataclass (None stays None); keys the dataclass does not name are left."""
    if values is None:
        return None
    return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})


@dataclass(frozen=True)
class StructuredOutputStats:
    requests: int = 0
    forced_tokens: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    compile_seconds: HistogramCounts = HistogramCounts.of(COMPILE_SECONDS_BUCKETS, None)

    @classmethod
    def from_dict(cls, values: dict | None) -> "StructuredOutputStats":
        values = dict(values or {})
        values["compile_seconds"] = HistogramCounts.of(COMPILE_SECONDS_BUCKETS, values.get("compile_seconds"))
        return _from_dict(cls, values)


@dataclass(frozen=True)
class SpecDecodeStats:
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]


@dataclass(frozen=True)
class KVOffloadStats:
    hits_ram: int
    hits_disk: int
    misses_ram: int
    misses_disk: int
    stored_ram: int
    stored_disk: int
    ram_bytes: int
    disk_bytes: int
    loads: int
    load_seconds: float
    auth_failures: int
    disk_errors: int


@dataclass(frozen=True)
class KVTransferStats:
    bytes_sent: int
    bytes_received: int
    seconds_exporting: float
    seconds_importing: float


@dataclass(frozen=True)
class CollectiveStats:
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class TensorParallelStats:
    size: int
    all_reduce: CollectiveStats
    all_gather: CollectiveStats

    @classmethod
    def from_dict(cls, values: dict | None) -> "TensorParallelStats | None":
        if not values:
            return None
        return cls(values["size"], *(_from_dict(CollectiveStats, values.get(kind) or {})
                                     for kind in ("all_reduce", "all_gather")))


@dataclass(frozen=True)
class EngineStats:
    """One engine's state and counters: a core's, or a group's (summed) with each member's in `members`."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_blocks: int | None = None  # KV blocks allocated (None: no KV cache, an embedding model)
    name: str = "0"  # vLLM's `engine` label: a data-parallel rank, "prefill" or "decode"
    tables: dict[str, int] = field(default_factory=dict)  # entries of each per-request table
    iteration_tokens: HistogramCounts = HistogramCounts.of(ITERATION_TOKENS_BUCKETS, None)
    structured_outputs: StructuredOutputStats = StructuredOutputStats()
    spec_decode: SpecDecodeStats | None = None
    kv_offload: KVOffloadStats | None = None
    kv_transfer: KVTransferStats | None = None
    tensor_parallel: TensorParallelStats | None = None
    callback_errors: dict[str, int] = field(default_factory=dict)  # the client's delivery path, by type
    engine_thread_deaths: int = 0
    members: list["EngineStats"] = field(default_factory=list)  # a group's cores; empty for one core

    @classmethod
    def from_dict(cls, values: dict, **client: object) -> "EngineStats":
        """The core's plain dict (and a group's members) typed; `client` adds what the client itself counts."""
        plain = {f.name: values[f.name] for f in fields(cls) if f.name in values and f.name not in _SECTIONS}
        return cls(**plain, **client,
                   iteration_tokens=HistogramCounts.of(ITERATION_TOKENS_BUCKETS, values.get("iteration_tokens")),
                   structured_outputs=StructuredOutputStats.from_dict(values.get("structured_outputs")),
                   spec_decode=_from_dict(SpecDecodeStats, values.get("spec_decode")),
                   kv_offload=_from_dict(KVOffloadStats, values.get("kv_offload")),
                   kv_transfer=_from_dict(KVTransferStats, values.get("kv_transfer")),
                   tensor_parallel=TensorParallelStats.from_dict(values.get("tensor_parallel")),
                   members=[cls.from_dict(m) for m in values.get("members") or []])

    def cores(self) -> list["EngineStats"]:
        """The cores behind this engine, one line of `/metrics` each: a group's members, or itself."""
        return self.members or [self]


_SECTIONS = ("iteration_tokens", "structured_outputs", "spec_decode", "kv_offload", "kv_transfer",
             "tensor_parallel", "members", "callback_errors", "engine_thread_deaths")
