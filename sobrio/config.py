"""One flat configuration for the engine, in vLLM's names."""

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context, capped by the KV cache
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: a share of available memory
    kv_cache_memory_fraction: float = 0.15
    kv_cache_memory_cap: int = 2 << 30
    enable_prefix_caching: bool = True
    max_num_waiting: int = 4096  # admission bound; past it add_request raises EngineOverloadedError
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    attention_backend: str = "auto"  # auto | cpp | batched | reference (see layers/attention.py)
    batch_invariant: bool = False  # one kernel and reduction order per op: output independent of the batch

    def __post_init__(self) -> None:
        assert self.block_size > 0 and self.block_size % 8 == 0, "block_size must be a multiple of 8"
        assert self.max_num_seqs > 0 and self.max_num_batched_tokens > 0
        backends = ("auto", "cpp", "batched", "reference")
        assert self.attention_backend in backends, f"unknown attention backend {self.attention_backend}"
        assert self.dtype in ("auto", "float32", "bfloat16", "float16"), f"unknown dtype {self.dtype}"
