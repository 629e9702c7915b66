"""Map a Hugging Face architecture (or model_type) to sobrio's class."""

import contextlib

import torch

from sobrio.config.model import QUANTIZATION_METHODS
from sobrio.errors import InvalidRequestError
from sobrio.memory import release_freed_memory
from sobrio.models.gemma3 import Gemma3ForCausalLM
from sobrio.models.llama import CausalLM, LlamaForCausalLM
from sobrio.models.weights import Prequantized, PrequantizedWeight

_BY_MODEL_TYPE = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
}


def model_class(config) -> type[CausalLM]:
    cls = _BY_MODEL_TYPE.get(config.model_type)
    if cls is None:
        raise InvalidRequestError(
            f"unsupported architecture {config.model_type!r}; supported: {', '.join(_BY_MODEL_TYPE)}"
        )
    return cls


def build_model(config, max_positions: int, weights, dtype: torch.dtype, attention_backend: str,
                batch_invariant: bool = False, quantization: str | None = None,
                calibration_ids: list[int] | None = None) -> CausalLM:
    from sobrio.layers.attention import BatchInvariantAttention, resolve_backend
    from sobrio.models import fused_decode
    from sobrio.models.weights import load_weights

    if batch_invariant:
        check_batch_invariant(attention_backend)
    attn_cls = BatchInvariantAttention if batch_invariant else resolve_backend(attention_backend)
    with torch.device("cpu"), _parameters_not_initialized():
        model = model_class(config)(config, max_positions, attn_cls, batch_invariant=batch_invariant)
    # Cast while the parameters are still unwritten memory, so the checkpoint is copied straight into the
    # dtype: loaded first in float32 and cast after, a bf16 model passed through three times its size.
    model = model.to(dtype).eval().requires_grad_(False)
    prequantized = load_weights(model, weights)
    install_prequantized(model, prequantized, dtype)
    if quantization in QUANTIZATION_METHODS:  # at load; a checkpoint's own method (awq, gptq, gguf) is in place
        model.quantize(quantization, calibration_ids)
    model.prepack()
    model.model.fused_decode = fused_decode.build(model)
    release_freed_memory()  # the load's transient tensors, kept by the heap otherwise
    return model


@contextlib.contextmanager
def _parameters_not_initialized():
    """Build the modules without drawing their random initial weights: the checkpoint overwrites every
    parameter (`load_weights` asserts it), and drawing Gemma 3's 168M-entry embedding alone took 2.2 s of
    each start on a 2-core AMD. transformers' `no_init_weights` does the same."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
             "trunc_normal_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    for name in names:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


def install_prequantized(model: CausalLM, prequantized: Prequantized, dtype: torch.dtype) -> None:
    """Replace each module a checkpoint holds quantized by the module its records build: a Linear keeps its
    float bias (cast already); the embedding's record also serves as the tied LM head."""
    for name, records in prequantized.items():
        record = records[0] if len(records) == 1 else records[0].concat(records)
        if name == "model.embed_tokens":
            model.model.embed_tokens = _embedding(record, dtype)
            if model.lm_head is None:
                model.quantized_lm_head = record.linear(None)
        elif name == "lm_head":
            model.quantized_lm_head, model.lm_head = record.linear(None), None
        else:
            parent_name, _, child = name.rpartition(".")
            bias = model.get_submodule(name).bias
            setattr(model.get_submodule(parent_name), child, record.linear(None if bias is None else bias.detach()))


def _embedding(record: PrequantizedWeight, dtype: torch.dtype) -> torch.nn.Module:
    if not hasattr(record, "embedding"):
        raise NotImplementedError(f"{type(record).__name__}: a pre-quantized embedding of this kind is not "
                                  f"supported")
    return record.embedding(dtype)


def check_batch_invariant(attention_backend: str) -> None:
    """Batch invariance rests on the C++ operators: the matmul and attention kernels, and RMSNorm, RoPE and
    the gated activation, which compute each row alone (their PyTorch fallbacks may not)."""
    from sobrio.layers.cpu_ops import cpu_ops, invariant_linear_available

    if cpu_ops() is None or not invariant_linear_available():
        raise InvalidRequestError("batch_invariant needs sobrio's C++ operators built on a CPU with AVX-512 "
                                  "(run `python -m sobrio.csrc`; SOBRIO_DISABLE_CPP must be unset)")
    if attention_backend not in ("auto", "cpp"):
        raise InvalidRequestError(f"batch_invariant has its own attention; attention_backend "
                                  f"{attention_backend!r} cannot be used with it")
