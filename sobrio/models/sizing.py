"""What a model asks of the machine before it is built: its float dtype on this CPU and its KV cache's shape,
read from the Hugging Face config (so kv/ need not know models, and tools size a model without an engine)."""

import torch

from sobrio.kv.cache import KVCacheSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16: oneDNN runs bf16 matmuls several times faster than fp32 there."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    return _DTYPES[name]


def kv_cache_spec(hf_config, dtype: torch.dtype, block_size: int,
                  cache_dtype: torch.dtype | None = None) -> KVCacheSpec:
    """The KV cache's shape for a Hugging Face config: the runner reads the model so `kv` need not."""
    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return KVCacheSpec(c.num_hidden_layers, c.num_key_value_heads, head_dim, dtype, block_size, cache_dtype)
