"""Int8 weights (`--quantization int8 | int8-weight-only`): each output channel (row) of a weight is int8
with one symmetric scale, so the weights take half the bytes of bf16. `int8` (W8A8) also quantizes the
activations, per token, on the fly, for int8 x int8 matmuls; `int8-weight-only` keeps them in the model's
dtype. The embedding is int8 rows with a scale each, and the tied LM head is that same matrix.

The kernels are PyTorch's, chosen by the step's row count from `benchmarks/quant_kernels.py` (SmolLM2-135M's
121 matmuls a step: 30 x (qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576) and the 576->49152
LM head; ms per step on one thread of this Xeon with AMX, bf16 = `layers.linear.linear` with its oneDNN
and AMX packed copies, as the engine runs today):

    rows   bf16   int8pack_mm  dequant+mm   int_mm W8A8  oneDNN W8A8  ao dynamic
       1   24.9   21.6  1.15x   89.5 0.28x   30.2 0.82x   20.5 1.21x   14.6 1.71x
       4   24.8   29.5  0.84x   94.4 0.26x   31.1 0.80x   21.3 1.16x   20.3 1.22x
       8   25.1   49.6  0.51x   93.4 0.27x   33.0 0.76x   22.7 1.11x   24.5 1.02x
      24   26.4  107.3  0.25x  106.2 0.25x   44.5 0.59x   32.7 0.81x   32.9 0.80x
      32   25.5  131.3  0.19x   78.5 0.32x   47.0 0.54x   34.9 0.73x   37.5 0.68x
      64   35.7  233.8  0.15x   92.8 0.38x   64.5 0.55x   50.6 0.71x   60.8 0.59x
     256   76.4  849.7  0.09x  191.4 0.40x  230.5 0.33x  166.0 0.46x  253.6 0.30x

- `int8`: oneDNN's int8 linear on its packed copy of the weight (`onednn::qlinear_pointwise`, the per-token
  activation scales applied to its output) at every row count: the fastest int8 kernel at each. The layer
  keeps that copy only. The tied LM head keeps the embedding's plain matrix (no second copy), on which
  `aten._weight_int8pack_mm` wins up to `INT8PACK_MAX_ROWS` rows and `torch._int_mm` (W8A8) past them;
  those two also serve wherever oneDNN is missing.
- `int8-weight-only`: `aten._weight_int8pack_mm` below `DEQUANT_MIN_ROWS` rows, then the weight converted
  to bf16 for aten's matmul (the scales on the output): compute-bound there, it pays for the conversion.
- torch.ao's dynamic linear (fbgemm) is the fastest at 1-4 rows, but its activation scale is per tensor
  (per token only at one row), its packed weight would be a second copy, and PyTorch deprecates it.

On this AMX host no int8 kernel PyTorch ships beats the bf16 AMX kernel past about 8 rows: here int8 saves
memory (SmolLM2's resident weights 807 -> 136 MB, bf16's packed copies counted) and is a little faster at
1-8 rows only (2 threads, 1 row: int8pack_mm 1.22x, oneDNN W8A8 1.08x). End to end (offline, 2 threads,
bf16 = 1): batch 1 about even, batch 32 0.64x (`int8`) and 0.34x (`int8-weight-only`). Faster int8 needs
kernels of sobrio's own (issue 13's next slices). Quality: weight-only is at bf16's perplexity; W8A8 with
per-token scales and no smoothing is 3-5% above it (SmolLM2 and Gemma 3 on sample text).

`_weight_int8pack_mm` in bf16 or fp16 reads past the row when K is not a multiple of 16 (NaN or a crash,
PyTorch 2.13): such weights take `dequant_mm` (weight-only) or `int8_mm` (W8A8) instead. None of these kernels
is batch-invariant (the kernel changes with the row count): `--batch-invariant` is refused with a
quantization (config/model.py).
"""

import torch
import torch.nn.functional as F

from sobrio.errors import ConfigError
from sobrio.layers.int4 import check_int4_shape, int4_linear, quantize_int4

INT8PACK_MAX_ROWS = 4  # int8 on a plain int8 weight: _weight_int8pack_mm up to here, torch._int_mm past it
DEQUANT_MIN_ROWS = 24  # int8-weight-only: _weight_int8pack_mm below, dequantize + matmul from here
INT8_MAX = 127
INT4_GROUP_SIZE = 32  # divides SmolLM2's 576 and 1536 and Gemma 3's 640, 1024 and 2048 (128 does not divide 576)
TINY = torch.finfo(torch.float32).tiny  # the scale of an all-zero row or token: its int8 values stay 0
ZERO_POINT = torch.zeros((), dtype=torch.long)  # oneDNN's weight zero point: symmetric weights


def quantize_weight(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], scale [N] in `scale_dtype`): symmetric per output channel, scale = max |row| / 127.
    The int8 values are rounded against the scale as stored (bf16 or fp32), so `dequantize_weight` gives
    back exactly what the kernels compute with, and no element is off by more than half a step."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / INT8_MAX).clamp_min(TINY).to(scale_dtype)
    q = torch.round(w / scale.float()[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float matrix an int8 weight stands for: the reference of every kernel here. In the scale's dtype
    the product is exact before its one rounding (int8 values are exact in bf16)."""
    return q.to(dtype).mul_(scale.to(dtype)[:, None])


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, K], fp32 scale [M, 1]): each token (row) its own symmetric scale, computed per step, so an
    outlier token costs only its own precision."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min_(TINY) / INT8_MAX
    return (x / scale).round_().to(torch.int8), scale


def int8pack_fits(in_features: int) -> bool:
    """Whether `_weight_int8pack_mm` computes this K correctly in every dtype (see the module docstring)."""
    return in_features % 16 == 0


def weight_only_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ (q * scale).T with x in its float dtype: aten's int8-weight GEMV/GEMM (`scale` in x's dtype)."""
    if not int8pack_fits(q.shape[1]):
        raise ValueError(f"_weight_int8pack_mm needs in_features divisible by 16, got {q.shape[1]}")
    return torch.ops.aten._weight_int8pack_mm(x, q, scale)


def dequant_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Weight-only for many rows (compute-bound, so the conversion pays): the int8 weight converted to x's
    dtype for aten's matmul, the per-channel scale applied to the output rather than to the weight (one pass
    less over it), except in fp16, whose range the unscaled sums could exceed."""
    if x.dtype == torch.float16:
        return F.linear(x, dequantize_weight(q, scale, x.dtype))
    return F.linear(x, q.to(x.dtype)).mul_(scale)


def int8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A8 on a plain int8 weight (where oneDNN's packed one is not available): x quantized per token,
    int8 x int8 -> int32 by `torch._int_mm`, then scaled per token and per channel."""
    xq, x_scale = quantize_per_token(x)
    return torch._int_mm(xq, q.t()).float().mul_(x_scale).mul_(scale).to(x.dtype)


def onednn_pack(q: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of an int8 weight for its int8 linear, or None where oneDNN is not in use."""
    if not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.onednn.qlinear_prepack(q, None)


def onednn_int8_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A8 on oneDNN's packed weight (`scale` fp32): x quantized per token; the linear takes one activation
    scale only, so it computes with 1 and the per-token scales multiply its output (in fp32 for an fp16 x:
    the output unscaled by the token's could exceed fp16's range)."""
    xq, x_scale = quantize_per_token(x)
    out_dtype = torch.float32 if x.dtype == torch.float16 else x.dtype
    out = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, packed, scale, ZERO_POINT, None, 1.0, 0, out_dtype,
                                             "none", [], "")
    return out.mul_(x_scale).to(x.dtype)


def quantized_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, method: str) -> torch.Tensor:
    """x [M, K] @ (q * scale).T on a plain int8 weight, by the kernel that was fastest for M rows."""
    rows, int8pack = x.shape[0], int8pack_fits(q.shape[1]) and x.dtype == scale.dtype
    if method == "int8":
        return weight_only_mm(x, q, scale) if int8pack and rows <= INT8PACK_MAX_ROWS else int8_mm(x, q, scale)
    return weight_only_mm(x, q, scale) if int8pack and rows < DEQUANT_MIN_ROWS else dequant_mm(x, q, scale)


class QuantizedLinear(torch.nn.Module):
    """A Linear whose weight is int8 per output channel (vLLM's names: `weight`, `weight_scale`), keeping no
    float copy: the fewer resident bytes are the point. In `int8` mode with oneDNN (and `pack`) it keeps
    oneDNN's packed copy only (`packed`, its scales in fp32 as oneDNN wants them), not the plain matrix;
    without `pack` (the tied LM head: the embedding's matrix) the plain one only."""

    packed: torch.Tensor | None = None

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, method: str,
                 pack: bool = True):
        super().__init__()
        assert weight.dtype == torch.int8 and method in ("int8", "int8-weight-only"), method
        self.method = method
        self.in_features = weight.shape[1]
        if method == "int8" and pack:
            self.packed = onednn_pack(weight)
            self.scale_fp32 = weight_scale.float()
        self.register_buffer("weight", weight if self.packed is None else None)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, method: str) -> "QuantizedLinear":
        """Quantize a float weight; its scales (and so the activations' kernels) in the weight's dtype."""
        return cls(*quantize_weight(weight, weight.dtype), None if bias is None else bias.detach(), method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        if self.packed is not None:
            out = onednn_int8_mm(rows, self.packed, self.scale_fp32)
        else:
            out = quantized_mm(rows, self.weight, self.weight_scale, self.method)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], out.shape[-1])


class Int4Linear(torch.nn.Module):
    """A Linear whose weight is int4 (`--quantization int4`): groups of `INT4_GROUP_SIZE` inputs with a bf16
    scale and zero each, packed in the layout of PyTorch's CPU kernel (layers/int4.py), no float copy. A
    step's few rows take that kernel (a quarter of bf16's bytes); many rows dequantize slices for bf16's."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, name: str = "weight"):
        super().__init__()
        try:
            check_int4_shape(weight.shape[0], weight.shape[1], INT4_GROUP_SIZE, name)
        except ValueError as exc:
            raise ConfigError(f"--quantization int4: {exc}", "--quantization") from None
        self.int4 = quantize_int4(weight.detach(), INT4_GROUP_SIZE)
        self.register_buffer("packed", self.int4.packed)  # so resident_bytes and .to() see them
        self.register_buffer("scales_and_zeros", self.int4.scales_and_zeros)
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = int4_linear(x, self.int4)
        return out if self.bias is None else out + self.bias


def quantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, method: str,
                     name: str) -> torch.nn.Module:
    """The quantized form of one Linear for `--quantization method`; `name` goes into a shape error."""
    if method == "int4":
        return Int4Linear(weight, bias, name)
    return QuantizedLinear.from_float(weight, bias, method)


class QuantizedEmbedding(torch.nn.Module):
    """An embedding stored as int8 rows with one scale each: a lookup dequantizes only the rows it reads.
    Tied to the LM head, the same matrix serves as its int8 weight (`lm_head`)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> "QuantizedEmbedding":
        """Quantize a float embedding; its rows come out in the weight's dtype."""
        return cls(*quantize_weight(weight, weight.dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(input_ids, self.weight).to(self.weight_scale.dtype)
        return rows * F.embedding(input_ids, self.weight_scale[:, None])

    def lm_head(self, method: str) -> QuantizedLinear:
        """The tied LM head: a QuantizedLinear over this same int8 matrix and scales (no copy, not even
        oneDNN's packed one: a quarter of SmolLM2's weights, 60% of Gemma 3 270M's)."""
        return QuantizedLinear(self.weight, self.weight_scale, None, method, pack=False)
