"""The KV tensors and their sizing.

One tensor per layer, `[2, num_blocks, block_size, num_kv_heads, head_dim]` (keys, then values). Block i
of every layer holds the same tokens, so the block pool hands out one id for all layers. The sizes come as
plain numbers (`KVCacheSpec`): this module knows nothing of models.

A quantized cache (`--kv-cache-dtype int8 | fp8_e4m3`) stores each token's row of each kv head in one byte
per element, beside a bf16 scale per (token, kv head) in a `[2, num_blocks, block_size, num_kv_heads]`
tensor: 66 bytes instead of 128 for a 64-wide head, so the same memory holds 1.94x the blocks. A scale per
row (not per block) lets a token be written once, when computed, and never requantized.
"""

import os
import threading
from dataclasses import dataclass

import torch

from sobrio.errors import InvalidRequestError
from sobrio.memory import populate_in_background, proc_bytes, zeros_on_touch

KV_CACHE_DTYPES = {"auto": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
SCALE_DTYPE = torch.bfloat16
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's activations
    block_size: int
    cache_dtype: torch.dtype | None = None  # int8 or fp8 rows with a scale each; None: rows in `dtype`

    def __post_init__(self) -> None:
        assert min(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size) > 0, self
        assert self.cache_dtype in (None, *_QMAX), self.cache_dtype

    @property
    def token_bytes(self) -> int:
        """Bytes one token's keys and values take across all layers: what a longer context costs."""
        row = self.head_dim * (self.cache_dtype or self.dtype).itemsize
        if self.cache_dtype is not None:
            row += SCALE_DTYPE.itemsize
        return self.num_layers * 2 * self.num_kv_heads * row

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, keys and values."""
        return self.block_size * self.token_bytes

    def num_blocks_for(self, budget: int) -> int:
        """How many blocks fit in `budget` bytes; a budget too small for one is a configuration error."""
        num_blocks = budget // self.block_bytes
        if num_blocks < 1:
            raise InvalidRequestError(f"kv_cache_memory {budget} bytes holds no block of {self.block_bytes} bytes")
        return int(num_blocks)


def available_memory() -> int:
    """Bytes the kernel says a new allocation can take without swapping (half the RAM if it cannot say)."""
    available = proc_bytes("/proc/meminfo", "MemAvailable")
    return available if available is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def kv_budget(memory: int | None, fraction: float, cap: int, weights: int = 0) -> int:
    """The KV cache's bytes: `memory` if given (--kv-cache-memory), else a fraction of the memory available
    now once the `weights` about to be loaded have taken theirs, capped, so a large host does not pin
    gigabytes a small model never fills. Where the weights and the cache cannot both fit in the memory
    available, a MemoryError says so before anything large is read."""
    available = available_memory()
    budget = memory if memory is not None else min(cap, int(max(0, available - weights) * fraction))
    if weights + budget > available:
        raise MemoryError(f"the weights (about {weights / 1e9:.2f} GB) and the KV cache ({budget / 1e9:.2f} GB) "
                          f"need more than the {available / 1e9:.2f} GB of memory available: lower "
                          f"--kv-cache-memory, or quantize (--quantization int8 or int4)")
    return budget


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `[..., D]` as `dtype` (int8 or fp8 e4m3) and one bf16 scale each, symmetric: x ~ q * scale.
    The scale is rounded to bf16 before dividing, so the rows are quantized against the scale stored."""
    absmax = x.abs().amax(dim=-1).float()
    scale = (absmax / _QMAX[dtype]).clamp_min(1e-30).to(SCALE_DTYPE)
    scaled = x.float() / scale.float().unsqueeze(-1)
    if dtype == torch.int8:
        return scaled.round_().clamp_(-127, 127).to(torch.int8), scale
    return scaled.clamp_(-448, 448).to(dtype), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def write_quantized(cache: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Quantize `rows` [T, Hkv, D] into `slots` of a quantized cache `[num_slots, Hkv, D]` and its scales.
    Copied as bytes: PyTorch has no index_copy_ for fp8."""
    quantized, row_scales = quantize_rows(rows, cache.dtype)
    cache.view(torch.uint8).index_copy_(0, slots, quantized.view(torch.uint8))
    scales.index_copy_(0, slots, row_scales)


def read_quantized(cache: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows of `slots` in a quantized cache, dequantized to `dtype`."""
    quantized = cache.view(torch.uint8).index_select(0, slots).view(cache.dtype)
    return dequantize_rows(quantized, scales.index_select(0, slots), dtype)


class KVCache:
    """Owns the per-layer KV tensors (and a quantized cache's scales). Attention reads its layer's through
    the step's metadata."""

    def __init__(self, layers: list[torch.Tensor], scales: list[torch.Tensor] | None = None):
        """Wrap existing tensors (tests, a module used alone); `allocate` makes zeroed ones for a model, their
        pages mapped by a thread of their own (`populating`) while the start goes on.
        `scales`, for int8/fp8 layers: one `[2, num_blocks, block_size, num_kv_heads]` bf16 tensor each."""
        assert layers and all(t.dim() == 5 and t.shape[0] == 2 and t.shape == layers[0].shape for t in layers)
        assert (scales is None) == (layers[0].dtype not in _QMAX), "int8/fp8 layers, and only they, have scales"
        assert scales is None or all(s.shape == layers[0].shape[:-1] for s in scales) and len(scales) == len(layers)
        self.layers, self.scale_layers = layers, scales
        self.populating: threading.Thread | None = None
        self.num_blocks, self.block_size = layers[0].shape[1], layers[0].shape[2]
        # Keys and values flattened to slots (block_id * block_size + offset), as attention indexes them.
        self._slots = [(t[0].flatten(0, 1), t[1].flatten(0, 1)) for t in layers]
        self._scales = None if scales is None else [(s[0].flatten(0, 1), s[1].flatten(0, 1)) for s in scales]

    @classmethod
    def allocate(cls, spec: KVCacheSpec, num_blocks: int) -> "KVCache":
        shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        layers = [zeros_on_touch(shape, spec.cache_dtype or spec.dtype) for _ in range(spec.num_layers)]
        scales = None
        if spec.cache_dtype is not None:
            scales = [zeros_on_touch(shape[:-1], SCALE_DTYPE) for _ in range(spec.num_layers)]
        cache = cls(layers, scales)
        cache.populating = populate_in_background(layers + (scales or []))  # the start does not wait for it
        return cache

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer(self, i: int) -> torch.Tensor:
        """Layer i's cache, `[2, num_blocks, block_size, num_kv_heads, head_dim]`."""
        return self.layers[i]

    def slots(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values as `[num_blocks * block_size, num_kv_heads, head_dim]` views."""
        return self._slots[i]

    def scales(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A quantized cache's key and value scales of layer i, `[num_slots, num_kv_heads]`; else None."""
        return None if self._scales is None else self._scales[i]

    def write_quantized(self, i: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize the step's new keys and values `[T, Hkv, D]` of layer i into their slots (int8/fp8 only)."""
        (key_cache, value_cache), (key_scales, value_scales) = self._slots[i], self._scales[i]
        write_quantized(key_cache, key_scales, slots, k)
        write_quantized(value_cache, value_scales, slots, v)

    def read_quantized(self, i: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values of `slots`, dequantized to `dtype` (int8/fp8 only)."""
        (key_cache, value_cache), (key_scales, value_scales) = self._slots[i], self._scales[i]
        return (read_quantized(key_cache, key_scales, slots, dtype),
                read_quantized(value_cache, value_scales, slots, dtype))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds: the layers' keys and values, and a quantized cache's scales."""
        return self.layers + (self.scale_layers or [])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
