"""Int4 weights, group-wise and asymmetric (`--quantization int4`): a Linear weight [N, K] is cut along K into
groups of 32, 64 or 128; each group of each output channel has its own scale and zero, so a step reads a
quarter of bf16's bytes (plus 4 bytes of scale and zero per group).

The parameterization is the one PyTorch's CPU kernel computes with (tinygemm's), so the reference here is
exactly what the kernel multiplies by:

    w[n, k] ~ (q[n, k] - 8) * scale[g, n] + zero[g, n],    q in [0, 15], g = k // group_size

`zero` is the float value of the middle code 8; an integer zero point z, as AWQ and GPTQ checkpoints store
it (w ~ (q - z) * scale), is zero = (8 - z) * scale. Scales and zeros are rounded to bf16 before the codes
are chosen (a checkpoint's too: each moves a weight by at most 1/16 of its group's step). Each group's grid
is a least-squares fit (`fit_grids`), not the min-max one. `Int4Linear` is the module over a packed weight,
built from a float weight (`from_float`) or from a checkpoint's `Int4Codes` (loader/awq_gptq.py).

PyTorch 2.13's CPU ops: `_convert_weight_to_int4pack_for_cpu` packs int32 codes [N, K] (N % 16 == 0, K even)
into uint8 [N, K / 2] in a CPU-dependent blocked layout (blocks of 64 channels on AVX512, 32 otherwise;
`_dequantize_packed` finds it by packing a probe); `_weight_int4pack_mm_for_cpu` dequantizes in fp32
registers and accumulates four rows at a time, bf16 only on AVX512 (fp32 takes a scalar loop). It reads the
4-bit weight once, so it wins at few rows, but its cost grows with the rows; dequantizing once and running
aten's matmul overtakes it past some tens: `int4_linear` takes the packed kernel below `DEQUANT_MIN_ROWS` rows
in bf16 and dequantizes from there; fp32 always dequantizes. Past ~16 rows int4 is slower than bf16 either
way: it is the mode for small batches. The timings behind these thresholds (`benchmarks/int4_kernels.py`)
are in docs/quantization.md.
"""

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sobrio.layers import vnni

GROUP_SIZES = (32, 64, 128)
PACK_N_MULTIPLE = 16  # `_convert_weight_to_int4pack_for_cpu` takes whole blocks of 16 output channels
DEQUANT_MIN_ROWS = {torch.bfloat16: 64, torch.float16: 1, torch.float32: 1}  # from the measurement above
DEQUANT_CHUNK = 1024  # output channels dequantized at a time: [K, 1024] stays in L2; a multiple of the block
SCALE_DTYPE = torch.bfloat16
FIT_CHUNK_GROUPS = 8192  # groups `fit_grids` fits at once: 1 MB of fp32 at 32 a group, within L2
GRID_CANDIDATES = 6  # `fit_grids`' grids besides the min-max one (20: 0.3% less RMS error, 3x the time)
AWQ_GRID = 20
AWQ_SEARCH_ROWS = 128  # output channels the search scores (evenly spaced): its time, not the result, scales with N
ZERO_POINT_MIN_STEP = 1e-5  # the step of a constant group in `quantize_int4_zero_point` (AutoAWQ's clamp)


@dataclass
class Int4Weight:
    """An int4 weight as the CPU kernel takes it: `packed` uint8 [N, K / 2] in the kernel's layout (which
    follows this CPU's vector width: save `int4_codes(w)` rather than `packed`), `scales_and_zeros` bf16
    [K / group_size, N, 2] (the op's `qScaleAndZeros`), and the shape it stands for."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Resident bytes: what a step reads."""
        return self.packed.nbytes + self.scales_and_zeros.nbytes

    def scales_and_zeros_in(self, dtype: torch.dtype) -> torch.Tensor:
        """The op wants them in the activations' dtype; bf16 -> fp32 is exact."""
        sz = self.scales_and_zeros
        return sz if sz.dtype == dtype else sz.to(dtype)


def check_int4_shape(out_features: int, in_features: int, group_size: int, name: str = "weight") -> None:
    """Raise a ValueError naming the problem (and the layer) if the packed kernel cannot take this weight,
    before any op runs: the ops' own checks are RuntimeErrors from C++ that name neither, at the first step."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4: group size must be one of {GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        fitting = ", ".join(str(g) for g in GROUP_SIZES if in_features % g == 0) or "none of " + str(GROUP_SIZES)
        raise ValueError(f"int4: {name} has in_features {in_features}, not divisible by the group size "
                         f"{group_size} (group sizes that divide it: {fitting})")
    if out_features % PACK_N_MULTIPLE:
        raise ValueError(f"int4: {name} has out_features {out_features}; the packed CPU kernel takes "
                         f"multiples of {PACK_N_MULTIPLE}")


def _round_up(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smallest `dtype` number >= each (positive) fp32 value: a rounded-up step still spans the group."""
    rounded = value.to(dtype)
    bits = torch.finfo(dtype).bits
    next_up = (rounded.view(getattr(torch, f"int{bits}")) + 1).view(dtype)
    return torch.where(rounded.float() < value, next_up, rounded)


def _quantize_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int32 [N, K], scales_and_zeros bf16 [K / g, N, 2]): each group on `fit_grids`' grid, each weight
    on its nearest code."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    step, zero = fit_grids(w)
    codes = _nearest_codes(w, step, zero).to(torch.int32)
    scales_and_zeros = torch.stack((step[..., 0], zero[..., 0]), -1).transpose(0, 1).to(SCALE_DTYPE).contiguous()
    return codes.view(n, k), scales_and_zeros


def fit_grids(w: torch.Tensor, candidates: int = GRID_CANDIDATES) -> tuple[torch.Tensor, torch.Tensor]:
    """`_fit_grids` over `FIT_CHUNK_GROUPS` groups at a time (each group's grid is its own, so the result is
    the same bit for bit): its ~20 passes a candidate then stay in L2 instead of streaming a whole weight
    from memory each time."""
    flat = w.reshape(-1, w.shape[-1])
    if len(flat) <= FIT_CHUNK_GROUPS:
        return _fit_grids(w, candidates)
    step, zero = torch.empty(len(flat), 1), torch.empty(len(flat), 1)
    for first in range(0, len(flat), FIT_CHUNK_GROUPS):
        last = first + FIT_CHUNK_GROUPS
        step[first:last], zero[first:last] = _fit_grids(flat[first:last], candidates)
    return step.view(*w.shape[:-1], 1), zero.view(*w.shape[:-1], 1)


def _fit_grids(w: torch.Tensor, candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(step, zero) [..., 1] of each group w [..., g]: the grid of least squared error among the min-max grid
    and `candidates` others. A candidate's codes come from a step near the min-max one, (max - min) / (15 +
    d) for d in -1..1; a least-squares fit of w ~ (code - 8) * step + zero to them gives its step and zero
    (llama.cpp's make_qkx2 search). Both are rounded to bf16 as stored; the min-max grid is a candidate, so
    no group comes out worse than on it. Why: a weight that is already 4-bit on a grid whose codes do not
    reach both ends (a Q4_K file's, whose scales are fitted the same way) is found again, where the min-max
    grid moved every weight up to half a step (Gemma 3's Q4_K layers: 4.5% RMS error -> 0.2%); 5- to 8-bit
    weights lose ~13% less RMS error than on the min-max grid (8.1% -> 7.0%)."""
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    step, zero = _min_max_grid(low, high)
    best = _grid_error(w, _nearest_codes(w, step, zero), step, zero)
    span = (high - low).clamp_min(torch.finfo(SCALE_DTYPE).tiny)
    for i in range(candidates):
        inverse = (15 + 2 * i / max(1, candidates - 1) - 1) / span
        codes = ((w - low) * inverse).round_().clamp_(0, 15)
        fitted_step, fitted_zero = _least_squares_grid(w, codes, step)
        error = _grid_error(w, codes, fitted_step, fitted_zero)
        better = error < best
        best = torch.where(better, error, best)
        step, zero = torch.where(better, fitted_step, step), torch.where(better, fitted_zero, zero)
    return step, zero


def _min_max_grid(low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The zero (the value of code 8) rounded to bf16 first, then the smallest bf16 step that reaches both the
    group's min (8 steps below the zero) and its max (7 above): every weight within half a step of a code."""
    zero = (low + (high - low) * (8 / 15)).to(SCALE_DTYPE).float()
    step = torch.maximum((zero - low) / 8, (high - zero) / 7).clamp_min(torch.finfo(SCALE_DTYPE).tiny)
    return _round_up(step, SCALE_DTYPE).float(), zero


def _least_squares_grid(w: torch.Tensor, codes: torch.Tensor,
                        fallback_step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step and zero (rounded to bf16) minimizing sum (w - (codes - 8) * step - zero)^2 over a group; a
    group whose codes are all equal keeps `fallback_step`. (The candidates' codes are not re-rounded to the
    fitted grid: the nearest codes, which the layer gets, can only do better.)"""
    mean_codes, mean_w = codes.mean(-1, keepdim=True), w.mean(-1, keepdim=True)
    centered = codes - mean_codes
    variance = centered.pow(2).mean(-1, keepdim=True)
    covariance = (centered * w).mean(-1, keepdim=True)
    step = torch.where(variance > 0, covariance / variance.clamp_min(1e-30), fallback_step)
    step = step.clamp_min(torch.finfo(SCALE_DTYPE).tiny).to(SCALE_DTYPE).float()
    zero = (mean_w - (mean_codes - 8) * step).to(SCALE_DTYPE).float()
    return step, zero


def _nearest_codes(w: torch.Tensor, step: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return ((w - zero) / step).add_(8).round_().clamp_(0, 15)


def _grid_error(w: torch.Tensor, codes: torch.Tensor, step: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return ((codes - 8) * step + zero - w).pow(2).sum(-1, keepdim=True)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)


def _signed_nibbles(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) nibbles of uint8 bytes as int8 q - 8: flipping each nibble's top bit makes it a signed
    4-bit number, which arithmetic shifts sign-extend (four byte-wide passes instead of float ones)."""
    flipped = packed ^ 0x88
    return (flipped << 4).view(torch.int8) >> 4, flipped.view(torch.int8) >> 4


def _by_block(t: torch.Tensor, first: int, count: int, size: int) -> torch.Tensor:
    """Columns first .. first + count * size of a [rows, N] tensor as [count, rows, size] (a view)."""
    return t[:, first:first + count * size].unflatten(1, (count, size)).transpose(0, 1)


def _dequantize_packed(packed: torch.Tensor, scales_and_zeros: torch.Tensor, in_features: int,
                       layout: tuple[int, bool], dtype: torch.dtype) -> torch.Tensor:
    """W.T [K, N] in `dtype` from packed channels (whole blocks, then at most one tail block) and their
    scales and zeros [K / g, N, 2]: (q - 8) * scale + zero by one addcmul (fp32 inside, one rounding:
    exactly the kernel's values in fp32, their rounding in bf16). The packed layout is k-major within
    each block of channels, so writing W.T needs no transposing copy, and once the two nibbles are put
    back in channel order every operand is contiguous along a block's channels: the addcmul vectorizes."""
    block, halves = layout
    k, n = in_features, scales_and_zeros.shape[1]
    scale, zero = scales_and_zeros.to(dtype).permute(2, 0, 1).contiguous()  # [K / g, N] each
    out = torch.empty(k, n, dtype=dtype)
    flat, full = packed.reshape(-1), n - n % block
    for first, size, count in ((0, block, full // block), (full, n - full, 1)):
        if count * size == 0:
            continue
        target = _by_block(out, first, count, size).unflatten(1, (scale.shape[0], -1))  # [blocks, K / g, g, size]
        block_scale, block_zero = (_by_block(t, first, count, size)[:, :, None] for t in (scale, zero))
        nibbles = flat[first * k // 2:(first + count * size) * k // 2].view(count, scale.shape[0], -1, size // 2)
        pairs = not halves or size < block  # a tail block holds pairs of channels
        codes = torch.stack(_signed_nibbles(nibbles), -1 if pairs else -2).flatten(-2)  # channel order
        torch.addcmul(block_zero, codes, block_scale, out=target)
    return out


def _read_codes(packed: torch.Tensor, out_features: int, in_features: int, layout: tuple[int, bool]) -> torch.Tensor:
    """The codes [N, K] (int32, 0..15) of a packed weight: dequantized with scale 1 and zero 8."""
    identity = torch.tensor([1.0, 8.0]).expand(1, out_features, 2)
    return _dequantize_packed(packed, identity, in_features, layout, torch.float32).T.to(torch.int32)


@functools.cache
def packed_layout() -> tuple[int, bool]:
    """(block, halves) of `_convert_weight_to_int4pack_for_cpu` on this machine (it follows the CPU's
    vector width), found by packing a probe of random codes with full blocks and a tail, and reading it
    back."""
    probe = torch.randint(0, 16, (2 * 64 + PACK_N_MULTIPLE, 8), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(0))
    for layout in ((64, True), (32, True), (32, False)):
        if torch.equal(_read_codes(_pack(probe), *probe.shape, layout), probe):
            return layout
    raise RuntimeError("int4: unknown layout of aten._convert_weight_to_int4pack_for_cpu on this CPU")


def int4_codes(w: Int4Weight) -> torch.Tensor:
    """The codes [N, K] (int32, 0..15) of an Int4Weight: with `scales_and_zeros`, its portable form (what
    a checkpoint stores; `pack_int4` packs it again on the machine that loads it)."""
    return _read_codes(w.packed, w.out_features, w.in_features, packed_layout())


def pack_int4(codes: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> Int4Weight:
    """An Int4Weight from integer codes [N, K] in 0..15 and bf16 scales and zeros [K / g, N, 2] (this
    module's quantizer, or a checkpoint's: AWQ/GPTQ integer zero points become (8 - z) * scale)."""
    n, k = codes.shape
    check_int4_shape(n, k, group_size)
    return Int4Weight(_pack(codes), scales_and_zeros.to(SCALE_DTYPE).contiguous(), group_size, n, k)


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Weight:
    """Quantize a float Linear weight [N, K]; shapes the kernel cannot take are a ValueError up front."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"int4: expected a float weight [out, in], got {weight.dtype} {tuple(weight.shape)}")
    check_int4_shape(*weight.shape, group_size)
    return pack_int4(*_quantize_groups(weight, group_size), group_size)


def quantize_int4_codes(weight: torch.Tensor, group_size: int) -> "Int4Codes":
    """`quantize_int4`'s codes, scales and zeros before packing (the same grid), for `Int4Codes.linear` to
    pack for this CPU's kernel."""
    check_int4_shape(*weight.shape, group_size)
    return Int4Codes(*_quantize_groups(weight, group_size), group_size)


def _dequantize_channels(w: Int4Weight, first: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """W.T [K, count] for output channels first .. first + count (first a multiple of the packed block)."""
    k = w.in_features
    packed = w.packed.view(-1)[first * k // 2:(first + count) * k // 2]
    return _dequantize_packed(packed, w.scales_and_zeros[:, first:first + count], k, packed_layout(), dtype)


def dequantize_int4(w: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float matrix [N, K] an Int4Weight stands for (a transposed view of a [K, N] tensor): in fp32,
    exactly what the packed kernel computes with; in bf16, its rounding, which the dequantized path
    multiplies by."""
    return _dequantize_channels(w, 0, w.out_features, dtype).T


def fake_quantize_int4(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """The fp32 weight [N, K] after a round trip through int4 (the AWQ search scores `_round_trip`, the
    same values without packing)."""
    return dequantize_int4(quantize_int4(weight, group_size))


def int4_packed_mm(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x [M, K] @ W.T by aten's int4 kernel: one pass over the packed weight, dequantized in registers."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), w.packed, w.group_size,
                                                      w.scales_and_zeros_in(x.dtype))


def int4_dequant_mm(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x [M, K] @ W.T with W dequantized into x's dtype on each call, `DEQUANT_CHUNK` channels at a time,
    each slice multiplied (oneDNN, AMX in bf16) while it is still in cache: for many rows, where the
    matmul is compute-bound and the conversion is paid once for all of them. A whole LM head at once
    costs 3-4x more (the slice leaves the cache between the two)."""
    out = x.new_empty(x.shape[0], w.out_features)
    for first in range(0, w.out_features, DEQUANT_CHUNK):
        count = min(DEQUANT_CHUNK, w.out_features - first)
        torch.mm(x, _dequantize_channels(w, first, count, x.dtype), out=out[:, first:first + count])
    return out


def int4_linear(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x [..., K] @ W.T in x's dtype (bf16, fp16 or fp32), by the kernel measured fastest for its rows."""
    if x.shape[-1] != w.in_features or x.dtype not in DEQUANT_MIN_ROWS:
        raise ValueError(f"int4: expected x [..., {w.in_features}] in bf16, fp16 or fp32, "
                         f"got {x.dtype} {tuple(x.shape)}")
    rows = x.reshape(-1, w.in_features)
    kernel = int4_dequant_mm if rows.shape[0] >= DEQUANT_MIN_ROWS[x.dtype] else int4_packed_mm
    return kernel(rows, w).view(*x.shape[:-1], w.out_features)


def awq_search_scales(weight: torch.Tensor, activations: torch.Tensor, group_size: int,
                      grid: int = AWQ_GRID) -> torch.Tensor:
    """AWQ's activation-aware scales s [K] (fp32) for a Linear weight [N, K] and a sample of its inputs
    [..., K]: channels that carry large activations are scaled up before rounding, so their weights keep
    more precision. For alpha in 0, 1/grid, ... < 1: s = mean|x|^alpha, normalized to
    sqrt(max * min) = 1; the alpha whose quantized layer (x / s) @ Q(W * s).T is nearest to x @ W.T (mean
    squared error on the sample) wins. alpha = 0 is s = 1, plain rounding: the result is never worse on
    the sample. The error is scored on `AWQ_SEARCH_ROWS` evenly spaced output channels (each row rounds
    alone, so they estimate the whole: 4-24x less time on SmolLM2's layers). The caller quantizes W * s and
    folds 1 / s into what makes x (the RMSNorm weight before qkv or gate_up, or up_proj before down_proj);
    layers sharing an input take one search on their rows concatenated (SmolLM2's fused qkv and gate_up
    already are): layers/smoothing.py.

    Measured (2026-12-01, smoothing.py's proxy perplexity: windows of 512 not overlapping; without -> with
    AWQ): SmolLM2-135M (bf16 26.18) group 32 26.25 -> 26.25, unchanged: its Q4_1 GGUF is 4-bit in blocks
    of 32 already, plain rounding is near exact and alpha 0 wins every layer; group 64 34.45 -> 29.65.
    Gemma 3 270M (Q4_K_M; bf16 23.74) group 32 30.09 -> 27.69. `sobrio bench perplexity`, SmolLM2, group
    32: 22.6804 (-0.01% from bf16) with it, as without. (Those on min-max grids; with `fit_grids` and GPTQ
    after it, gptq.py has the figures.)"""
    check_int4_shape(*weight.shape, group_size)
    if activations.shape[-1] != weight.shape[1]:
        raise ValueError(f"awq: activations {tuple(activations.shape)} do not feed a weight {tuple(weight.shape)}")
    w, x = weight.detach().float(), activations.detach().reshape(-1, weight.shape[1]).float()
    w = w[::max(1, w.shape[0] // AWQ_SEARCH_ROWS)]  # each row rounds alone: a sample of them scores s as well
    mean_abs, reference = x.abs().mean(0), x @ w.T
    best_error, best = float("inf"), torch.ones_like(mean_abs)
    for step in range(grid):
        s = mean_abs.pow(step / grid).clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()
        error = (x @ (_round_trip(w * s, group_size) / s).T - reference).pow(2).mean().item()
        if error < best_error:
            best_error, best = error, s
    return best


def _round_trip(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """What `fake_quantize_int4` gives, in fp32, without packing and unpacking (the search's cost). The search
    scores the grids the layer gets: with fewer candidates here than there, Gemma 3 int4 22.28 -> 22.56."""
    n, k = weight.shape
    codes, scales_and_zeros = _quantize_groups(weight, group_size)
    scale, zero = scales_and_zeros.float().permute(2, 1, 0)[..., None]  # [N, K / g, 1] each
    return ((codes.view(n, k // group_size, group_size) - 8) * scale + zero).view(n, k)


def quantize_int4_zero_point(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes int32 [N, K], scales fp16 [K / g, N], zeros int32 [K / g, N]) with w ~ (q - z) * s: the integer
    zero points AWQ and GPTQ checkpoints store (sobrio's own quantizer above has a float zero). s = (max -
    min) / 15 rounded to fp16 first, z = round(-min / s) and q = round(w / s) + z, both clamped to 0..15."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = w.amin(-1), w.amax(-1)
    scale = ((high - low) / 15).clamp_min(ZERO_POINT_MIN_STEP).half()
    s = scale.float()
    zero = (-low / s).round().clamp(0, 15)
    codes = (w / s[..., None]).round_().add_(zero[..., None]).clamp_(0, 15).to(torch.int32)
    return codes.view(n, k), scale.T.contiguous(), zero.T.to(torch.int32).contiguous()


@dataclass
class Int4Codes:
    """A pre-quantized int4 weight as a checkpoint holds it, before packing: codes [N, K] in 0..15 (int32, or
    uint8 from a GGUF: a byte each while a large model's layers wait to be packed) and
    scales_and_zeros float [K / g, N, 2] with w = (code - 8) * scale + zero. One of the records
    `models.weights.load_weights` collects (the `PrequantizedWeight` protocol): kept portable until every
    shard of a fused layer is in, then packed once for this CPU's kernel by `linear`."""

    codes: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int
    _vnni: "vnni.VnniCodes | None" = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        assert self.scales_and_zeros.shape == (k // self.group_size, n, 2), (self.codes.shape,
                                                                               self.scales_and_zeros.shape)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @classmethod
    def from_zero_point(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        group_size: int) -> "Int4Codes":
        """From an integer zero point z (w = (q - z) * s, scales and zeros [K / g, N]): the value of code 8
        is (8 - z) * s. Kept in fp32, where both terms are exact for fp16 scales."""
        s = scales.float()
        return cls(codes.to(torch.int32).contiguous(), torch.stack((s, (8 - zeros.float()) * s), -1), group_size)

    @staticmethod
    def concat(parts: Sequence["Int4Codes"]) -> "Int4Codes":
        """The shards of a fused layer (q/k/v, gate/up) stacked along the output channels, in order."""
        first = parts[0]
        assert all(p.group_size == first.group_size and p.in_features == first.in_features for p in parts), \
            [(p.group_size, p.in_features) for p in parts]
        return Int4Codes(torch.cat([p.codes for p in parts]), torch.cat([p.scales_and_zeros for p in parts], 1),
                         first.group_size)

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix [N, K] these codes stand for (before the scales' rounding to bf16 for the kernel)."""
        sz = self.scales_and_zeros.float().repeat_interleave(self.group_size, 0)  # [K, N, 2]
        return ((self.codes.T.float() - 8) * sz[..., 0] + sz[..., 1]).T

    def linear(self, bias: torch.Tensor | None) -> torch.nn.Module:
        """The Linear that computes with these codes: int8 dot products where the CPU has VNNI (layers/vnni.py,
        2-3x aten's int4 kernel there at 1 to 32 rows), else packed for aten's int4 kernel, scales and zeros
        in bf16."""
        if vnni.usable(self.group_size):
            return self.vnni().linear(bias)
        return Int4Linear(pack_int4(self.codes, self.scales_and_zeros, self.group_size), bias)

    def vnni(self) -> vnni.VnniCodes:
        """The same weight for `vnni_linear`: w = scale * code + (zero - 8 * scale), in fp16; made once, so a
        tied embedding and LM head share it."""
        if self._vnni is None:
            scale, zero = self.scales_and_zeros.float().unbind(-1)  # [K / g, N] each
            self._vnni = vnni.VnniCodes.pack(self.codes, scale.T, (zero - 8 * scale).T, 4, self.group_size)
        return self._vnni

    def embedding(self, dtype: torch.dtype) -> torch.nn.Module:
        """A 4-bit token embedding (a GGUF's Q4_0 `token_embd`, as llama.cpp's quantizer writes it): with VNNI
        the lookup dequantizes only the rows it reads, from the codes the tied LM head computes with (one
        copy); elsewhere aten's int4 kernel cannot look rows up, so the embedding is kept dequantized."""
        if vnni.usable(self.group_size):
            return self.vnni().embedding(dtype)
        return torch.nn.Embedding.from_pretrained(self.dequantize().to(dtype), freeze=True)


class Int4Linear(torch.nn.Module):
    """A Linear whose weight is int4 (`--quantization int4`, or an AWQ/GPTQ checkpoint's): groups of inputs
    with a bf16 scale and zero each, packed in the layout of PyTorch's CPU kernel, no float copy. A step's
    few rows take that kernel (a quarter of bf16's bytes); many rows dequantize slices for bf16's."""

    def __init__(self, int4: Int4Weight, bias: torch.Tensor | None):
        super().__init__()
        self.int4 = int4
        self.register_buffer("packed", int4.packed)  # so resident_bytes and .to() see them
        self.register_buffer("scales_and_zeros", int4.scales_and_zeros)
        self.register_buffer("bias", None if bias is None else bias.detach())

    @classmethod
    def from_weight(cls, weight: Int4Weight, bias: torch.Tensor | None) -> "Int4Linear":
        """Over an already packed weight (`pack_int4`, `Int4Codes.linear`)."""
        return cls(weight, bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int) -> "Int4Linear":
        """Quantize a float weight (sobrio's float-zero quantizer); a shape the kernel cannot take is a
        ValueError naming the problem."""
        return cls(quantize_int4(weight.detach(), group_size), bias)

    @property
    def group_size(self) -> int:
        return self.int4.group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = int4_linear(x, self.int4)
        return out if self.bias is None else out + self.bias
