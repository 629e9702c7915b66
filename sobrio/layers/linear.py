"""Linear layers for the CPU: few-row bf16 matmuls (decode at small batch) take the C++ GEMV, larger ones
oneDNN with the weight pre-packed in its blocked layout.

aten's bf16 matmul on a CPU without AMX reads a 1-row activation against the weight at about a third of
memory bandwidth; the GEMV streams each weight row once through AVX512-BF16 dot products. Past
`GEMV_MAX_ROWS` rows a blocked GEMM wins, and oneDNN's with a pre-packed weight is 1.1-1.4x aten's
(which re-lays the weight out on every call). Same results as aten: both are oneDNN underneath.

Neither is batch-invariant: a row's result depends on how many rows came with it (GEMV or GEMM, and
oneDNN's and MKL's blockings differ by M, in fp32 too). With `batch_invariant` every matmul takes the C++
`invariant_linear`, which computes each output element in one order for any M; for bf16 it is the GEMV
itself, so on a CPU without AMX batch-invariant decode at batch <= 4 costs nothing.

On Intel AMX, up to `AMX_MAX_ROWS` rows (the decode batches) take the C++ AMX kernel instead, on a copy of
the weight packed in its tile layout and prefetched ahead: a step's matmuls then stream the weights
1.2x as fast as oneDNN's and the GEMV's at 1 to 64 rows (`benchmarks/linear_kernels.py --threads 1`),
and a batch-32 decode step of SmolLM2-135M spends 15-20% less CPU time. Past that, prompt chunks are
compute-bound and oneDNN's blocking wins. Its results equal aten's to rounding.

On a CPU with AVX2 and no AVX-512 (AMD Zen 2/3), where `--dtype auto` is float32, MKL's float32 matmul reads
a weight that is not in cache at 13 GB/s for one row and 6 GB/s for 2 to 16, of 38 GB/s the machine reads.
There up to `FP32_KERNEL_MAX_ROWS` rows take the same C++ kernel in 8-lane form: 2x for one row, 3-4.6x
for 2 to 8 (which is what speculative decoding verifies), 1.2-1.9x up to 48, where MKL's blocking catches up
(`benchmarks/linear_kernels.py --dtype float32`). Unmeasured on AVX-512 CPUs, so float32 keeps aten there.
"""

import functools

import torch
import torch.nn.functional as F

from sobrio.layers.cpu_ops import (
    amx_available,
    avx2_without_avx512,
    cpu_ops,
    gemv_available,
    invariant_linear_available,
)

GEMV_MAX_ROWS = 4
AMX_MAX_ROWS = 64
FP32_KERNEL_MAX_ROWS = 48


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, batch_invariant: bool = False,
           amx_packed: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias; `packed` is `pack_weight(weight)` or None, `amx_packed` `amx_pack_weight(weight)`
    or None; `batch_invariant`: the kernel whose rows do not depend on each other, whatever the row count."""
    if batch_invariant:
        return invariant_linear(x, weight, bias)
    if x.dtype == torch.bfloat16 and x.dim() == 2:
        if amx_packed is not None and x.shape[0] <= AMX_MAX_ROWS:
            return cpu_ops().amx_linear(x, amx_packed, weight.shape[0], bias)
        if x.shape[0] <= GEMV_MAX_ROWS and gemv_available():
            return cpu_ops().gemv_bf16(x, weight, bias)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    elif x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= FP32_KERNEL_MAX_ROWS and fp32_kernel_wins():
        return cpu_ops().invariant_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, each row's result the same whatever rows come with it."""
    assert x.dim() == 2 and invariant_linear_available(), "batch-invariant matmul: 2-D input, C++ operators"
    return cpu_ops().invariant_linear(x, weight, bias)


@functools.cache
def fp32_kernel_wins() -> bool:
    """Whether few-row float32 matmuls take the C++ kernel: built, and the CPU is AVX2 without AVX-512."""
    return avx2_without_avx512() and invariant_linear_available()


@functools.cache
def onednn_bf16_available() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a bf16 weight, or None where oneDNN or bf16 is not in use, or where its bf16
    kernels need what the CPU lacks (AVX512-BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only AMD EPYC Zen 3 raised
    at load); there F.linear takes the plain weight."""
    if weight.dtype != torch.bfloat16 or not onednn_bf16_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)


def amx_pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The AMX kernel's tile-layout copy of a bf16 weight, or None where AMX or the shape does not fit
    (the kernel takes whole blocks of 32 outputs by 32 inputs)."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or n % 32 or k % 32 or not amx_available():
        return None
    return cpu_ops().amx_pack_weight(weight.detach())


class Linear(torch.nn.Linear):
    packed: torch.Tensor | None = None  # set by `prepack()` once the weights are loaded and cast
    amx_packed: torch.Tensor | None = None
    batch_invariant = False

    def prepack(self, batch_invariant: bool = False) -> None:
        """Choose the matmul once the weights are final: oneDNN's and AMX's packed copies, or the
        batch-invariant kernel (which reads the plain weight, so no packed copy is kept)."""
        self.batch_invariant = batch_invariant
        self.packed = None if batch_invariant else pack_weight(self.weight)
        self.amx_packed = None if batch_invariant else amx_pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed, self.batch_invariant, self.amx_packed)
