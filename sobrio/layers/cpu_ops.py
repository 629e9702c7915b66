"""The fused C++ operators (sobrio/csrc/cpu_ops.cpp), or None where they did not build.

Every caller keeps its PyTorch expression as the reference and fallback; `SOBRIO_DISABLE_CPP=1` forces
the fallback everywhere.
"""

import functools

import torch


@functools.cache
def cpu_ops():
    from sobrio.csrc import load

    return load()


def avx2_without_avx512() -> bool:
    """An AVX2 CPU without AVX-512 (AMD Zen 2/3): there the 8-lane forms of the C++ kernels beat PyTorch's
    float32 and int8 weight matmuls for few rows, and the callers route those to them."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2"


@functools.cache
def gemv_available() -> bool:
    ops = cpu_ops()
    return ops is not None and ops.gemv_supported()


@functools.cache
def blocked_gemv_available() -> bool:
    """Whether the few-row bf16 matmul on oneDNN's packed weight was built (AVX512-BF16)."""
    ops = cpu_ops()
    return ops is not None and ops.blocked_gemv_supported()


@functools.cache
def grouped_linear_available() -> bool:
    """Whether the group-wise int8 matmul was built (it needs AVX-512, or AVX2 with FMA)."""
    ops = cpu_ops()
    return ops is not None and ops.grouped_linear_supported()


@functools.cache
def vnni_linear_available() -> bool:
    """Whether the int8-dot-product matmul on 4- and 8-bit group-wise codes was built (AVX512-VNNI)."""
    ops = cpu_ops()
    return ops is not None and ops.vnni_linear_supported()


@functools.cache
def invariant_linear_available() -> bool:
    """Whether the batch-invariant matmul was built (it needs AVX-512)."""
    ops = cpu_ops()
    return ops is not None and ops.invariant_linear_supported()


@functools.cache
def amx_available() -> bool:
    """Whether the AMX matmul was built (Intel AMX-BF16) and the kernel grants this process the tiles."""
    ops = cpu_ops()
    return ops is not None and ops.amx_supported()


@functools.cache
def amx_int8_available() -> bool:
    """Whether the W8A8 matmul on AMX-INT8 tiles was built and the kernel grants this process the tiles."""
    ops = cpu_ops()
    return ops is not None and ops.amx_int8_supported()
