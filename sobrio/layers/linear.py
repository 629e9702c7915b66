"""Linear layers for the CPU: few-row bf16 matmuls (decode at small batch) take the C++ GEMV, larger ones
oneDNN with the weight pre-packed in its blocked layout.

aten's bf16 matmul on a CPU without AMX reads a 1-row activation against the weight well below memory
bandwidth; the GEMV streams each weight row once through AVX512-BF16 dot products. Past `GEMV_MAX_ROWS`
rows a blocked GEMM wins, and oneDNN's with a pre-packed weight beats aten's (which re-lays the weight out
on every call). Same results as aten: both are oneDNN underneath.

One copy of each weight: where oneDNN's packed copy has the blocked layout a C++ few-row kernel reads
(AVX512-BF16 without AMX: [N/64, K/2, 64, 2], `blocked_gemv_bf16`; AMX: [N/32, K/2, 32, 2], `amx_linear`;
checked against the weight itself at `prepack`), the few-row matmuls read that copy too and the plain weight
is dropped, so a bf16 model holds its weights once.
`Linear.weight` then unpacks a copy for the rare readers (adapters, tools); the model's matmuls never do. A
tied embedding reads its rows from the LM head's packed copy (`BlockedEmbedding`).

Neither is batch-invariant: a row's result depends on how many rows came with it (GEMV or GEMM, and
oneDNN's and MKL's blockings differ by M, in fp32 too). With `batch_invariant` every matmul takes the C++
`invariant_linear`, which computes each output element in one order for any M; for bf16 it is the GEMV
itself, so on a CPU without AMX batch-invariant decode at batch <= 4 costs nothing.

On Intel AMX, up to `AMX_MAX_ROWS` rows (the decode batches) take the C++ AMX kernel instead, on oneDNN's
packed copy (its tile layout there) prefetched ahead; past that, prompt chunks are compute-bound and oneDNN's
blocking wins. On a CPU with AVX2 and no AVX-512 (AMD Zen 2/3), where `--dtype auto` is float32,
MKL reads an uncached weight far below memory bandwidth at few rows, so up to `FP32_KERNEL_MAX_ROWS` rows
take the same C++ kernel in 8-lane form (unmeasured on AVX-512 CPUs, so float32 keeps aten there). The
measurements (`benchmarks/linear_kernels.py`) are in docs/benchmarks.md, "The CPU fast path".
"""

import ctypes
import functools

import numpy
import torch
import torch.nn.functional as F

from sobrio.layers.cpu_ops import (
    amx_available,
    avx2_without_avx512,
    blocked_gemv_available,
    cpu_ops,
    gemv_available,
    invariant_linear_available,
)

GEMV_MAX_ROWS = 4
BLOCKED_GEMV_MAX_ROWS = 4
BLOCK = 64  # outputs per block of oneDNN's packed bf16 layout on AVX512-BF16 without AMX
AMX_BLOCK = 32  # ... and on AMX
CHECKED_BLOCKS = 4  # blocks of a packed weight compared with the weight before the few-row kernel reads it
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
    """The AMX kernel's tile-layout copy of a bf16 weight (oneDNN's packed bytes on AMX), or None where AMX or
    the shape does not fit (the kernel takes whole blocks of 32 outputs by 32 inputs). Only where oneDNN's
    own copy is not that layout: `Linear.prepack` keeps one or the other."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or n % 32 or k % 32 or not amx_available():
        return None
    return cpu_ops().amx_pack_weight(weight.detach())


@functools.cache
def packed_block() -> int | None:
    """Outputs per block of oneDNN's packed bf16 layout that a few-row kernel here reads: 32 where the AMX
    kernel runs, 64 where `blocked_gemv_bf16` does (AVX512-BF16), None where neither is built."""
    if amx_available():
        return AMX_BLOCK
    return BLOCK if blocked_gemv_available() else None


def blocked_view(packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of `weight` as the bf16 tensor [N/B, K/2, B, 2] (B: `packed_block()`) that a
    few-row kernel reads (a view of its memory: valid while `packed` lives), or None where its bytes are not
    that layout (another CPU's blocking, padded shapes) or no such kernel is built. The bytes must be exactly
    the weight's (no padding), and `CHECKED_BLOCKS` blocks of B outputs, the first and the last among them, are compared
    element by element with the weight: a blocking is one pattern repeated over the whole matrix, so another
    one shows in any block, and comparing every element (a transposed read of the whole weight) took 1.5 s
    of a 1B model's start on a 2-core Zen 4."""
    n, k = weight.shape
    block = packed_block()
    inputs = 32 if block == AMX_BLOCK else 2  # an AMX tile takes 32 inputs, the GEMV a pair
    if block is None or n % block or k % inputs or torch.ops.mkldnn._nbytes(packed) != n * k * 2:
        return None
    blocks = _blocks_of(packed, n, k, block)
    # numpy on this thread: torch.equal's parallel regions woke the OpenMP threads ~500 times (2.5 s on a busy host)
    got = blocks.view(torch.int16).numpy()
    expected = weight.detach().contiguous().view(torch.int16).numpy().reshape(n // block, block, k // 2, 2)
    last = n // block - 1
    checked = sorted({round(i * last / max(CHECKED_BLOCKS - 1, 1)) for i in range(CHECKED_BLOCKS)})
    return blocks if all(numpy.array_equal(got[i].transpose(1, 0, 2), expected[i]) for i in checked) else None


def _blocks_of(packed: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """The memory of oneDNN's packed copy of an [n, k] bf16 weight, as a [n/block, k/2, block, 2] tensor."""
    memory = (ctypes.c_uint8 * (n * k * 2)).from_address(torch.ops.mkldnn.data_ptr(packed))
    return torch.frombuffer(memory, dtype=torch.bfloat16).view(n // block, k // 2, block, 2)


class BlockedPacker:
    """oneDNN's packed copies of a model's bf16 weights, and their blocked views where the few-row kernel
    reads them. A model has many weights of a few shapes: the first of each shape goes through oneDNN's
    reorder and its layout is checked (`blocked_view`); each later one starts as a copy of that packed tensor
    (its oneDNN descriptor, in fresh memory) which the C++ `pack_blocked_bf16` overwrites with its own
    weight, in the same layout (oneDNN's reorder transposes element by element: docs/memory.md has the
    times). Keep one packer for one model's load: it holds the first packed copy of each shape."""

    def __init__(self):
        self.templates: dict[torch.Size, torch.Tensor] = {}

    def pack(self, weight: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(`pack_weight(weight)`, its `blocked_view` or None)."""
        template = self.templates.get(weight.shape)
        if template is not None:
            packed = template.clone()
            blocks = _blocks_of(packed, *weight.shape, packed_block())
            cpu_ops().pack_blocked_bf16(weight.detach().contiguous(), blocks)
            return packed, blocks
        packed = pack_weight(weight)
        blocks = blocked_view(packed, weight) if packed is not None else None
        if blocks is not None:
            self.templates[weight.shape] = packed
        return packed, blocks


@functools.cache
def one_copy_layout() -> bool:
    """Whether a bf16 Linear here keeps oneDNN's packed copy alone (a few-row kernel reads its layout)."""
    weight = torch.randn(BLOCK, 2 * BLOCK, generator=torch.Generator().manual_seed(0)).bfloat16()
    packed = pack_weight(weight)
    return packed is not None and blocked_view(packed, weight) is not None


def unblocked(blocks: torch.Tensor) -> torch.Tensor:
    """The plain [N, K] weight of a blocked view [N/B, K/2, B, 2] (a copy)."""
    nb, pairs, block, _ = blocks.shape
    return blocks.transpose(1, 2).reshape(nb * block, pairs * 2)


def blocked_linear(x: torch.Tensor, packed: torch.Tensor, blocks: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias from oneDNN's packed copy alone: a C++ kernel on its blocked view for a few rows
    (the AMX kernel on AMX's blocks of 32, the GEMV on blocks of 64), oneDNN's GEMM past them. One C++ call
    (`csrc/blocked_gemv.cpp`), which the fused decode step makes too (models/fused_decode.py)."""
    return cpu_ops().blocked_linear(x, packed, blocks, bias, blocked_max_rows(blocks))


def blocked_max_rows(blocks: torch.Tensor) -> int:
    """The most rows the few-row kernel on this blocked view takes; oneDNN's GEMM takes more."""
    return AMX_MAX_ROWS if blocks.shape[2] == AMX_BLOCK else BLOCKED_GEMV_MAX_ROWS


class BlockedEmbedding(torch.nn.Module):
    """A tied embedding read from its LM head's packed copy (each token's row gathered from the blocked view),
    so the matrix is held once, in the layout the head's matmuls read. `weight` unpacks a copy (rare readers)."""

    def __init__(self, packed: torch.Tensor, blocks: torch.Tensor):
        super().__init__()
        self.packed, self.blocks, self.block = packed, blocks, blocks.shape[2]
        self.num_embeddings, self.embedding_dim = blocks.shape[0] * self.block, blocks.shape[1] * 2

    @property
    def weight(self) -> torch.Tensor:
        return unblocked(self.blocks)

    def plain(self) -> torch.nn.Embedding:
        """A plain embedding of the same rows (a copy)."""
        return torch.nn.Embedding(self.num_embeddings, self.embedding_dim, _weight=self.weight, _freeze=True)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        rows = self.blocks[ids // self.block, :, ids % self.block, :]  # [tokens, K/2, 2]
        return rows.reshape(*input_ids.shape, self.embedding_dim)


class Linear(torch.nn.Linear):
    packed: torch.Tensor | None = None  # set by `prepack()` once the weights are loaded and cast
    amx_packed: torch.Tensor | None = None
    blocks: torch.Tensor | None = None  # `packed` read by the C++ few-row kernel: then the weight's only copy
    batch_invariant = False
    packed_at_load = False  # packed by `models.pack_on_load` as the checkpoint was read: the next prepack skips

    def prepack(self, batch_invariant: bool = False, packer: BlockedPacker | None = None) -> None:
        """Choose the matmul once the weights are final: oneDNN's and AMX's packed copies, or the
        batch-invariant kernel (which reads the plain weight, so no packed copy is kept). Where the few-row
        kernel reads oneDNN's copy, the plain weight is dropped (one copy of each weight). `packer`: the
        model's, shared by its Linears (one of its own otherwise)."""
        if self.packed_at_load and not batch_invariant:
            self.packed_at_load = False
            return
        weight = self.weight  # a copy unpacked from the blocked view where an earlier prepack dropped it
        self.batch_invariant = batch_invariant
        self.packed = self.amx_packed = self.blocks = None
        if "weight" not in self._parameters:
            self.weight = torch.nn.Parameter(weight, requires_grad=False)
        if batch_invariant:
            return
        self.packed, self.blocks = (packer or BlockedPacker()).pack(weight)
        if self.blocks is None:  # the plain weight stays, and the AMX kernel's own copy where that runs
            self.amx_packed = amx_pack_weight(weight)
        else:
            del self.weight  # the Parameter goes; `weight` now unpacks a copy (`__getattr__`)

    def __getattr__(self, name: str):
        if name == "weight" and self.__dict__.get("blocks") is not None:
            return unblocked(self.__dict__["blocks"])
        return super().__getattr__(name)

    @classmethod
    def of(cls, module: torch.nn.Linear) -> "Linear":
        """A sobrio Linear on a torch Linear's own parameters (no copy)."""
        new = cls(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        new.weight, new.bias = module.weight, module.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            return blocked_linear(x, self.packed, self.blocks, self.bias)
        return linear(x, self.weight, self.bias, self.packed, self.batch_invariant, self.amx_packed)
