"""A sentence-transformers model folder: which modules follow the encoder, and how they pool.

`modules.json` lists the pipeline (Transformer, Pooling, optionally Normalize); `1_Pooling/config.json`
(the Pooling module's own folder) says which pooling modes are on; `sentence_bert_config.json` caps the
input length (`max_seq_length`, often below the encoder's positions: 256 of 512 for all-MiniLM-L6-v2).
"""

import json
from dataclasses import dataclass
from pathlib import Path

from sobrio.errors import ConfigError

# sentence-transformers' Pooling flags, in the order it concatenates them -> sobrio's mode names
_POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                  "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len"}
_KNOWN_MODULES = {"Transformer", "Pooling", "Normalize"}


@dataclass(frozen=True)
class SentenceTransformerConfig:
    pooling_modes: tuple[str, ...]
    normalize: bool
    max_seq_length: int | None


def read_sentence_transformer_config(folder: Path) -> SentenceTransformerConfig:
    """The folder's pooling and normalisation; a module sobrio does not compute (Dense, ...) is a ConfigError,
    never silently skipped (the vectors would be wrong)."""
    modules = json.loads((folder / "modules.json").read_text())
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
    unknown = [k for k in kinds if k not in _KNOWN_MODULES]
    if unknown or "Pooling" not in kinds:
        raise ConfigError(f"{folder}: sentence-transformers modules {unknown or kinds} are not supported "
                          f"(supported: Transformer, Pooling, Normalize)", "--model")
    pooling_dir = next(m.get("path", "") for m in modules if m["type"].endswith(".Pooling"))
    pooling = json.loads((folder / pooling_dir / "config.json").read_text())
    extra = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode") and v and k not in _POOLING_FLAGS)
    modes = tuple(mode for flag, mode in _POOLING_FLAGS.items() if pooling.get(flag))
    if extra or not modes:
        raise ConfigError(f"{folder}: pooling {extra or 'none'} is not supported (supported: cls, max, mean, "
                          "mean_sqrt_len)", "--model")
    bert_config = folder / "sentence_bert_config.json"
    max_seq_length = json.loads(bert_config.read_text()).get("max_seq_length") if bert_config.is_file() else None
    return SentenceTransformerConfig(modes, "Normalize" in kinds, max_seq_length)
