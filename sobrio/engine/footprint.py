"""The engine's memory at start: what the weights about to be loaded will take (so the default KV cache
leaves them room), and once loaded, where the process's resident memory went (weights, KV cache, the rest:
runtime, workspace, allocator), logged once at start."""

import logging

import torch

from sobrio.loader.load import LoadedModelFiles, expected_weight_bytes
from sobrio.memory import process_resident
from sobrio.models.weights import resident_bytes


def weight_estimate(files: LoadedModelFiles, dtype: torch.dtype, quantization: str | None, ranks: int = 1) -> int:
    """Bytes this rank's weights will take once loaded, about (a tensor-parallel rank holds 1/ranks)."""
    return expected_weight_bytes(files, dtype.itemsize, quantization) // ranks


def log_breakdown(logger: logging.Logger, name: str, models: list[torch.nn.Module], kv_bytes: int,
                  num_blocks: int) -> None:
    weights = sum(resident_bytes(m) for m in models)
    resident = process_resident()
    logger.info("memory of %s: weights %.2f GB, KV cache %.2f GB (%d blocks), workspace and runtime %.2f GB; "
                "%.2f GB resident", name, weights / 1e9, kv_bytes / 1e9, num_blocks,
                max(0, resident - weights - kv_bytes) / 1e9, resident / 1e9)
