"""The engine's memory at start: what the weights about to be loaded will take (so the default KV cache
leaves them room), and once loaded, where the process's resident memory went (weights, KV cache, the rest:
runtime, workspace, allocator), logged once at start."""

import logging

import torch

from sobrio.loader.load import LoadedModelFiles, expected_weight_bytes
from sobrio.memory import mapped_bytes, process_resident
from sobrio.models.weights import resident_bytes


def weight_estimate(files: LoadedModelFiles, dtype: torch.dtype, quantization: str | None, ranks: int = 1) -> int:
    """Bytes this rank's weights will take once loaded, about (a tensor-parallel rank holds 1/ranks)."""
    return expected_weight_bytes(files, dtype.itemsize, quantization) // ranks


def log_breakdown(logger: logging.Logger, name: str, models: list[torch.nn.Module], kv_tensors: list[torch.Tensor],
                  num_blocks: int) -> None:
    """One line: the weights, the KV cache (its size, and how much of it is mapped yet: a thread maps its pages
    while the start goes on), and the rest of what is resident (runtime, workspace, allocator)."""
    weights = sum(resident_bytes(m) for m in models)
    kv_bytes = sum(t.nbytes for t in kv_tensors)
    resident = process_resident()
    kv_mapped = mapped_bytes(t.untyped_storage().data_ptr() for t in kv_tensors)
    mapped = "" if kv_mapped is None else f", {kv_mapped / 1e9:.2f} GB of it mapped so far"
    logger.info("memory of %s: weights %.2f GB, KV cache %.2f GB (%d blocks%s), workspace and runtime %.2f GB; "
                "%.2f GB resident", name, weights / 1e9, kv_bytes / 1e9, num_blocks, mapped,
                max(0, resident - weights - (kv_bytes if kv_mapped is None else kv_mapped)) / 1e9, resident / 1e9)
