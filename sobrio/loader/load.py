"""Everything the engine needs from a model source: config, tokenizer, weights, default sampling parameters."""

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sobrio.config import ModelConfig
from sobrio.config.chat_template import load_chat_template
from sobrio.config.model import QUANTIZATION_METHODS
from sobrio.loader.awq_gptq import (
    AwqGptqConfig,
    check_quantization_flag,
    iter_awq_gptq_weights,
    parse_quantization_config,
    read_quantization_config,
)
from sobrio.loader.generation import default_sampling
from sobrio.loader.gguf import float_weight_shapes, gguf_tokenizer, iter_gguf_weights, prepared_folder
from sobrio.loader.hf import iter_safetensors_weights, safetensors_elements
from sobrio.loader.quantization_cache import QuantizationCache
from sobrio.loader.resolve import ModelSource, gguf_packed, is_prepared, resolve_model
from sobrio.models.weights import WeightItem
from sobrio.timing import log_step

logger = logging.getLogger(__name__)


@dataclass
class LoadedModelFiles:
    source: ModelSource
    folder: Path  # config.json + tokenizer files
    config: object  # transformers PretrainedConfig
    tokenizer: object  # transformers tokenizer (fast); None where only the weights are wanted (an engine core)
    default_sampling: dict = field(default_factory=dict)  # --generation-config: SamplingParams keywords
    quantization: AwqGptqConfig | None = None  # an AWQ or GPTQ checkpoint's quantization_config
    gguf_packed: bool = False  # `--quantization gguf`: the GGUF's blocks as they are (its folder holds no floats)

    def iter_weights(self, in_place: bool = False) -> Iterator[WeightItem]:
        """The checkpoint's weights by name; `in_place`: safetensors' float tensors unread, for `load_weights`
        to read straight into the parameters (each item read before the next is asked for)."""
        if self.quantization is not None:
            return iter_awq_gptq_weights(self.folder, self.quantization)
        if self.gguf_packed:
            return iter_gguf_weights(self.source.path, self.config, packed=True)
        return iter_safetensors_weights(self.folder, in_place)  # a GGUF's prepared folder holds them dequantized


# bytes a weight takes in each `--quantization` computed at load (int8: a byte and its scales; int4: half a
# byte, group scales, and the int8 embedding/head), against bf16's 2: for sizing the KV cache before loading
_BYTES_PER_WEIGHT = {"int8": 1.1, "int8-weight-only": 1.1, "int4": 0.75}


def expected_weight_bytes(files: LoadedModelFiles, dtype_bytes: int, quantization: str | None) -> int:
    """About what the loaded weights will take (one copy each), before any is read: the checkpoint's float
    elements at `dtype_bytes` each (or the quantization's bytes per weight); a checkpoint held quantized (GGUF blocks
    kept, AWQ/GPTQ) by its files' size."""
    if files.gguf_packed:
        return files.source.path.stat().st_size
    floats, others = _float_elements(files)
    if files.quantization is not None:
        return floats * 2 + others
    per_weight = _BYTES_PER_WEIGHT.get(quantization or "", dtype_bytes)
    return int(floats * per_weight) + others


def _float_elements(files: LoadedModelFiles) -> tuple[int, int]:
    """(float elements, other bytes) of the checkpoint's float weights: from their file's header, or a GGUF's
    tensor table where its prepared folder holds none yet."""
    if files.source.is_gguf and not is_prepared(files.folder, weights=True):
        return sum(math.prod(shape) for _, shape in float_weight_shapes(files.source.path, files.config)), 0
    return safetensors_elements(files.folder)


def quantization_cache(setting: str, files: LoadedModelFiles, quantization: str | None,
                       dtype) -> QuantizationCache | None:
    """`--quantization-cache`'s entry for this model quantized at load by `quantization` (None: not quantized
    at load, or the cache off). A tensor-parallel rank's slice is not cached (the caller passes none)."""
    if quantization not in QUANTIZATION_METHODS or files.quantization is not None or files.gguf_packed:
        return None
    return QuantizationCache.for_model(setting, files.folder, quantization, dtype)


def load_model_files(model: str | ModelConfig, tokenizer: bool = True) -> LoadedModelFiles:
    """Resolve, prepare (a GGUF, once) and read the model's config; with `tokenizer`, also its tokenizer
    (`--tokenizer`'s if set, with `--chat-template` applied) and its default sampling parameters. The steps
    are logged with their timings where the tokenizer is wanted (the API process, or offline)."""
    from transformers import AutoConfig

    mc = model if isinstance(model, ModelConfig) else ModelConfig(model=model)
    packed = gguf_packed(mc.quantization)  # else a GGUF's prepared folder holds the float weights read
    if not tokenizer:
        source = resolve_model(mc.model)
        folder = prepared_folder(source.path, weights=not packed) if source.is_gguf else source.path
        quantization = _checkpoint_quantization(mc, source, folder)
        return LoadedModelFiles(source, folder, _text_config(AutoConfig.from_pretrained(folder)), None,
                                quantization=quantization, gguf_packed=packed)
    with log_step(logger, "resolving model %s", mc.model):
        source = resolve_model(mc.model)
    folder = _prepared(source, weights=not packed)
    quantization = _checkpoint_quantization(mc, source, folder)
    with log_step(logger, "reading the config and tokenizer of %s", mc.model):
        config = _text_config(AutoConfig.from_pretrained(folder))
        tok = _tokenizer(folder) if mc.tokenizer is None else _tokenizer_of(mc.tokenizer)
        if mc.chat_template is not None:
            tok.chat_template = load_chat_template(mc.chat_template)
        sampling = default_sampling(mc.generation_config, folder, source.path if source.is_gguf else None,
                                    mc.override_generation_config)
    return LoadedModelFiles(source, folder, config, tok, sampling, quantization, packed)


def _checkpoint_quantization(mc: ModelConfig, source: ModelSource, folder: Path) -> AwqGptqConfig | None:
    """What the checkpoint holds quantized (its config.json's quantization_config), checked against
    `--quantization` before anything large is read."""
    qc = None if source.is_gguf else read_quantization_config(folder)
    check_quantization_flag(mc.quantization, qc, source.is_gguf, mc.batch_invariant, mc.model)
    return None if qc is None else parse_quantization_config(qc, mc.model)


def load_tokenizer(files: LoadedModelFiles, mc: ModelConfig):
    """The model's tokenizer (`--tokenizer`'s if set): the one already loaded, or read now (an engine core,
    which loads none at start, reads it at its first structured-output request)."""
    if files.tokenizer is not None:
        return files.tokenizer
    return _tokenizer(files.folder) if mc.tokenizer is None else _tokenizer_of(mc.tokenizer)


def _prepared(source: ModelSource, weights: bool) -> Path:
    """The model's folder; a GGUF's prepared once (with `weights`: its float32 weights too, for the dense path)."""
    if not source.is_gguf:
        return source.path
    if (folder := prepared_folder(source.path, prepare=False, weights=weights)) is not None:
        return folder
    what = "config, tokenizer, float32 weights" if weights else "config, tokenizer"
    with log_step(logger, "preparing %s once (%s; later starts reuse them)", source.path.name, what):
        return prepared_folder(source.path, weights=weights)


def _text_config(config):
    return getattr(config, "text_config", None) or config


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _tokenizer_of(name: str):
    """`--tokenizer`: an alias, a HF folder or a .gguf, resolved as a model is."""
    source = resolve_model(name)
    return gguf_tokenizer(source.path) if source.is_gguf else _tokenizer(source.path)
