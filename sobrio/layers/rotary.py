"""Rotary position embedding (rotate-half layout, as transformers), with a cos/sin table per base."""

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from sobrio.layers.cpu_ops import cpu_ops


def _rope_parameters(config, layer_type: str | None) -> dict:
    params = getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", 10000.0)}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    return params


def inv_frequencies(config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, using transformers' functions for scaled RoPE types."""
    params = _rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    kwargs = {"layer_type": layer_type} if layer_type else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, config, head_dim: int, max_positions: int, layer_type: str | None = None):
        super().__init__()
        inv_freq, scaling = inv_frequencies(config, head_dim, layer_type)
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D] (rows may be strided views of the packed qkv output); returns both
        rotated, in their dtype. The C++ path rotates them in place."""
        ops = cpu_ops()
        if ops is not None and q.stride(-1) == 1 and k.stride(-1) == 1 and q.stride(1) == q.shape[2] \
                and k.stride(1) == k.shape[2]:
            ops.rotary_embedding(positions, q, k, self.cos, self.sin)
            return q, k
        return self.reference(positions, q, k)

    def reference(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
