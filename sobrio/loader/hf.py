"""Hugging Face model folders: safetensors shards under their own names."""

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's shards in name order; none is a FileNotFoundError naming the folder."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    return files


def iter_safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
