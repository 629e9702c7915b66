"""What model runs and how it computes: weights, tokenizer, dtype, context length, kernels, sampling defaults."""

import json
from dataclasses import dataclass
from pathlib import Path

from sobrio.config.chat_template import load_chat_template
from sobrio.config.fields import Checked, flag
from sobrio.config.generation import check_overrides
from sobrio.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "cpp", "batched", "reference")  # see layers/attention.py
QUANTIZATION_METHODS = ("int8", "int8-weight-only", "int4")  # quantized at load: see layers/quantization.py
CHECKPOINT_QUANTIZATION = ("awq", "gptq", "gguf")  # vLLM's names: the checkpoint holds them (loader/awq_gptq.py)


def json_object(value: str) -> dict:
    """A JSON object flag (`'{"temperature": 0.5}'`)."""
    import argparse

    try:
        obj = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return obj


@dataclass(frozen=True)
class ModelConfig(Checked):
    """What runs and how it computes: weights, tokenizer, dtype, context length, kernels, sampling defaults."""

    model: str = flag("smollm2-135m", "alias, HF model folder or .gguf file")
    tokenizer: str | None = flag(None, "tokenizer to use instead of the model's own: alias, HF folder or .gguf")
    chat_template: str | None = flag(None, "chat template replacing the model's: a file, or the template inline "
                                           "(Jinja); lets a base model (gemma3-270m) answer chat requests")
    generation_config: str = flag("auto", "default sampling parameters of requests that set none: auto (the "
                                          "model's generation_config.json, or a GGUF's general.sampling.* "
                                          "metadata), vllm (none: temperature 1, top_p 1, ...), or a folder "
                                          "holding a generation_config.json")
    override_generation_config: dict | None = flag(None, 'JSON object overriding those defaults, e.g. '
                                                         '\'{"temperature": 0.6}\'', type=json_object)
    dtype: str = flag("auto", "weights and activations (auto: bfloat16 where the CPU has fast bf16, else float32)",
                      choices=DTYPES)
    quantization: str | None = flag(None, "quantize the weights at load, embedding and LM head too: int8 (W8A8), "
                                          "int8-weight-only or int4 (weight-only, groups of 32); awq, gptq, gguf: "
                                          "the checkpoint's own codes, kept as they are (docs/quantization.md)",
                                    choices=QUANTIZATION_METHODS + CHECKPOINT_QUANTIZATION)
    quantization_cache: str = flag("auto", "where --quantization int8, int8-weight-only or int4 keeps the weights "
                                           "it quantized, so that the next start of the same checkpoint reads them "
                                           "instead of quantizing again (loader/quantization_cache.py): a folder, "
                                           "off, or auto ($SOBRIO_QUANTIZATION_CACHE if set, else "
                                           "$SOBRIO_CACHE/quantized, ~/.cache/sobrio/quantized by default)")
    max_model_len: int | None = flag(None, "context length (default: the model's, capped by the KV cache)")
    max_logprobs: int = flag(20, "most logprobs (top_logprobs, prompt_logprobs) a request may ask for; more is "
                                 "a 400 (-1: up to the vocabulary)")
    seed: int = flag(0, "random seed: a request without a seed gets one made from this seed and the request's "
                        "number since start, so sampled answers repeat across restarts (requests with a seed "
                        "keep theirs)")
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS
    batch_invariant: bool = flag(False, "greedy output independent of the batch (one kernel per op; slower at "
                                        "large batch)")
    enforce_eager: bool = flag(False, "accepted for vLLM's scripts; no effect: on CPU sobrio always runs eagerly "
                                      "(there are no CUDA graphs to skip)")
    trust_remote_code: bool = flag(False, "accepted for vLLM's scripts; no effect: sobrio runs only its own model "
                                          "code, never code shipped with a model")

    def __post_init__(self) -> None:
        self._at_least(1, "max_model_len", optional=True)
        self._at_least(-1, "max_logprobs")
        self._require("dtype", self.dtype in DTYPES, f"one of {', '.join(DTYPES)}")
        self._require("attention_backend", self.attention_backend in ATTENTION_BACKENDS,
                      f"one of {', '.join(ATTENTION_BACKENDS)}")
        self._check_quantization()
        self._require("quantization_cache", bool(self.quantization_cache), "auto, off or a folder")
        self._require("model", bool(self.model), "a model alias, folder or file")
        self._require("tokenizer", self.tokenizer is None or bool(self.tokenizer), "a tokenizer alias, folder or "
                                                                                  "file (or unset)")
        self._require("generation_config", self.generation_config in ("auto", "vllm")
                      or Path(self.generation_config).expanduser().is_dir(), "auto, vllm or a folder")
        check_overrides(self.override_generation_config)
        if self.chat_template is not None:
            load_chat_template(self.chat_template)  # a missing file or a broken template fails now, not per request

    def _check_quantization(self) -> None:
        """A known method; and not with --batch-invariant, whose promise the quantized kernels break (they
        change with the step's row count). Whether the checkpoint agrees is the loader's check."""
        method, methods = self.quantization, QUANTIZATION_METHODS + CHECKPOINT_QUANTIZATION
        self._require("quantization", method is None or method in methods, f"one of {', '.join(methods)} (or unset)")
        if method is not None and self.batch_invariant:
            raise ConfigError(f"--quantization {method} cannot be used with --batch-invariant: the quantized "
                              f"kernels change with the step's row count", "--quantization")
