"""Map a Hugging Face architecture (or model_type) to sobrio's class."""

import torch

from sobrio.errors import InvalidRequestError
from sobrio.models.gemma3 import Gemma3ForCausalLM
from sobrio.models.llama import CausalLM, LlamaForCausalLM

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


def build_model(config, max_positions: int, weights, dtype: torch.dtype, attention_backend: str) -> CausalLM:
    from sobrio.layers.attention import resolve_backend
    from sobrio.models.weights import load_weights

    with torch.device("cpu"):
        model = model_class(config)(config, max_positions, resolve_backend(attention_backend))
    load_weights(model, weights)
    model = model.to(dtype).eval().requires_grad_(False)
    model.prepack()
    return model
