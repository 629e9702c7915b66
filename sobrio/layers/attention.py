"""Paged attention over a flat KV cache.

The cache of one layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]`; attention sees it flattened
to slots (`block_id * block_size + offset`). The step's metadata carries the cache (`sobrio.kv.cache.KVCache`;
each layer takes its own by `layer_idx`), says where each sequence's new tokens go and which blocks hold
its context.

Two backends:
- `ReferenceAttention`: per sequence, gather its keys and values, then scaled-dot-product attention.
  Portable and exact; the yardstick every other backend is tested against.
- `BatchedDecodeAttention`: the same for prompt chunks, but all decoding sequences (one query each) in
  one padded gather and two batched matmuls per layer: for 64 decoding sequences on this CPU, several
  times faster than 64 SDPA calls (whose bf16 GQA path is slow).
- `CppPagedAttention`: decode through a small C++ operator that reads the paged cache in place, prompt
  chunks of a bf16 cache through another (`prompt_attention`: flash-style, the blocks above the diagonal
  and below a sliding window skipped, AVX512-BF16 dot products, or AMX tiles where the CPU has them; faster
  than PyTorch's SDPA on both: docs/benchmarks.md; both take windows and Gemma 2's softcap), and so
  every row of a sequence with a short query (up to `SHORT_QUERY` rows: a decode with the tokens structured
  output forced after it, a short chunk), each row as a decode query of its own: gathering a whole context
  and its GQA copies for a few rows cost several times the kernel's in-place read.
  `benchmarks/attention_backends.py` times the three.
- `BatchInvariantAttention` (`--batch-invariant`): every query row, prompt or decode, through that operator
  as a row of its own, so a row's result does not depend on the batch, the chunking or the prefix cache.

A quantized cache (`--kv-cache-dtype int8 | fp8_e4m3`) is written as rows and scales (`kv.cache`); the
C++ operator reads them in place, the PyTorch paths dequantize what they gather. A prompt computed in one
chunk attends over its fresh keys, as vLLM does: only what is read back from the cache is quantized.
"""

import functools
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

SHORT_QUERY = 16  # CppPagedAttention: sequences with at most this many query rows attend row by row


class PagedKVCache(Protocol):
    """What attention needs of the step's KV cache (`sobrio.kv.cache.KVCache` is the one the engine passes):
    layers receive the cache through the metadata and never import kv/."""

    def slots(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def scales(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None: ...
    def write_quantized(self, i: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...
    def read_quantized(self, i: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot of each new token
    query_start_loc: list[int]  # [B + 1] where each sequence's new tokens start in the flat batch
    context_lens: list[int]  # [B] tokens in the cache for each sequence once this step is written
    block_tables: torch.Tensor  # [B, max_blocks] block ids (padded with 0)
    block_size: int
    kv_cache: PagedKVCache | None = None  # every layer's KV tensors; None only for a module used alone (tests)
    _cache: dict = field(default_factory=dict)  # per-step derived tensors, shared by all layers

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]

    def context_slots(self, i: int) -> torch.Tensor:
        """Slots of sequence i's whole context, in position order."""
        key = ("slots", i)
        if key not in self._cache:
            ctx = self.context_lens[i]
            blocks = self.block_tables[i, : -(-ctx // self.block_size)]
            offsets = torch.arange(self.block_size)
            self._cache[key] = (blocks.unsqueeze(1) * self.block_size + offsets).view(-1)[:ctx]
        return self._cache[key]

    def key_range_and_mask(self, i: int, window: int | None) -> tuple[int, torch.Tensor | None, bool]:
        """(first key position, boolean mask or None, is_causal) for sequence i."""
        key = ("mask", i, window)
        if key not in self._cache:
            self._cache[key] = _key_range_and_mask(self.query_len(i), self.context_lens[i], window)
        return self._cache[key]

    def decode_seqs(self):
        """The single-query sequences: (indices, their rows in the batch, block tables, context lengths)."""
        if "decode" not in self._cache:
            seqs = [i for i in range(self.num_seqs) if self.query_len(i) == 1]
            self._cache["decode"] = None if not seqs else (
                seqs, torch.tensor([self.query_start_loc[i] for i in seqs]), self.block_tables[seqs],
                torch.tensor([self.context_lens[i] for i in seqs]))
        return self._cache["decode"]

    def decode_padded(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """For the single-query sequences: padded key slots [Bd, L] and key mask [Bd, 1, 1, L]."""
        key = ("padded", window)
        if key not in self._cache:
            _, _, tables, ctx = self.decode_seqs()
            length = int(ctx.max())
            offsets = torch.arange(self.block_size)
            slots = (tables[:, : -(-length // self.block_size)].unsqueeze(-1) * self.block_size + offsets)
            positions = torch.arange(length).unsqueeze(0)
            mask = positions < ctx.unsqueeze(1)
            if window is not None:
                mask &= positions > ctx.unsqueeze(1) - 1 - window
            self._cache[key] = (slots.view(len(ctx), -1)[:, :length].contiguous(), mask.view(len(ctx), 1, 1, length))
        return self._cache[key]

    def short_query_rows(self, limit: int):
        """The sequences with at most `limit` query rows, each row as the decode kernel sees a single-query
        sequence: (their indices, their rows in the batch, each row's block table and context length), or None
        when there are none."""
        key = ("short", limit)
        if key not in self._cache:
            seqs = [i for i in range(self.num_seqs) if self.query_len(i) <= limit]
            self._cache[key] = None
            if seqs:
                tables, lens = self.query_rows()
                rows = torch.cat([torch.arange(self.query_start_loc[i], self.query_start_loc[i + 1]) for i in seqs])
                self._cache[key] = (seqs, rows, tables[rows], lens[rows])
        return self._cache[key]

    def query_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For every query row: its sequence's block table [T, max_blocks] and its context length [T]
        (its position + 1), the row as the decode kernel sees a single-query sequence."""
        if "rows" not in self._cache:
            starts = torch.tensor(self.query_start_loc)
            q_lens = starts[1:] - starts[:-1]
            seq = torch.repeat_interleave(torch.arange(self.num_seqs), q_lens)
            first_position = torch.tensor(self.context_lens) - q_lens
            lens = first_position[seq] + torch.arange(len(seq)) - starts[seq] + 1
            self._cache["rows"] = (self.block_tables[seq], lens)
        return self._cache["rows"]


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
    """Gather + SDPA per sequence."""

    ops = None  # the C++ operators, where a subclass loads them

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, layer_idx: int = 0, softcap: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap or None  # Gemma 2: scores become tanh(s / cap) * cap before the softmax
        self.layer_idx = layer_idx  # which of the step's KV cache layers is this one's
        # A module used alone (unit tests, benchmarks) may hold a cache of its own; a model's layers never
        # do: theirs comes with each step's metadata.
        self.kv_cache: torch.Tensor | None = None

    def caches(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's key and value caches, flattened to slots: `[num_slots, num_kv_heads, head_dim]`."""
        if meta.kv_cache is not None:
            return meta.kv_cache.slots(self.layer_idx)
        assert self.kv_cache is not None, "no KV cache: the step's metadata carries none"
        shape = (-1, self.num_kv_heads, self.head_dim)
        return self.kv_cache[0].view(shape), self.kv_cache[1].view(shape)

    def scales(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A quantized cache's key and value scales for this layer, `[num_slots, num_kv_heads]`; else None."""
        return None if meta.kv_cache is None else meta.kv_cache.scales(self.layer_idx)

    def rows(self, q: torch.Tensor, meta: AttentionMetadata, tables: torch.Tensor, lens: torch.Tensor):
        """Each query row over its first `lens` positions (its own included, already written), by the C++
        operator reading the cache in place: the row as a single-query sequence with that block table."""
        key_cache, value_cache = self.caches(meta)
        scales = self.scales(meta)
        extra = {} if scales is None else {"key_scales": scales[0], "value_scales": scales[1]}
        return self.ops.paged_decode_attention(q.contiguous(), key_cache, value_cache, tables, lens,
                                               meta.block_size, self.scale, self.sliding_window or 0, **extra,
                                               softcap=self.softcap or 0.0)

    def write_cache(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
        """The step's new keys and values into their slots; this layer's (key cache, value cache)."""
        key_cache, value_cache = self.caches(meta)
        scales = self.scales(meta)
        if scales is not None and self.ops is not None and key_cache.dtype == torch.int8:
            self.ops.write_kv_int8(k, v, key_cache, value_cache, *scales, meta.slot_mapping)
        elif scales is not None:  # only the step's cache has scales
            meta.kv_cache.write_quantized(self.layer_idx, meta.slot_mapping, k, v)
        elif self.ops is not None:  # one C++ call instead of two index_copy_ dispatches (~40 us each)
            self.ops.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        else:
            key_cache.index_copy_(0, meta.slot_mapping, k)
            value_cache.index_copy_(0, meta.slot_mapping, v)
        return key_cache, value_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]. Writes k, v to the cache; returns [T, H * D]."""
        self.write_cache(k, v, meta)
        out = torch.empty_like(q)
        self.attend_each(q, k, v, meta, range(meta.num_seqs), out)
        return out.view(q.shape[0], -1)

    def attend_each(self, q, k, v, meta: AttentionMetadata, seqs, out: torch.Tensor) -> None:
        for i in seqs:
            s, e = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            start, mask, causal = meta.key_range_and_mask(i, self.sliding_window)
            if causal:  # a whole prompt in one chunk: its keys are the fresh ones
                keys, values = k[s:e], v[s:e]
            else:
                keys, values = self.gather(meta, meta.context_slots(i)[start:], q.dtype)
            query = q[s:e].transpose(0, 1).unsqueeze(0)
            if self.softcap is not None:  # SDPA has no softcap: the scores by hand
                out[s:e] = self._capped(query, self._heads(keys), self._heads(values), mask, causal)[0].transpose(0, 1)
                continue
            out[s:e] = F.scaled_dot_product_attention(
                query, self._heads(keys), self._heads(values), attn_mask=mask, is_causal=causal, scale=self.scale,
            )[0].transpose(0, 1)

    def _capped(self, q, k, v, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """Softcapped attention, [1, H, Lq, D], computed as transformers' eager path: scores in q's dtype,
        the softmax in float32."""
        scores = self.cap(torch.matmul(q, k.transpose(-1, -2)) * self.scale)
        if causal:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2])
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), v)

    def cap(self, scores: torch.Tensor) -> torch.Tensor:
        return scores if self.softcap is None else torch.tanh(scores / self.softcap) * self.softcap

    def gather(self, meta: AttentionMetadata, slots: torch.Tensor, dtype: torch.dtype):
        """Keys and values `[len(slots), Hkv, D]` of these slots, in `dtype` (a quantized cache dequantized)."""
        key_cache, value_cache = self.caches(meta)
        scales = self.scales(meta)
        if scales is None:
            return key_cache.index_select(0, slots), value_cache.index_select(0, slots)
        return meta.kv_cache.read_quantized(self.layer_idx, slots, dtype)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[L, Hkv, D] -> [1, H, L, D]. SDPA's fast CPU kernel wants 4-D inputs with all heads: on this CPU,
        3-D or enable_gqa inputs fall back to a path 5x slower for a 1,000-token prompt."""
        group = self.num_heads // self.num_kv_heads
        x = x.transpose(0, 1)
        return (x.repeat_interleave(group, dim=0) if group > 1 else x).unsqueeze(0)


class BatchedDecodeAttention(ReferenceAttention):
    """Prompt chunks as the reference; all single-query (decode) sequences batched together."""

    def forward(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        self.write_cache(k, v, meta)
        decode = meta.decode_seqs()
        if decode is not None and len(decode[0]) == meta.num_seqs:  # a pure decode step: no scatter
            return self.decode(q, meta).view(q.shape[0], -1)
        out = torch.empty_like(q)
        done = set()
        if decode is not None:
            seqs, rows, _, _ = decode
            out[rows] = self.decode(q[rows], meta)
            done = set(seqs)
        self.attend_each(q, k, v, meta, [i for i in range(meta.num_seqs) if i not in done], out)
        return out.view(q.shape[0], -1)

    def decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [Bd, H, D], one query per decoding sequence. Returns [Bd, H, D]."""
        slots, mask = meta.decode_padded(self.sliding_window)
        bd, length = slots.shape
        group = self.num_heads // self.num_kv_heads
        shape = (bd, length, self.num_kv_heads, self.head_dim)
        keys, values = self.gather(meta, slots.view(-1), q.dtype)
        keys, values = keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)  # [Bd, Hkv, L, D]
        queries = q.view(bd, self.num_kv_heads, group, self.head_dim)  # head h reads kv head h // group
        scores = self.cap(torch.matmul(queries, keys.transpose(-1, -2)).float() * self.scale)  # [Bd, Hkv, G, L]
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(q.dtype)
        return torch.matmul(probs, values).view(bd, self.num_heads, self.head_dim)


class CppPagedAttention(BatchedDecodeAttention):
    """Decode with the C++ operator (sobrio/csrc): keys and values read in place, no gather or padding."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from sobrio.csrc import load

        self.ops = load()
        assert self.ops is not None, "the C++ operators did not build; use the batched backend"

    def forward(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        self.write_cache(k, v, meta)
        decode = meta.decode_seqs()
        if decode is not None and len(decode[0]) == meta.num_seqs:  # a pure decode step (most): no scatter
            return self.decode(q, meta).view(q.shape[0], -1)
        short = meta.short_query_rows(SHORT_QUERY)
        if short is not None and len(short[0]) == meta.num_seqs:  # all short (verifying drafts): no scatter
            return self.rows(q, meta, short[2], short[3]).view(q.shape[0], -1)
        out = torch.empty_like(q)
        done = set()
        if short is not None:
            seqs, rows, tables, lens = short
            out[rows] = self.rows(q[rows], meta, tables, lens)
            done = set(seqs)
        self.attend_each(q, k, v, meta, [i for i in range(meta.num_seqs) if i not in done], out)
        return out.view(q.shape[0], -1)

    def decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        _, _, tables, ctx = meta.decode_seqs()
        return self.rows(q, meta, tables, ctx)

    def attend_each(self, q, k, v, meta: AttentionMetadata, seqs, out: torch.Tensor) -> None:
        """Prompt chunks of a bf16 cache through the C++ `prompt_attention` (flash-style, causal blocks
        skipped, keys read in place), where it applies; others by SDPA."""
        key_cache, value_cache = self.caches(meta)
        if not self.prompt_kernel or q.dtype != torch.bfloat16 or key_cache.dtype != torch.bfloat16:
            return super().attend_each(q, k, v, meta, seqs, out)  # fp32, or a quantized cache's int8/fp8 rows
        for i in seqs:
            s, e = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[s:e] = self.ops.prompt_attention(q[s:e], key_cache, value_cache, meta.block_tables[i],
                                                 meta.context_lens[i], meta.block_size, self.scale,
                                                 self.sliding_window or 0, self.softcap or 0.0)

    @functools.cached_property
    def prompt_kernel(self) -> bool:
        """Whether `prompt_attention` computes this layer's prompt chunks: AVX512-BF16 (its products on AMX
        tiles where the CPU has them), head size a multiple of 32. A sliding window skips the key blocks below
        every query's window; a softcap (Gemma 2) is applied to each block's scores before the softmax."""
        return self.head_dim % 32 == 0 and self.ops.prompt_attention_supported()


class BatchInvariantAttention(ReferenceAttention):
    """Each query row attends as a decode query of its own: its keys are read from the cache (its chunk's
    included, written first) by the C++ decode kernel, one (row, kv head) per task, in position order. A
    row's result is then a function of its sequence alone, whatever else is in the step, how its prompt was
    chunked or where the prefix cache made its chunk start; SDPA over a chunk would not be."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from sobrio.csrc import load

        self.ops = load()
        assert self.ops is not None, "batch-invariant attention needs the C++ operators"

    def forward(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        self.write_cache(k, v, meta)
        return self.rows(q, meta, *meta.query_rows()).view(q.shape[0], -1)


ATTENTION_BACKENDS = {"reference": ReferenceAttention, "batched": BatchedDecodeAttention, "cpp": CppPagedAttention}


def resolve_backend(name: str) -> type[ReferenceAttention]:
    """`auto`: the C++ operator where it builds, else the batched PyTorch path."""
    if name == "auto":
        from sobrio.csrc import load

        name = "cpp" if load() is not None else "batched"
    return ATTENTION_BACKENDS[name]
