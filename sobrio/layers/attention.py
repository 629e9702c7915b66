"""Paged attention over a flat KV cache.

The cache of one layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]`; attention sees it flattened
to slots (`block_id * block_size + offset`). The step's metadata says, per sequence, where its new tokens
go and which slots hold its whole context. `ReferenceAttention` is plain PyTorch: gather one sequence's
keys and values, then scaled-dot-product attention; faster backends must equal it.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot of each new token
    query_start_loc: list[int]  # [B + 1] where each sequence's new tokens start in the flat batch
    context_lens: list[int]  # [B] tokens in the cache for each sequence once this step is written
    context_slots: list[torch.Tensor]  # [B] slots of each sequence's whole context, in order
    _masks: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def key_range_and_mask(self, i: int, window: int | None) -> tuple[int, torch.Tensor | None, bool]:
        """(first key position, boolean mask or None, is_causal) for sequence i; cached for the step."""
        cached = self._masks.get((i, window))
        if cached is None:
            cached = self._masks[(i, window)] = _key_range_and_mask(
                self.query_start_loc[i + 1] - self.query_start_loc[i], self.context_lens[i], window
            )
        return cached


def _key_range_and_mask(q_len: int, ctx: int, window: int | None) -> tuple[int, torch.Tensor | None, bool]:
    first_query = ctx - q_len
    start = 0 if window is None else max(0, first_query - window + 1)
    if q_len == 1:
        return start, None, False
    if start == 0 and q_len == ctx and (window is None or ctx <= window):
        return 0, None, True
    q_pos = torch.arange(first_query, ctx).unsqueeze(1)
    k_pos = torch.arange(start, ctx).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return start, mask, False


class ReferenceAttention(torch.nn.Module):
    """Gather + SDPA per sequence. Portable and exact; the yardstick for other backends."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.kv_cache: torch.Tensor | None = None  # set by the model runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]. Writes k, v to the cache; returns [T, H * D]."""
        assert self.kv_cache is not None, "KV cache not allocated"
        key_cache = self.kv_cache[0].view(-1, self.num_kv_heads, self.head_dim)
        value_cache = self.kv_cache[1].view(-1, self.num_kv_heads, self.head_dim)
        key_cache.index_copy_(0, meta.slot_mapping, k)
        value_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for i in range(meta.num_seqs):
            s, e = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            start, mask, causal = meta.key_range_and_mask(i, self.sliding_window)
            if causal:  # a whole prompt in one chunk: its keys are the fresh ones
                keys, values = k[s:e], v[s:e]
            else:
                slots = meta.context_slots[i][start:]
                keys, values = key_cache.index_select(0, slots), value_cache.index_select(0, slots)
            out[s:e] = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True,
            ).transpose(0, 1)
        return out.view(q.shape[0], -1)
