"""Everything the engine needs from a model source: config, tokenizer, weights."""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from sobrio.loader.gguf import prepared_folder
from sobrio.loader.hf import iter_safetensors_weights
from sobrio.loader.resolve import ModelSource, resolve_model


@dataclass
class LoadedModelFiles:
    source: ModelSource
    folder: Path  # config.json + tokenizer files
    config: object  # transformers PretrainedConfig
    tokenizer: object  # transformers tokenizer (fast)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter_safetensors_weights(self.folder)  # a GGUF's prepared folder holds them dequantized


def load_model_files(name: str) -> LoadedModelFiles:
    from transformers import AutoConfig, AutoTokenizer

    source = resolve_model(name)
    folder = prepared_folder(source.path) if source.is_gguf else source.path
    config = AutoConfig.from_pretrained(folder)
    config = getattr(config, "text_config", None) or config
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return LoadedModelFiles(source, folder, config, tokenizer)
