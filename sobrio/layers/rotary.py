"""Rotary position embedding (rotate-half layout as transformers, or GLM's interleaved pairs), with a cos/sin
table per base, over all of a head or its first `partial_rotary_factor` share.

Every `rope_type` the Llama family uses is computed by transformers' own functions (`default`, `linear`,
`dynamic`, `yarn`, `longrope`, `llama3`); any other is refused at load naming the field. Two are dynamic in
transformers and static here, exact where sobrio runs them:
- `dynamic` (NTK): transformers rescales only past `max_position_embeddings`, which is also sobrio's longest
  context, so the default frequencies are exact for every position sobrio accepts.
- `longrope` (Phi-3): transformers takes the long factors for a forward whose last position is past
  `original_max_position_embeddings`, else the short ones. sobrio picks one set for the whole engine, as
  llama.cpp and vLLM do (the cache must not mix them): long when the engine's context (`max_positions`)
  reaches past that length, else short; equal to transformers for every sequence when the context stays
  within it, and for sequences longer than it otherwise.
"""

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from sobrio.errors import ConfigError
from sobrio.layers.cpu_ops import cpu_ops

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def rope_parameters(config, layer_type: str | None = None) -> dict:
    params = getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", 10000.0)}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    return params


def check_rope(config) -> None:
    """Refuse a `rope_scaling` type sobrio does not compute, naming the field (a ConfigError at load)."""
    params = rope_parameters(config)
    per_layer = [p for p in params.values() if isinstance(p, dict)] or [params]
    for p in per_layer:
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"config field rope_scaling.rope_type={rope_type!r} is not supported (supported: "
                              f"{', '.join(ROPE_TYPES)})", "--model")


def rotary_dim(config, head_dim: int, layer_type: str | None = None) -> int:
    """The dimensions each head rotates: all, or the first `partial_rotary_factor` share (Phi-3, GLM-4)."""
    factor = rope_parameters(config, layer_type).get("partial_rotary_factor",
                                                     getattr(config, "partial_rotary_factor", 1.0))
    return int(head_dim * factor)


def inv_frequencies(config, head_dim: int, layer_type: str | None = None,
                    max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, using transformers' functions for scaled RoPE types."""
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base, dim = params["rope_theta"], rotary_dim(config, head_dim, layer_type)
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    kwargs = {"layer_type": layer_type} if layer_type else {}
    if rope_type == "longrope":
        kwargs["seq_len"] = max_positions
    with torch.device("cpu"):  # also under the meta device: transformers mixes it with "cpu" (a few floats)
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, config, head_dim: int, max_positions: int, layer_type: str | None = None,
                 interleaved: bool = False):
        super().__init__()
        inv_freq, scaling = inv_frequencies(config, head_dim, layer_type, max_positions)
        self.head_dim, self.rotary_dim = head_dim, 2 * len(inv_freq)
        self.interleaved = interleaved  # GLM: pairs (2i, 2i + 1) rotate by frequency i
        positions = torch.arange(max_positions, dtype=torch.float)
        # scaled frequencies are made on the CPU (`inv_frequencies`); on the meta device (`bench roofline`'s
        # count of a model's weights) the tables go there too
        freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]
        emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    @property
    def plain(self) -> bool:
        """Rotate-half over the whole head: what the C++ operator (and the fused decode) computes."""
        return not self.interleaved and self.rotary_dim == self.head_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D] (rows may be strided views of the packed qkv output); returns both
        rotated, in their dtype. The C++ path rotates them in place."""
        ops = cpu_ops()
        if ops is not None and self.plain and q.stride(-1) == 1 and k.stride(-1) == 1 \
                and q.stride(1) == q.shape[2] and k.stride(1) == k.shape[2]:
            ops.rotary_embedding(positions, q, k, self.cos, self.sin)
            return q, k
        return self.reference(positions, q, k)

    def reference(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        d = self.rotary_dim
        rot = x[..., :d]
        turned = _rotate_pairs(rot) if self.interleaved else _rotate_half(rot)
        out = rot * cos + turned * sin
        return out if d == self.head_dim else torch.cat((out, x[..., d:]), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
