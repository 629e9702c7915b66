"""Batch-invariant operators (`--batch-invariant`): a row's result is bitwise the same whatever rows come
with it, for the matmul (any row count) and for attention (any batch, any chunking of the prompt)."""

import pytest
import torch
import torch.nn.functional as F

from sobrio.errors import InvalidRequestError
from sobrio.layers.attention import AttentionMetadata, BatchInvariantAttention, ReferenceAttention
from sobrio.layers.cpu_ops import cpu_ops, gemv_available, invariant_linear_available
from sobrio.layers.linear import FP32_KERNEL_MAX_ROWS, Linear, fp32_kernel_wins, invariant_linear, linear
from sobrio.models.registry import check_batch_invariant

pytestmark = pytest.mark.skipif(not invariant_linear_available(), reason="needs the C++ operators and AVX-512 or AVX2")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


# --- matmul ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("n,k", [(203, 100), (960, 576), (64, 33), (17, 1536), (40, 7)])  # K tails of 4..31
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_row_alone_equals_row_in_any_batch(dtype, n, k, with_bias):
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(70, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    alone = torch.cat([invariant_linear(x[i:i + 1], w, bias) for i in range(70)])
    for rows in range(2, 71):
        assert torch.equal(invariant_linear(x[:rows], w, bias), alone[:rows]), f"{rows} rows"
    assert torch.equal(invariant_linear(x[33:61], w, bias), alone[33:61])  # rows at other offsets too
    expected = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    torch.testing.assert_close(alone.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.skipif(not gemv_available(), reason="needs AVX512-BF16")
def test_bf16_linear_is_the_default_gemv():
    """For bf16 the batch-invariant matmul is the default path's GEMV: same bits at batch <= 4."""
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(4, 576, generator=gen).bfloat16(), torch.randn(960, 576, generator=gen).bfloat16()
    for rows in range(1, 5):
        assert torch.equal(cpu_ops().gemv_bf16(x[:rows], w), invariant_linear(x[:rows], w))


@pytest.mark.skipif(not fp32_kernel_wins(), reason="float32 takes the C++ kernel on AVX2-only CPUs")
def test_float32_few_rows_take_the_lane_kernel():
    """Where MKL reads a weight at a third of the bandwidth, few-row float32 matmuls are the C++ kernel's."""
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(FP32_KERNEL_MAX_ROWS + 1, 576, generator=gen), torch.randn(960, 576, generator=gen)
    bias = torch.randn(960, generator=gen)
    for rows in (1, 5, FP32_KERNEL_MAX_ROWS):
        assert torch.equal(linear(x[:rows], w, bias), invariant_linear(x[:rows], w, bias)), rows
    torch.testing.assert_close(linear(x, w, bias), F.linear(x, w, bias), atol=1e-4, rtol=1e-5)  # aten past it


def test_linear_module_in_batch_invariant_mode_keeps_no_packed_copy():
    layer = Linear(64, 48).bfloat16()
    layer.prepack(batch_invariant=True)
    assert layer.packed is None
    x = torch.randn(9, 64).bfloat16()
    assert torch.equal(layer(x)[3:4], layer(x[3:4]))


def test_refuses_another_attention_backend():
    with pytest.raises(InvalidRequestError, match="attention_backend"):
        check_batch_invariant("reference")
    check_batch_invariant("auto")


# --- attention -------------------------------------------------------------------------------------------

BLOCK = 8


class PagedSequences:
    """A few sequences with fixed q / k / v at every position and blocks scattered through one cache."""

    def __init__(self, lengths: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype):
        gen = torch.Generator().manual_seed(sum(lengths) + dim)
        num_blocks = sum(-(-n // BLOCK) for n in lengths)
        order = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables = []
        for n in lengths:
            self.tables.append(order[:-(-n // BLOCK)])
            order = order[-(-n // BLOCK):]
        self.q = [torch.randn(n, heads, dim, generator=gen).to(dtype) for n in lengths]
        self.k = [torch.randn(n, kv_heads, dim, generator=gen).to(dtype) for n in lengths]
        self.v = [torch.randn(n, kv_heads, dim, generator=gen).to(dtype) for n in lengths]
        self.cache = torch.zeros(2, num_blocks, BLOCK, kv_heads, dim, dtype=dtype)

    def run(self, attn: ReferenceAttention, steps: list[list[tuple[int, int, int]]]) -> list[torch.Tensor]:
        """Each step a list of (sequence, first position, end position); returns every sequence's rows."""
        attn.kv_cache = self.cache.zero_()
        out = [torch.empty(len(q), q.shape[1] * q.shape[2], dtype=q.dtype) for q in self.q]
        for step in steps:
            qsl, slots = [0], []
            for seq, start, end in step:
                qsl.append(qsl[-1] + end - start)
                positions = torch.arange(start, end)
                slots.append(torch.tensor(self.tables[seq])[positions // BLOCK] * BLOCK + positions % BLOCK)
            width = max(len(self.tables[seq]) for seq, _, _ in step)
            tables = torch.tensor([self.tables[seq] + [0] * (width - len(self.tables[seq])) for seq, _, _ in step])
            meta = AttentionMetadata(torch.cat(slots), qsl, [end for _, _, end in step], tables, BLOCK)
            q, k, v = (torch.cat([xs[seq][start:end] for seq, start, end in step]) for xs in (self.q, self.k, self.v))
            rows = attn(q, k, v, meta)
            for (seq, start, end), s, e in zip(step, qsl, qsl[1:]):
                out[seq][start:end] = rows[s:e]
        return out


def chunked(seq: int, length: int, size: int) -> list[tuple[int, int, int]]:
    return [(seq, s, min(s + size, length)) for s in range(0, length, size)]


@pytest.mark.parametrize("dtype,heads,kv_heads,dim", [
    (torch.bfloat16, 9, 3, 64),  # SmolLM2's shape: the C++ bf16 fast path
    (torch.bfloat16, 4, 1, 256),  # Gemma 3's: the generic path
    (torch.float32, 8, 2, 32),
])
@pytest.mark.parametrize("window", [None, 16])
def test_attention_rows_equal_whatever_the_chunking_and_batch(dtype, heads, kv_heads, dim, window):
    lengths = [45, 20, 33]
    seqs = PagedSequences(lengths, heads, kv_heads, dim, dtype)
    attn = BatchInvariantAttention(heads, kv_heads, dim, dim ** -0.5, window)
    whole = seqs.run(attn, [[(0, 0, 45)], [(1, 0, 20)], [(2, 0, 33)]])
    one_at_a_time = seqs.run(attn, [[(0, i, i + 1)] for i in range(45)] + [[(1, 0, 20)], [(2, 0, 33)]])
    # sequence 0 in chunks of 7 beside sequence 1's prompt in chunks of 5 and 2's after a cached prefix of 30
    mixed = seqs.run(attn, [[(2, 0, 30)]] + [
        [c for c in (a, b) if c] for a, b in zip(chunked(0, 45, 7), chunked(1, 20, 5) + [(2, 30, 33)] + [None] * 9)])
    for seq in range(3):
        assert torch.equal(one_at_a_time[seq], whole[seq]), f"sequence {seq}: one row at a time"
        assert torch.equal(mixed[seq], whole[seq]), f"sequence {seq}: chunked beside others"
    reference = seqs.run(ReferenceAttention(heads, kv_heads, dim, dim ** -0.5, window),
                         [[(0, 0, 45)], [(1, 0, 20)], [(2, 0, 33)]])
    for seq in range(3):
        torch.testing.assert_close(whole[seq].float(), reference[seq].float(), atol=TOLERANCE[dtype],
                                   rtol=TOLERANCE[dtype])


def test_fused_row_ops_take_float16():
    """fp16 models (the batch-invariant matmul takes fp16) run the same fused C++ row operators."""
    from sobrio.layers.norm import RMSNorm
    from sobrio.models.llama import GatedMLP

    gen = torch.Generator().manual_seed(7)
    norm = RMSNorm(96, 1e-6).half()
    x = torch.randn(5, 96, generator=gen).half()
    torch.testing.assert_close(norm(x).float(), norm.reference(x).float(), atol=2e-3, rtol=2e-3)
    gate_up = torch.randn(5, 80, generator=gen).half()
    gate, up = gate_up.chunk(2, dim=-1)
    mlp = GatedMLP(16, 40, "silu")
    torch.testing.assert_close(cpu_ops().act_and_mul(gate_up, mlp.act_code).float(), (mlp.act(gate) * up).float(),
                               atol=2e-3, rtol=2e-3)
