"""One flat configuration for the engine, in vLLM's names.

A field that is also a command-line flag of `sobrio serve | generate | chat` carries its help text (and
choices) in its metadata: `sobrio/engine_args.py` builds the flags from these fields, so every default is
written here and nowhere else. Bad values raise `ConfigError` naming the flag, never an assert.
"""

from dataclasses import dataclass, field
from typing import Any

from sobrio.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "cpp", "batched", "reference")  # see layers/attention.py


def flag(default: Any, help_text: str, choices: tuple[str, ...] | None = None) -> Any:
    """A field that is also a `--kebab-case` flag: its default, help and choices live only here."""
    metadata = {"help": help_text} | ({"choices": choices} if choices else {})
    return field(default=default, metadata=metadata)


def option_name(name: str) -> str:
    """How a user names a field: by its flag if it has one (`--block-size`), else by its Python name."""
    is_flag = "help" in EngineConfig.__dataclass_fields__[name].metadata
    return "--" + name.replace("_", "-") if is_flag else name


@dataclass
class EngineConfig:
    model: str = flag("smollm2-135m", "alias, HF model folder or .gguf file")
    dtype: str = flag("auto", "weights and activations (auto: bfloat16 where the CPU has fast bf16, else float32)",
                      choices=DTYPES)
    max_num_seqs: int = flag(64, "requests running at once")
    max_num_batched_tokens: int = flag(2048, "tokens one step computes")
    max_model_len: int | None = flag(None, "context length (default: the model's, capped by the KV cache)")
    block_size: int = flag(16, "tokens per KV-cache block (a multiple of 8)")
    kv_cache_memory: int | None = flag(None, "bytes for the KV cache (default: a share of available memory)")
    kv_cache_memory_fraction: float = 0.15  # of available memory, when kv_cache_memory is None
    kv_cache_memory_cap: int = 2 << 30
    enable_prefix_caching: bool = flag(True, "reuse the KV blocks of prompt prefixes seen before")
    max_num_waiting: int = flag(4096, "admission bound: past it a request is refused (HTTP 429)")
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS
    batch_invariant: bool = flag(False, "greedy output independent of the batch (one kernel per op; slower at "
                                        "large batch)")
    # prompt work in a step that carries decodes (vLLM's names; see engine/scheduler.py PrefillSlots)
    long_prefill_token_threshold: int = flag(256, "in a step with decodes, a prompt gets at most this many tokens "
                                                  "(0: no cap)")
    max_num_partial_prefills: int = flag(2, "in a step with decodes, at most this many prompts get tokens")
    max_long_partial_prefills: int = flag(1, "of those, at most this many have more than the threshold left")

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_choices()
        self._check_prefill_policy()

    def _require(self, name: str, ok: bool, rule: str) -> None:
        """Raise ConfigError naming the flag (or field), the rule and the value given."""
        if not ok:
            option = option_name(name)
            raise ConfigError(f"{option} must be {rule}, got {getattr(self, name)!r}", option)

    def _check_sizes(self) -> None:
        self._require("block_size", self.block_size > 0 and self.block_size % 8 == 0, "a positive multiple of 8")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_num_waiting", "kv_cache_memory_cap"):
            self._require(name, getattr(self, name) >= 1, ">= 1")
        for name in ("max_model_len", "kv_cache_memory", "num_threads"):
            self._require(name, getattr(self, name) is None or getattr(self, name) >= 1, ">= 1 (or unset)")
        self._require("kv_cache_memory_fraction", 0 < self.kv_cache_memory_fraction <= 1, "in (0, 1]")

    def _check_choices(self) -> None:
        self._require("dtype", self.dtype in DTYPES, f"one of {', '.join(DTYPES)}")
        self._require("attention_backend", self.attention_backend in ATTENTION_BACKENDS,
                      f"one of {', '.join(ATTENTION_BACKENDS)}")

    def _check_prefill_policy(self) -> None:
        self._require("long_prefill_token_threshold", self.long_prefill_token_threshold >= 0, ">= 0 (0: no cap)")
        self._require("max_num_partial_prefills", self.max_num_partial_prefills >= 1, ">= 1")
        self._require("max_long_partial_prefills",
                      1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills,
                      f"in [1, --max-num-partial-prefills={self.max_num_partial_prefills}]")
