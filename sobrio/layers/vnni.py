"""4- and 8-bit group-wise weights multiplied with int8 dot products (AVX512-VNNI), llama.cpp's way: each
row of the activations is rounded per group of inputs, and the C++ `vnni_linear` sums code x activation
products exactly in int32, one float scale per group. The activations are rounded to 16 bits (two int8
halves, two dot products; `ACT_BITS`): to 8 bits, as llama.cpp does, SmolLM2's Q4_1 file lost 1.6% of
perplexity against the same file dequantized, at 16 bits 0.1%; a decode step, bound by reading the
weights, does not see the second product. This is how `--quantization gguf` computes
a GGUF's quantized blocks where the CPU has VNNI (`loader/gguf_blocks.py` decodes them; `Int4Codes.linear`
and `GroupedCodes.linear` land here): the weights are read once at 0.625 (4-bit, fp16 scale and offset per
32) or 1.06 bytes (Q8_0) a weight, and the multiply costs a fraction of widening each code to float.

A weight is w = scale * (code - code_zero) + offset per group; codes are unsigned (4 bits: 0..15; 8 bits:
signed codes shifted by code_zero = 128), scales and offsets fp16 (GGUF's own d and m are fp16; the
K-quants' products d * sc are rounded to fp16 here, 2^-11 relative). The rounding of x to int8 per group
is the one approximation: `reference` computes the same thing in PyTorch.
"""

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sobrio.layers.cpu_ops import amx_available, cpu_ops, vnni_linear_available

TILE = 32  # output channels a tile of the packed layout (vnni_linear.cpp)
CODE_ZERO_8BIT = 128  # signed 8-bit codes are stored shifted into 0..255
ACT_BITS = 16  # activations rounded to 16 bits per group (8: llama.cpp's Q8, 1.6% of perplexity on SmolLM2)
ACT_TOP = {8: 127.0, 16: 127.0 * 256}  # the largest |integer| of a group's rounded activations
INT8_ACT_BITS = {"int8": 8, "int8-weight-only": 16}  # `--quantization` int8 modes on this kernel (W8A8, W8A16)


@dataclass
class VnniCodes:
    """A weight [out_features, in_features] packed for `vnni_linear` (`pack`): weight uint8
    [tiles, G, chunks, 2, 16, 4]; scales and offsets fp16 [tiles, G, 32] (offsets None: none), or scales
    [tiles, 1, 32], one a channel, where the kernel scales each group's sums by the activations' step alone."""

    weight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    out_features: int
    in_features: int
    bits: int
    group_size: int
    code_zero: int

    @classmethod
    def pack(cls, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, bits: int,
             group_size: int, code_zero: int = 0) -> "VnniCodes":
        """From unsigned codes [N, K] (< 2**bits) and float scales and offsets [N, K / group_size], or
        scales [N, 1] without offsets (one a channel)."""
        n, k = codes.shape
        assert bits in (4, 8) and k % group_size == 0 and group_size % 16 == 0, (bits, k, group_size)
        assert int(codes.min()) >= 0 and int(codes.max()) < 2 ** bits, "codes: unsigned, below 2**bits"
        tiles, groups = -(-n // TILE), k // group_size
        assert scales.shape == (n, groups) or (scales.shape == (n, 1) and offsets is None), (scales.shape, groups)
        padded = F.pad(codes.to(torch.uint8), (0, 0, 0, tiles * TILE - n))
        per_chunk = 8 if bits == 4 else 4
        c = padded.view(tiles, 2, 16, groups, group_size // per_chunk, per_chunk)
        if bits == 4:  # input j in the low nibble, j + 4 in the high one
            c = c[..., :4] | (c[..., 4:] << 4)
        weight = c.permute(0, 3, 4, 1, 2, 5).contiguous()
        return cls(weight, _tiled(scales, tiles), None if offsets is None else _tiled(offsets, tiles), n, k, bits,
                   group_size, code_zero)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Output channels `index` (any shape) dequantized to fp32 [..., K]: the embedding's lookup, and the
        reference's weights."""
        flat = index.reshape(-1)
        tile, half, lane = flat // TILE, (flat % TILE) // 16, flat % 16
        c = self.weight[tile, :, :, half, lane]  # [T, G, chunks, 4]
        if self.bits == 4:
            c = torch.cat([c & 0x0F, c >> 4], dim=-1)
        codes = c.reshape(len(flat), -1, self.group_size).float() - self.code_zero
        scales = self.scales[tile, :, flat % TILE].float()[..., None]
        w = codes * scales
        if self.offsets is not None:
            w += self.offsets[tile, :, flat % TILE].float()[..., None]
        return w.reshape(*index.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))

    def linear(self, bias: torch.Tensor | None, act_bits: int = ACT_BITS) -> "VnniLinear":
        return VnniLinear(self, bias, act_bits)

    def embedding(self, dtype: torch.dtype) -> "VnniEmbedding":
        return VnniEmbedding(self, dtype)


def usable(group_size: int) -> bool:
    """Whether weights in groups of `group_size` inputs can take `vnni_linear` on this CPU."""
    return group_size % 16 == 0 and vnni_linear_available() and os.environ.get("SOBRIO_DISABLE_VNNI") != "1"


def _tiled(values: torch.Tensor, tiles: int) -> torch.Tensor:
    """[N, G] -> fp16 [tiles, G, 32], the padded channels 0."""
    padded = F.pad(values.to(torch.float16), (0, 0, 0, tiles * TILE - values.shape[0]))
    return padded.view(tiles, TILE, -1).transpose(1, 2).contiguous()


def quantize_activations(x: torch.Tensor, group_size: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(integer values [M, K] as float, step [M, G, 1]): x rounded per group of inputs as the kernel does."""
    g = x.float().unflatten(-1, (-1, group_size))
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, ACT_TOP[bits] / amax, torch.zeros_like(amax))
    return torch.round(g * inv).flatten(-2), amax / ACT_TOP[bits]


def reference(x: torch.Tensor, w: VnniCodes, bias: torch.Tensor | None = None,
              act_bits: int = ACT_BITS) -> torch.Tensor:
    """What `vnni_linear` computes, in PyTorch (fp32): x rounded per group, times the weight's codes, plus
    each group's offset times the exact sum of x over the group."""
    q, step = quantize_activations(x, w.group_size, act_bits)
    codes = w.rows(torch.arange(w.out_features))
    if w.offsets is not None:  # the offsets apart: they multiply the unrounded sums
        offsets = w.offsets.transpose(1, 2).reshape(-1, w.in_features // w.group_size)[:w.out_features].float()
        codes = codes - offsets.repeat_interleave(w.group_size, 1)
        exact = x.float().unflatten(-1, (-1, w.group_size)).sum(-1) @ offsets.T
    else:
        exact = 0.0
    y = (q.unflatten(-1, (-1, w.group_size)) * step).flatten(-2) @ codes.T + exact
    return (y if bias is None else y + bias.float()).to(x.dtype)


KERNEL_DTYPES = (torch.float32, torch.bfloat16)


NO_DENSE_ROWS = 1 << 62  # `dense_min_rows` where the int8 dot products win at every row count


@functools.cache
def dense_min_rows(act_bits: int) -> int:
    """From how many rows (prompt chunks) `vnni_linear` multiplies the weight dequantized (`dense_weight`) by
    aten's bf16 matmul instead of the int8 dot products. With AMX, bf16 tiles make that pay from the operator's
    `vnni_dense_min_rows` (128; csrc/vnni_linear.cpp). Without (AMD Zen 4), dequantizing a layer's weights
    costs more than the dot products save: W8A8's 8-bit activations (one product) win at every row count up
    to a 2,048-token chunk, 16-bit ones (two products) up to about 512 rows (docs/quantization.md)."""
    if amx_available():
        return cpu_ops().vnni_dense_min_rows
    return NO_DENSE_ROWS if act_bits == 8 else 512


def vnni_linear(x: torch.Tensor, w: VnniCodes, bias: torch.Tensor | None = None,
                act_bits: int = ACT_BITS) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) in x's dtype (fp32 or bf16; others by way of fp32). From `dense_min_rows`
    rows (prompt chunks) it multiplies the weight dequantized instead of taking the int8 dot products."""
    rows = x if x.dim() == 2 else x.reshape(-1, w.in_features)
    if rows.dtype not in KERNEL_DTYPES:
        rows = rows.float()
    out = cpu_ops().vnni_linear(rows, w.weight, w.scales, w.offsets, w.out_features, w.bits, w.group_size,
                                w.code_zero, act_bits, bias, dense_min_rows(act_bits))
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], w.out_features)


def dense_weight(w: VnniCodes, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] the codes stand for, in `dtype` (fp32 or bf16): `VnniCodes.dequantize`'s values
    (bitwise, rounded once to bf16), by the C++ operator (a fraction of a millisecond for a layer's matrix)."""
    return cpu_ops().vnni_dequantize(w.weight, w.scales, w.offsets, w.out_features, w.in_features, w.bits,
                                     w.group_size, w.code_zero, dtype == torch.bfloat16)


class VnniLinear(torch.nn.Module):
    """A Linear on `VnniCodes` (no float copy of the weight)."""

    def __init__(self, weight: VnniCodes, bias: torch.Tensor | None, act_bits: int = ACT_BITS):
        super().__init__()
        assert vnni_linear_available(), "vnni_linear was not built (it needs AVX512-VNNI)"
        self.weight_codes = weight
        self.act_bits = act_bits
        self.register_buffer("codes", weight.weight)  # so resident_bytes and .to() see them
        self.register_buffer("scales", weight.scales)
        self.register_buffer("offsets", weight.offsets)
        self.register_buffer("bias", None if bias is None else bias.detach())

    @property
    def group_size(self) -> int:
        return self.weight_codes.group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return vnni_linear(x, self.weight_codes, self.bias, self.act_bits)


class VnniEmbedding(torch.nn.Module):
    """An embedding on `VnniCodes`: a lookup dequantizes only the rows it reads. Tied to the LM head,
    `linear(None)` of the same codes computes the logits (no second copy)."""

    def __init__(self, weight: VnniCodes, dtype: torch.dtype):
        super().__init__()
        self.weight_codes = weight
        self.dtype = dtype
        self.register_buffer("codes", weight.weight)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("offsets", weight.offsets)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weight_codes.rows(input_ids).to(self.dtype)

    def lm_head(self, method: str, max_abs_x: torch.Tensor | None = None) -> VnniLinear:
        """The tied LM head of an int8 mode (`QuantizedEmbedding.lm_head`'s counterpart): the same codes, the
        activations rounded in their groups (no outlier channels to keep: a group's step is its own)."""
        return self.weight_codes.linear(None, INT8_ACT_BITS[method])
