"""The KV tensors and their sizing.

One tensor per layer, `[2, num_blocks, block_size, num_kv_heads, head_dim]` (keys, then values). Block i
of every layer holds the same tokens, so the block pool hands out one id for all layers. The sizes come as
plain numbers (`KVCacheSpec`): this module knows nothing of models.
"""

import os
from dataclasses import dataclass

import torch

from sobrio.errors import InvalidRequestError


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    def __post_init__(self) -> None:
        assert min(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size) > 0, self

    @property
    def token_bytes(self) -> int:
        """Bytes one token's keys and values take across all layers: what a longer context costs."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

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
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def kv_budget(memory: int | None, fraction: float, cap: int) -> int:
    """The KV cache's bytes: `memory` if given (--kv-cache-memory), else a fraction of the memory available
    now, capped, so a large host does not pin gigabytes a small model never fills."""
    if memory is not None:
        return memory
    return min(cap, int(available_memory() * fraction))


class KVCache:
    """Owns the per-layer KV tensors. Attention reads its layer's through the step's metadata."""

    def __init__(self, layers: list[torch.Tensor]):
        """Wrap existing tensors (tests, a module used alone); `allocate` makes zeroed ones for a model."""
        assert layers and all(t.dim() == 5 and t.shape[0] == 2 and t.shape == layers[0].shape for t in layers)
        self.layers = layers
        self.num_blocks, self.block_size = layers[0].shape[1], layers[0].shape[2]
        # Keys and values flattened to slots (block_id * block_size + offset), as attention indexes them.
        self._slots = [(t[0].flatten(0, 1), t[1].flatten(0, 1)) for t in layers]

    @classmethod
    def allocate(cls, spec: KVCacheSpec, num_blocks: int) -> "KVCache":
        shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        return cls([torch.zeros(shape, dtype=spec.dtype) for _ in range(spec.num_layers)])

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer(self, i: int) -> torch.Tensor:
        """Layer i's cache, `[2, num_blocks, block_size, num_kv_heads, head_dim]`."""
        return self.layers[i]

    def slots(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values as `[num_blocks * block_size, num_kv_heads, head_dim]` views."""
        return self._slots[i]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)
