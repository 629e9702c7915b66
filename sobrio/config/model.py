"""What model runs and how it computes: weights, dtype, context length, kernels."""

from dataclasses import dataclass

from sobrio.config.fields import Checked, flag

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "cpp", "batched", "reference")  # see layers/attention.py


@dataclass(frozen=True)
class ModelConfig(Checked):
    """What runs and how it computes: weights, dtype, context length, kernels."""

    model: str = flag("smollm2-135m", "alias, HF model folder or .gguf file")
    dtype: str = flag("auto", "weights and activations (auto: bfloat16 where the CPU has fast bf16, else float32)",
                      choices=DTYPES)
    max_model_len: int | None = flag(None, "context length (default: the model's, capped by the KV cache)")
    seed: int = 0  # vLLM's engine seed; sampling is seeded per request (SamplingParams.seed)
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS
    batch_invariant: bool = flag(False, "greedy output independent of the batch (one kernel per op; slower at "
                                        "large batch)")

    def __post_init__(self) -> None:
        self._at_least(1, "max_model_len", optional=True)
        self._require("dtype", self.dtype in DTYPES, f"one of {', '.join(DTYPES)}")
        self._require("attention_backend", self.attention_backend in ATTENTION_BACKENDS,
                      f"one of {', '.join(ATTENTION_BACKENDS)}")
        self._require("model", bool(self.model), "a model alias, folder or file")
