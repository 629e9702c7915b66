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
    # prompt work in a step that carries decodes (vLLM's names; see engine/scheduler.py PrefillSlots)
    long_prefill_token_threshold: int = 256  # a prompt with more tokens left is long and gets this many; 0: no cap
    max_num_partial_prefills: int = 2  # prompts that may get tokens in such a step
    max_long_partial_prefills: int = 1  # of those, how many may be long

    def __post_init__(self) -> None:
        assert self.block_size > 0 and self.block_size % 8 == 0, "block_size must be a multiple of 8"
        assert self.max_num_seqs > 0 and self.max_num_batched_tokens > 0
        backends = ("auto", "cpp", "batched", "reference")
        assert self.attention_backend in backends, f"unknown attention backend {self.attention_backend}"
        assert self.dtype in ("auto", "float32", "bfloat16", "float16"), f"unknown dtype {self.dtype}"
        self._check_prefill_policy()

    def _check_prefill_policy(self) -> None:
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0 (0: no cap), "
                             f"got {self.long_prefill_token_threshold}")
        if self.max_num_partial_prefills < 1:
            raise ValueError(f"max_num_partial_prefills must be >= 1, got {self.max_num_partial_prefills}")
        if not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            raise ValueError(f"max_long_partial_prefills must be in [1, max_num_partial_prefills="
                             f"{self.max_num_partial_prefills}], got {self.max_long_partial_prefills}")
