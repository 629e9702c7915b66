"""Hugging Face model folders: safetensors shards under their own names."""

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def iter_safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
