"""The paged KV cache: block size, how much memory it takes, prefix reuse."""

from dataclasses import dataclass

from sobrio.config.fields import Checked, flag

KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")  # sobrio/kv/cache.py maps them to torch dtypes


@dataclass(frozen=True)
class CacheConfig(Checked):
    """The paged KV cache: block size, its memory, prefix reuse."""

    block_size: int = flag(16, "tokens per KV-cache block (a multiple of 8)")
    kv_cache_memory: int | None = flag(
        None, "bytes for the KV cache (default: a share of the memory available once the weights are loaded)")
    kv_cache_memory_fraction: float = 0.15  # of the memory available less the weights, when kv_cache_memory is None
    kv_cache_memory_cap: int = 2 << 30  # bytes, when kv_cache_memory is None
    enable_prefix_caching: bool = flag(True, "reuse the KV blocks of prompt prefixes seen before")
    kv_cache_dtype: str = flag("auto", "KV-cache rows: auto (the model's dtype), or int8 / fp8_e4m3 (fp8) with a "
                                       "bf16 scale per token and kv head: 1.94x the blocks in the same memory",
                               choices=KV_CACHE_DTYPES)
    kv_offload_ram: int | None = flag(None, "bytes of host RAM for KV blocks evicted from the cache (a tier behind "
                                            "it, LRU): a prefix seen before loads back instead of being "
                                            "recomputed (unset: no tiers)")
    kv_offload_disk: int | None = flag(None, "bytes of disk for KV blocks pushed out of the RAM tier, encrypted per "
                                             "tenant (AES-256-GCM; the master key in $SOBRIO_KV_MASTER_KEY or "
                                             "--kv-offload-key-file); they survive restarts (unset: RAM tier only)")
    kv_offload_dir: str | None = flag(None, "the disk tier's directory (default: kv-offload under sobrio's cache)")
    kv_offload_key_file: str | None = flag(None, "file holding the disk tier's master key (64 hex digits or 32 "
                                                 "bytes); never give the key itself on the command line")
    gpu_memory_utilization: float = flag(0.9, "accepted for vLLM's scripts; no effect on CPU: the KV cache takes "
                                              "--kv-cache-memory")

    def __post_init__(self) -> None:
        self._require("block_size", self.block_size > 0 and self.block_size % 8 == 0, "a positive multiple of 8")
        self._at_least(1, "kv_cache_memory", optional=True)
        self._at_least(1, "kv_cache_memory_cap")
        self._require("kv_cache_memory_fraction", 0 < self.kv_cache_memory_fraction <= 1, "in (0, 1]")
        self._require("kv_cache_dtype", self.kv_cache_dtype in KV_CACHE_DTYPES, "one of " + ", ".join(KV_CACHE_DTYPES))
        self._at_least(1, "kv_offload_ram", optional=True)
        self._at_least(1, "kv_offload_disk", optional=True)
        self._require("kv_offload_disk", self.kv_offload_disk is None or self.kv_offload_ram is not None,
                      "set with --kv-offload-ram (blocks reach the disk through the RAM tier)")
        self._require("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "in (0, 1]")
