"""Group-wise int8 weights: int8 codes with a float32 scale and (optionally) offset per group of inputs,
w = code * scale + offset. This is how `--quantization gguf` keeps a GGUF's 8-, 6- and 5-bit blocks
(Q8_0, Q6_K, Q5_0, Q5_1, Q5_K): their codes are rearranged into int8 at load, never widened to bf16, so a
weight costs one byte and the scales stay exactly the file's. Where the CPU has AVX512-VNNI, `linear` and
`embedding` hand the codes to layers/vnni.py instead (int8 dot products, several times this kernel); this
module's kernels serve the CPUs without it (AVX-512, or AVX2 with FMA: there `int8-weight-only` takes them
too, layers/quantization.py). GGUF's 4-bit blocks take PyTorch's int4 kernel (`loader/gguf_blocks.py`).

Kernels by the step's row count: up to `GEMV_MAX_ROWS` rows the C++ `grouped_linear` (the codes read from
memory once, widened to float32 in registers, in L2-sized blocks of channels that every group of 4 rows
passes over; 4 output channels interleaved to hide FMA latency), past them the codes dequantized into x's
dtype `DEQUANT_CHUNK` output channels at a time for the matmul (compute-bound there, so the conversion is
paid once for all rows). Without the C++ operators every row count dequantizes. Past ~16 rows bf16 is
faster than either: the codes save memory, not time, at large batches (`benchmarks/grouped_kernels.py`;
the figures are in docs/quantization.md).
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sobrio.layers import vnni
from sobrio.layers.cpu_ops import cpu_ops, grouped_linear_available

GEMV_MAX_ROWS = 48
DEQUANT_CHUNK = 1024


@dataclass
class GroupedCodes:
    """codes int8 [N, K]; scales and offsets float32 [N, K / group_size] (offsets None: symmetric)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    group_size: int
    _vnni: "vnni.VnniCodes | None" = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        assert self.codes.dtype == torch.int8, self.codes.dtype
        assert k % self.group_size == 0 and self.scales.shape == (n, k // self.group_size), (self.scales.shape, n, k)
        assert self.offsets is None or self.offsets.shape == self.scales.shape

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @staticmethod
    def concat(parts: list["GroupedCodes"]) -> "GroupedCodes":
        """Several weights of one input as one (fused q/k/v or gate/up), along the output channels."""
        assert len({(p.group_size, p.in_features) for p in parts}) == 1
        offsets = [p.offsets if p.offsets is not None else torch.zeros_like(p.scales) for p in parts]
        any_offsets = any(p.offsets is not None for p in parts)
        return GroupedCodes(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                                torch.cat(offsets) if any_offsets else None, parts[0].group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32, first: int = 0, count: int | None = None) -> torch.Tensor:
        """Output channels first .. first + count as a float matrix [count, K]: the kernels' reference."""
        last = self.out_features if count is None else first + count
        w = self.codes[first:last].float().unflatten(-1, (-1, self.group_size))
        w *= self.scales[first:last, :, None]
        if self.offsets is not None:
            w += self.offsets[first:last, :, None]
        return w.flatten(1).to(dtype)

    def linear(self, bias: torch.Tensor | None) -> torch.nn.Module:
        """With VNNI, int8 dot products (layers/vnni.py: 3-8x this module's kernel at 1 to 32 rows)."""
        if vnni.usable(self.group_size):
            return self.vnni().linear(bias)
        return GroupedLinear(self, bias)

    def embedding(self, dtype: torch.dtype) -> torch.nn.Module:
        """Tied to the LM head, the lookup reads the same codes as `linear` (one copy)."""
        if vnni.usable(self.group_size):
            return self.vnni().embedding(dtype)
        return GroupedEmbedding(self, dtype)

    def vnni(self) -> vnni.VnniCodes:
        """The same weight for `vnni_linear`, codes shifted into 0..255; made once (embedding and LM head)."""
        if self._vnni is None:
            codes = self.codes.to(torch.int16) + vnni.CODE_ZERO_8BIT
            self._vnni = vnni.VnniCodes.pack(codes, self.scales, self.offsets, 8, self.group_size,
                                             vnni.CODE_ZERO_8BIT)
        return self._vnni


def grouped_linear(x: torch.Tensor, w: GroupedCodes, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) in x's dtype, by the kernel for its row count."""
    rows = x.reshape(-1, w.in_features)
    if rows.shape[0] <= GEMV_MAX_ROWS and grouped_linear_available():
        out = cpu_ops().grouped_linear(rows, w.codes, w.scales, w.offsets, w.group_size, bias)
    else:
        out = dequant_mm(rows, w, bias)
    return out.view(*x.shape[:-1], w.out_features)


def dequant_mm(x: torch.Tensor, w: GroupedCodes, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W.T with W dequantized a slice of channels at a time (each slice multiplied while it is
    still in cache)."""
    out = x.new_empty(x.shape[0], w.out_features)
    for first in range(0, w.out_features, DEQUANT_CHUNK):
        count = min(DEQUANT_CHUNK, w.out_features - first)
        torch.mm(x, w.dequantize(x.dtype, first, count).T, out=out[:, first:first + count])
    return out if bias is None else out.add_(bias)


class GroupedLinear(torch.nn.Module):
    """A Linear on group-wise codes (no float copy of the weight)."""

    def __init__(self, weight: GroupedCodes, bias: torch.Tensor | None):
        super().__init__()
        self.weight_codes = weight
        self.register_buffer("codes", weight.codes)  # so resident_bytes sees them
        self.register_buffer("scales", weight.scales)
        self.register_buffer("offsets", weight.offsets)
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return grouped_linear(x, self.weight_codes, self.bias)


class GroupedEmbedding(torch.nn.Module):
    """An embedding on group-wise quantized rows: a lookup dequantizes only the rows it reads. Tied to the LM
    head, `linear(None)` of the same codes computes the logits (no second copy)."""

    def __init__(self, weight: GroupedCodes, dtype: torch.dtype):
        super().__init__()
        self.weight_codes = weight
        self.dtype = dtype
        self.register_buffer("codes", weight.codes)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("offsets", weight.offsets)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        w = self.weight_codes
        codes = F.embedding(input_ids, w.codes).float().unflatten(-1, (-1, w.group_size))
        rows = codes * F.embedding(input_ids, w.scales)[..., None]
        if w.offsets is not None:
            rows += F.embedding(input_ids, w.offsets)[..., None]
        return rows.flatten(-2).to(self.dtype)
