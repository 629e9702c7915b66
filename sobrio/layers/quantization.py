"""Int8 weights (`--quantization int8 | int8-weight-only`): each output channel (row) of a weight is int8
with one symmetric scale, so the weights take half the bytes of bf16. `int8` (W8A8) also quantizes the
activations, per token, on the fly, for int8 x int8 matmuls; `int8-weight-only` keeps them in the model's
dtype. The embedding is int8 rows with a scale each, and the tied LM head is that same matrix.

The kernel is chosen by the CPU and the step's row count, because no single one wins everywhere:
- `int8` with AMX-INT8 (`amx_int8_fits`: N a multiple of 32, K of 64): sobrio's own kernel
  (csrc/amx_linear.cpp, `amx_int8_mm`), activations rounded per token inside it; the tied head's
  `AMX_OUTLIER_CHANNELS` largest inputs and each down_proj's inputs (groups of `AMX_ACT_GROUP`) rounded
  apart (`Outliers.of_amx`). The layer keeps the tile copy only; the embedding reads its rows from it.
- `int8` elsewhere: oneDNN's int8 linear on its packed copy, the fastest int8 kernel PyTorch ships at each
  row count; the tied head keeps the embedding's plain matrix, on which `aten._weight_int8pack_mm` serves up
  to `INT8PACK_MAX_ROWS` rows and `torch._int_mm` past them (also wherever oneDNN is missing).
- `int8-weight-only` without VNNI: `aten._weight_int8pack_mm` below `DEQUANT_MIN_ROWS` rows, then the weight
  converted to bf16 for aten's matmul (compute-bound there, it pays for the conversion). In a float32 model,
  and on AVX2 without AVX-512, the C++ grouped kernel instead (`grouped_int8_preferred`): aten's kernel is
  slow there.
- AVX512-VNNI without AMX-INT8 (AMD Zen 4): both modes take `vnni_linear` (layers/vnni.py,
  `vnni_int8_preferred`), activations rounded per group of inputs (`VNNI_INPUT_GROUPS`: 8 bits per 256 inputs
  in `int8`, a down_proj's per 64; 16 bits per 32 in weight-only). With AMX-INT8 `int8-weight-only` takes it
  too (and so int4's int8 head): the bullet above is W8A8 only.

Quality: `int8` first calibrates SmoothQuant's scales (layers/smoothing.py) and keeps the tied head's
`OUTLIER_CHANNELS` largest calibrated inputs in fp32 (`Outliers`): the head cannot be smoothed without
changing the embedding. `_weight_int8pack_mm` in bf16 or fp16 reads past the row when K is not a multiple
of 16 (PyTorch 2.13): such weights take `dequant_mm` or `int8_mm`. None of these kernels is batch-invariant:
`--batch-invariant` is refused with a quantization (config/model.py). The measured kernel tables and
perplexities behind these choices, with their commands and dates: docs/quantization.md.
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sobrio.csrc import cpu_flags
from sobrio.errors import ConfigError
from sobrio.layers import vnni
from sobrio.layers.cpu_ops import amx_int8_available, avx2_without_avx512, cpu_ops, grouped_linear_available
from sobrio.layers.gptq import gptq_quantize
from sobrio.layers.grouped import GroupedCodes, GroupedLinear
from sobrio.layers.int4 import Int4Codes, check_int4_shape, quantize_int4_codes

INT8PACK_MAX_ROWS = 4  # int8 on a plain int8 weight: _weight_int8pack_mm up to here, torch._int_mm past it
DEQUANT_MIN_ROWS = 24  # int8-weight-only: _weight_int8pack_mm below, dequantize + matmul from here
INT8_MAX = 127
INT4_GROUP_SIZE = 32  # divides SmolLM2's 576 and 1536 and Gemma 3's 640, 1024 and 2048 (128 does not divide 576)
OUTLIER_CHANNELS = 32  # the LM head's input channels kept in float in `int8` (see `Outliers`)
AMX_OUTLIER_CHANNELS = 64  # the tied head's on the AMX kernel: rounded as a group of their own (one tile of inputs)
AMX_ACT_GROUP = 64  # a down_proj's inputs on the AMX kernel: rounded per token and group of this many (one tile)
TINY = torch.finfo(torch.float32).tiny  # the scale of an all-zero row or token: its int8 values stay 0
ZERO_POINT = torch.zeros((), dtype=torch.long)  # oneDNN's weight zero point: symmetric weights
ONEDNN_U8_ZERO_POINT = 128  # activations as uint8 where oneDNN takes no s8 ones (`onednn_signed_activations`)


QUANTIZE_CHUNK_BYTES = 64 << 20  # float32 rows `quantize_weight` works on at once


def quantize_weight(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], scale [N] in `scale_dtype`): symmetric per output channel, scale = max |row| / 127.
    The int8 values are rounded against the scale as stored (bf16 or fp32), so `dequantize_weight` gives
    back exactly what the kernels compute with, and no element is off by more than half a step. Rows go
    through float32 `QUANTIZE_CHUNK_BYTES` at a time: the whole copy of a 128k-row embedding was 1 GB more
    at a quantizing start's peak (Llama-3.2-1B's)."""
    n, k = weight.shape
    q, scale = torch.empty(n, k, dtype=torch.int8), torch.empty(n, dtype=scale_dtype)
    rows = max(1, QUANTIZE_CHUNK_BYTES // (4 * k))
    for start in range(0, n, rows):
        w = weight[start:start + rows].detach().to(torch.float32, copy=True)  # divided in place: 2x faster
        low, high = torch.aminmax(w, dim=1)
        s = (torch.maximum(high, low.neg_()) / INT8_MAX).clamp_min(torch.finfo(scale_dtype).tiny).to(scale_dtype)
        q[start:start + rows] = w.div_(s.float()[:, None]).round_().clamp_(-INT8_MAX, INT8_MAX)
        scale[start:start + rows] = s
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float matrix an int8 weight stands for: the reference of every kernel here. In the scale's dtype
    the product is exact before its one rounding (int8 values are exact in bf16)."""
    return q.to(dtype).mul_(scale.to(dtype)[:, None])


def quantize_per_token(x: torch.Tensor, unsigned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, K], fp32 scale [M, 1]): each token (row) its own symmetric scale, computed per step, so an
    outlier token costs only its own precision. `unsigned`: the same values plus 128, as uint8 (zero point
    128), for kernels that take unsigned activations only."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min_(TINY) / INT8_MAX
    if unsigned:
        return (x / scale).round_().add_(ONEDNN_U8_ZERO_POINT).to(torch.uint8), scale
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


@dataclass
class Outliers:
    """Input channels of a W8A8 layer computed in float (LLM.int8()'s decomposition, on channels fixed by
    calibration): the few channels far above the rest would otherwise set every token's int8 step. For
    the tied LM head, which smoothing cannot reach (its scales would change the embedding too)."""

    index: torch.Tensor  # [k] the channels, ascending
    weight: torch.Tensor  # [N, k] fp32: their columns of the dequantized weight (AMX: int8, packed for it)

    @classmethod
    def of(cls, max_abs_x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, count: int) -> "Outliers":
        """The `count` channels of largest calibrated max |x|."""
        index = max_abs_x.topk(min(count, len(max_abs_x))).indices.sort().values
        return cls(index, dequantize_weight(q[:, index], scale, torch.float32))

    @classmethod
    def of_amx(cls, max_abs_x: torch.Tensor, q: torch.Tensor) -> "Outliers":
        """For the AMX kernel: the `AMX_OUTLIER_CHANNELS` largest, rounded per token on a scale of their own
        inside the kernel (no float pass over the logits); `weight` is their int8 columns packed for it."""
        index = max_abs_x.topk(AMX_OUTLIER_CHANNELS).indices.sort().values
        return cls(index, cpu_ops().amx_pack_weight_int8(q[:, index].contiguous()))


def int8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, outliers: Outliers | None = None) -> torch.Tensor:
    """W8A8 on a plain int8 weight (where oneDNN's packed one is not available): x quantized per token,
    int8 x int8 -> int32 by `torch._int_mm`, then scaled per token and per channel; `outliers`' channels
    zeroed before and added in fp32 after (SmolLM2's head, 32 of 576 channels: 8 to 64 rows within 10% of the
    time without, best of 5 on one shared thread)."""
    if outliers is not None:
        x_out, x = x[:, outliers.index].float(), x.index_fill(1, outliers.index, 0)
    xq, x_scale = quantize_per_token(x)
    if int8_dot_products():
        out = torch._int_mm(xq, q.t()).float()
    else:  # the same integer products, summed in fp32 (exact up to 2**24: K of about 1,000 at full range)
        out = xq.float() @ q.float().t()
    out = out.mul_(x_scale).mul_(scale)
    if outliers is not None:
        out.addmm_(x_out, outliers.weight.T)
    return out.to(x.dtype)


@functools.cache
def int8_dot_products() -> bool:
    """Whether the CPU has exact int8 dot products (VNNI or AMX-INT8). With AVX2 only (AMD EPYC Zen 3)
    oneDNN's int8 linear sums pairs of u8 x s8 products in int16 (vpmaddubsw), which saturates: measured
    errors of 20% of the output on full-range activations, s8 or u8; and torch._int_mm runs at about
    5 GOP/s there (a 32 x 576 x 1536 matmul 12 ms, fp32 1.3 ms). There W8A8 rounds its activations as
    elsewhere and sums the integer products in fp32."""
    flags = cpu_flags().split()
    return any(flag in flags for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))


def onednn_pack(q: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of an int8 weight for its int8 linear, or None where oneDNN is not in use or
    its int8 kernels would saturate (`int8_dot_products`)."""
    if not torch.backends.mkldnn.is_available() or not int8_dot_products():
        return None
    return torch.ops.onednn.qlinear_prepack(q, None)


@functools.cache
def onednn_signed_activations() -> bool:
    """Whether oneDNN's int8 linear has a fast kernel for signed (s8) activations here: AMX's int8 tiles
    take s8 x s8. Without AMX, oneDNN's VNNI kernels take u8 x s8 only and s8 activations fall to its
    reference kernel, ~1,000x slower (AMD EPYC Zen 4, oneDNN 3.12: 1.16 s a SmolLM2 step): there the
    activations go as uint8 with zero point 128, the same integers, the same result."""
    return "amx_int8" in cpu_flags().split()


def onednn_int8_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A8 on oneDNN's packed weight (`scale` fp32): x quantized per token; the linear takes one activation
    scale only, so it computes with 1 and the per-token scales multiply its output (in fp32 for an fp16 x:
    the output unscaled by the token's could exceed fp16's range)."""
    unsigned = not onednn_signed_activations()
    xq, x_scale = quantize_per_token(x, unsigned)
    out_dtype = torch.float32 if x.dtype == torch.float16 else x.dtype
    out = torch.ops.onednn.qlinear_pointwise(xq, 1.0, ONEDNN_U8_ZERO_POINT if unsigned else 0, packed, scale,
                                             ZERO_POINT, None, 1.0, 0, out_dtype, "none", [], "")
    return out.mul_(x_scale).to(x.dtype)


def amx_int8_fits(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `int8` takes the AMX-INT8 kernel (csrc/amx_linear.cpp) for this int8 weight in a model of
    `dtype`: whole tiles (N a multiple of 32, K of 64), bf16 or float32 activations, AMX-INT8 granted. There it
    streams the int8 weight at about memory speed at every row count; oneDNN's int8 linear and
    `torch._int_mm` ran slower than the bf16 AMX kernel past a few rows (the table above; figures against
    bf16 in the module docstring, from `benchmarks/linear_kernels.py`)."""
    n, k = weight.shape
    return n % 32 == 0 and k % 64 == 0 and dtype in (torch.bfloat16, torch.float32) and amx_int8_available()


def amx_int8_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, outliers: Outliers | None = None,
                float_out: bool = False, group: int = 0) -> torch.Tensor:
    """W8A8 on the AMX tiles, the activations rounded per token inside the kernel (`group` > 0: per token and
    group of that many inputs, a down_proj's). With `outliers` (`Outliers.of_amx`: the tied LM head's) their
    channels are rounded on a per-token scale of their own, in the same pass. `float_out`: the result in
    float32 (the logits), else in x's dtype.
    (Zeroing the head's outliers and adding their fp32 product after, as `int8_mm` does, cost 6.5% of the
    engine's time serving 32 streams.)"""
    n = scale.shape[0]
    if outliers is None:
        return cpu_ops().amx_int8_linear(x, packed, scale, n, None, None, None, float_out, group)
    if outliers.weight.dtype == torch.int8:
        return cpu_ops().amx_int8_linear(x, packed, scale, n, None, outliers.index, outliers.weight, float_out)
    x_out = x[:, outliers.index].float()  # fewer inputs than two groups of 64: in fp32 beside the kernel
    out = cpu_ops().amx_int8_linear(x.index_fill(1, outliers.index, 0), packed, scale, n, None, None, None, True)
    out.addmm_(x_out, outliers.weight.T)
    return out if float_out else out.to(x.dtype)


def amx_int8_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an int8 matrix [N, K] from its AMX tile copy ([N/16, K/64, 16, 16, 4], see
    `amx_pack_weight_int8`): row n is column n % 16 of its 16-row tiles, read in input order."""
    return packed[ids // 16, :, :, ids % 16].reshape(len(ids), -1)


def quantized_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, method: str,
                 outliers: Outliers | None = None) -> torch.Tensor:
    """x [M, K] @ (q * scale).T on a plain int8 weight, by the kernel that was fastest for M rows."""
    rows, int8pack = x.shape[0], int8pack_fits(q.shape[1]) and x.dtype == scale.dtype
    if method == "int8":
        # int8pack's exact activations are fast in bf16 only: in float16 ~12x int8_mm's time (docs/quantization.md)
        if int8pack and x.dtype == torch.bfloat16 and rows <= INT8PACK_MAX_ROWS:
            return weight_only_mm(x, q, scale)
        return int8_mm(x, q, scale, outliers)
    return weight_only_mm(x, q, scale) if int8pack and rows < DEQUANT_MIN_ROWS else dequant_mm(x, q, scale)


class QuantizedLinear(torch.nn.Module):
    """A Linear whose weight is int8 per output channel (vLLM's names: `weight`, `weight_scale`), keeping no
    float copy: the fewer resident bytes are the point. In `int8` mode with oneDNN (and `pack`) it keeps
    oneDNN's packed copy only (`packed`, its scales in fp32 as oneDNN wants them), not the plain matrix;
    without `pack` (the tied LM head: the embedding's matrix) the plain one only."""

    packed: torch.Tensor | None = None
    amx_packed: torch.Tensor | None = None  # `int8` on AMX-INT8: the tile-layout copy (`amx_int8_fits`)
    outliers: Outliers | None = None  # `int8`: the tied head's input channels apart
    act_group = 0  # `int8` on AMX: activations rounded per token and group of this many inputs (0: per token)
    scale_fp32: torch.Tensor

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, method: str,
                 pack: bool = True, grouped_inputs: bool = False):
        super().__init__()
        assert weight.dtype == torch.int8 and method in ("int8", "int8-weight-only"), method
        self.method = method
        self.in_features = weight.shape[1]
        self.float_out = False  # the tied head's logits: float32 (`keep_in_float`)
        if method == "int8" and amx_int8_fits(weight, weight_scale.dtype):
            self.amx_packed = cpu_ops().amx_pack_weight_int8(weight)
            self.scale_fp32 = weight_scale.float().contiguous()
            self.act_group = AMX_ACT_GROUP if grouped_inputs else 0
        elif method == "int8" and pack:
            self.packed = onednn_pack(weight)
            self.scale_fp32 = weight_scale.float()
        kept = pack and (self.packed is not None or self.amx_packed is not None)
        self.register_buffer("weight", None if kept else weight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, method: str,
                   grouped_inputs: bool = False) -> "QuantizedLinear":
        """Quantize a float weight; its scales (and so the activations' kernels) in the weight's dtype.
        `grouped_inputs` (a down_proj's): `int8` on AMX rounds its inputs per group of `AMX_ACT_GROUP`."""
        return cls(*quantize_weight(weight, weight.dtype), None if bias is None else bias.detach(), method,
                   grouped_inputs=grouped_inputs)

    def keep_in_float(self, max_abs_x: torch.Tensor, count: int = OUTLIER_CHANNELS) -> None:
        """`int8` on the plain matrix: the `count` input channels of largest calibrated max |x| computed in
        fp32 (their columns a buffer, so that resident_bytes counts them: 6.3 MB on SmolLM2's head); on the
        AMX kernel the `AMX_OUTLIER_CHANNELS` largest rounded as a group of their own (3.1 MB there)."""
        assert self.weight is not None and self.method == "int8", "outlier channels: W8A8 with its plain matrix only"
        if self.amx_packed is not None and self.in_features >= 2 * AMX_OUTLIER_CHANNELS:
            self.outliers = Outliers.of_amx(max_abs_x, self.weight)
        else:
            self.outliers = Outliers.of(max_abs_x, self.weight, self.weight_scale, count)
        self.register_buffer("outlier_weight", self.outliers.weight)
        self.float_out = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        if self.amx_packed is not None:
            out = amx_int8_mm(rows, self.amx_packed, self.scale_fp32, self.outliers, self.float_out, self.act_group)
        elif self.packed is not None:
            out = onednn_int8_mm(rows, self.packed, self.scale_fp32)
        else:
            out = quantized_mm(rows, self.weight, self.weight_scale, self.method, self.outliers)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], out.shape[-1])


# The inputs whose activations `vnni_linear` rounds together (one step each group) in the int8 modes. Each group's
# int32 sum is scaled once in float32, so a larger group leaves more of the VNNI units to the dot products. A
# down_proj's inputs (the gated activation's products) have the outliers, so they stay finer, 64 as on the AMX
# kernel (`AMX_ACT_GROUP`). 16-bit activations (weight-only) overflow a group's int32 sum past 128 inputs and are
# fine already at 32. Speed and perplexity of each choice: docs/quantization.md.
VNNI_INPUT_GROUPS = {"int8": 256, "down_proj": 64, "int8-weight-only": 32}


def vnni_int8_preferred(in_features: int, method: str) -> bool:
    """Whether `--quantization method` (int8, or int8-weight-only: also int4's head) takes `vnni_linear`
    (layers/vnni.py): where the CPU has VNNI, except `int8` with AMX-INT8, whose own kernel is W8A8.
    AMD EPYC Zen 4, 2 threads, SmolLM2 (`benchmarks/step_overhead.py --quantization int8`): a batch-1 step
    19.7 ms with oneDNN's linear, a batch-32 one 50 ms (bf16: 13 and 47). On an AMX host this kernel is ~3x
    aten's int8pack for weight-only (docs/quantization.md)."""
    if in_features % 16 or not vnni.usable(16):
        return False
    return method != "int8" or not onednn_signed_activations()


def grouped_int8_preferred(in_features: int, dtype: torch.dtype) -> bool:
    """Whether `int8-weight-only` in a model of `dtype` takes the C++ grouped kernel (layers/grouped.py, one
    group a row) instead of aten's `_weight_int8pack_mm`: in float32 on every CPU, and on an AVX2 CPU without
    AVX-512, where PyTorch's int8 weight kernels ran slower than float32 (AMD EPYC Zen 3, 2 threads, SmolLM2
    batch-1 decode: float32 29.9 tok/s, int8pack 8.2). With this kernel
    (`benchmarks/step_overhead.py --batch 1 --quantization int8-weight-only`): a batch-1 step 22.4 ms against
    31.6 in float32, a batch-32 one 201.6 against 177.8 (past a few rows float32's GEMM wins: not tuned).
    `_weight_int8pack_mm` with float32 activations is slow on AVX-512 too (figures: docs/quantization.md)."""
    return (in_features % 16 == 0 and grouped_linear_available()
            and (dtype == torch.float32 or avx2_without_avx512()))


def grouped_int8_codes(q: torch.Tensor, scale: torch.Tensor) -> GroupedCodes:
    """An int8 weight per output channel as one group of all its inputs, for `grouped_linear`."""
    return GroupedCodes(q, scale.float()[:, None].contiguous(), None, q.shape[1])


def vnni_int8_codes(weight: torch.Tensor, group: int = 32) -> vnni.VnniCodes:
    """A float weight as int8 per output channel (`quantize_weight`, the scale rounded to fp16 first) packed
    for `vnni_linear` with the channel's one scale, in groups of `group` inputs (the largest power of two
    below it that divides K, 16 at least), the groups along which the activations are rounded: an outlier
    channel costs its group only."""
    q, scale = quantize_weight(weight, torch.float16)
    k = q.shape[1]
    group = next(g for g in (256, 128, 64, 32, 16) if g <= group and k % g == 0)
    codes = q.view(torch.uint8) ^ 0x80  # q + CODE_ZERO_8BIT as unsigned bytes: one byte-wide pass
    return vnni.VnniCodes.pack(codes, scale.float()[:, None], None, 8, group, vnni.CODE_ZERO_8BIT)


def quantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, method: str, name: str,
                     grouped_inputs: bool = False, hessian: torch.Tensor | None = None) -> torch.nn.Module:
    """The quantized form of one Linear for `--quantization method`; `name` goes into a shape error;
    `grouped_inputs` (a down_proj's: GELU's or SiLU's products) has `int8` on AMX round them per group;
    `hessian` (int4, from calibration) has GPTQ round the weight."""
    if method == "int4":
        return int4_linear_from_float(weight, bias, name, hessian)
    if vnni_int8_preferred(weight.shape[1], method):
        group = VNNI_INPUT_GROUPS["down_proj" if grouped_inputs and method == "int8" else method]
        return vnni_int8_codes(weight, group).linear(None if bias is None else bias.detach(),
                                                     vnni.INT8_ACT_BITS[method])
    if method == "int8-weight-only" and grouped_int8_preferred(weight.shape[1], weight.dtype):
        return GroupedLinear(grouped_int8_codes(*quantize_weight(weight, weight.dtype)),
                             None if bias is None else bias.detach())
    return QuantizedLinear.from_float(weight, bias, method, grouped_inputs)


def int8_head_method(method: str) -> str:
    """The int8 mode of a quantized model's embedding and LM head: `int4` keeps them weight-only int8."""
    return "int8-weight-only" if method == "int4" else method


def quantized_embedding(weight: torch.Tensor, method: str = "int8") -> torch.nn.Module:
    """The int8 embedding of the quantized modes; tied, its `lm_head(int8_head_method(method))` is the LM head
    on the same codes (on the VNNI kernel its activations rounded in that mode's groups)."""
    head = int8_head_method(method)
    if vnni_int8_preferred(weight.shape[1], head):
        return vnni_int8_codes(weight, VNNI_INPUT_GROUPS[head]).embedding(weight.dtype)
    return QuantizedEmbedding.from_float(weight)


def int4_linear_from_float(weight: torch.Tensor, bias: torch.Tensor | None, name: str,
                           hessian: torch.Tensor | None = None) -> torch.nn.Module:
    """`--quantization int4`: groups of `INT4_GROUP_SIZE`, by GPTQ where calibration gave the layer's input
    `hessian` (layers/gptq.py), else each weight on its nearest code; a shape the kernel cannot take is a
    ConfigError naming the layer, before any weight is packed. Where the CPU has VNNI the codes take
    layers/vnni.py, as a GGUF's and an AWQ checkpoint's do (and the fused decode), else aten's int4 kernel:
    SmolLM2 batch-1 decode step 9.7 -> 5.7 ms, batch 32 81.9 -> 65.6 ms (`sobrio bench roofline
    --quantization int4 --batch 1,32`, Intel Xeon with AMX, one run each)."""
    try:
        check_int4_shape(weight.shape[0], weight.shape[1], INT4_GROUP_SIZE, name)
    except ValueError as exc:
        raise ConfigError(f"--quantization int4: {exc}", "--quantization") from None
    if hessian is None:
        return quantize_int4_codes(weight.detach(), INT4_GROUP_SIZE).linear(bias)
    return Int4Codes(*gptq_quantize(weight, hessian, INT4_GROUP_SIZE), INT4_GROUP_SIZE).linear(bias)


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

    amx_rows: torch.Tensor | None = None  # the tied head's AMX tile copy, once it is the only copy

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.amx_rows is not None:
            codes = amx_int8_rows(self.amx_rows, input_ids.reshape(-1)).view(*input_ids.shape, -1)
        else:
            codes = F.embedding(input_ids, self.weight)
        return codes.to(self.weight_scale.dtype) * F.embedding(input_ids, self.weight_scale[:, None])

    def lm_head(self, method: str, max_abs_x: torch.Tensor | None = None) -> torch.nn.Module:
        """The tied LM head: a QuantizedLinear over this same int8 matrix and scales (no copy, not even
        oneDNN's packed one: a quarter of SmolLM2's weights, 60% of Gemma 3 270M's), or weight-only on an
        AVX2 CPU the grouped kernel on it. In `int8`, given its inputs' calibrated max |x|, its
        `OUTLIER_CHANNELS` largest input channels are kept in float."""
        if method == "int8-weight-only" and grouped_int8_preferred(self.weight.shape[1], self.weight_scale.dtype):
            return GroupedLinear(grouped_int8_codes(self.weight, self.weight_scale), None)
        head = QuantizedLinear(self.weight, self.weight_scale, None, method, pack=False)
        if method == "int8" and max_abs_x is not None:
            head.keep_in_float(max_abs_x)
        if head.amx_packed is not None:  # AMX-INT8: the head's tile copy serves the lookups too, the only copy
            self.amx_rows, self.weight, head.weight = head.amx_packed, None, None
        return head
