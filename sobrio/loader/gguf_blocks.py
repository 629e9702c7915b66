"""A GGUF tensor's quantized blocks as the kernels take them (`--quantization gguf`), never widened to float.

Each block type is a group-wise code with a scale and a minimum (or a fixed code offset); the decoders
below read the codes, scales and minimums out of the blocks' bytes (the layouts of ggml-quants.c, as the
`gguf` package's reference dequantizers read them) and hand them over in one of two forms:

- 4-bit (Q4_0, Q4_1, Q4_K; groups of 32): `Int4Codes` for PyTorch's int4 CPU kernel, whose weight is
  (code - 8) * scale + zero per group: Q4_0's w = d * (q - 8) is zero 0; Q4_1's w = d * q + m is zero
  m + 8 d; Q4_K's sub-block w = d sc q - dmin m is zero 8 d sc - dmin m. The kernel takes its scales and
  zeros in the activations' dtype (bf16): the file's fp16 scales lose 3 bits of mantissa there.
- 5-, 6- and 8-bit (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0): `GroupedCodes`, int8 codes with float32 scales and
  offsets (exact: fp16 and fp16 products fit float32).

Where the CPU has AVX512-VNNI both forms are repacked once more, at `.linear()`, for layers/vnni.py's int8
dot products (scales and offsets in fp16: the files' own d and m exactly, the K-quants' products d * sc to
2^-11).

Other types (Q2_K, Q3_K, IQ*, ...) have no packed kernel here: `decode_blocks` returns None and the loader
dequantizes them.
"""

from collections.abc import Callable

import numpy as np
import torch

from sobrio.layers.grouped import GroupedCodes
from sobrio.layers.int4 import Int4Codes

QK_K = 256  # elements in a K-quant super-block


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 bytes [..., 2] as float32 [...]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, half: int) -> np.ndarray:
    """Bytes [..., half] -> codes [..., 2 * half]: the low nibbles first, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Q5's fifth bits: 4 bytes (a little-endian uint32) -> [..., 32] bits, bit i for element i."""
    bits = np.ascontiguousarray(qh).view(np.uint32)[..., 0:1] >> np.arange(count, dtype=np.uint32)
    return (bits & 1).astype(np.uint8)


def _int4(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, rows: int) -> Int4Codes:
    """codes [rows * groups, 32]; scale, zero [rows * groups] -> Int4Codes (scales_and_zeros [K/32, N, 2])."""
    sz = np.stack([scale, zero], -1).reshape(rows, -1, 2).transpose(1, 0, 2)
    # uint8: a byte a code until the layer is packed (int32 held a Llama-3.1-8B's ~8e9 codes in 32 GB: out of memory)
    return Int4Codes(torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, -1), dtype=np.uint8)),
                     torch.from_numpy(np.ascontiguousarray(sz)), 32)


def _int8(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, rows: int, group: int) -> GroupedCodes:
    """codes [rows * groups, group] in -128..127; scale, offset [rows * groups] -> GroupedCodes."""
    to_rows = lambda a: torch.from_numpy(np.ascontiguousarray(a.reshape(rows, -1), dtype=np.float32))  # noqa: E731
    return GroupedCodes(torch.from_numpy(codes.reshape(rows, -1).astype(np.int8)), to_rows(scale),
                            None if offset is None else to_rows(offset), group)


def _q4_0(b: np.ndarray, rows: int) -> Int4Codes:
    d = _f16(b[:, 0:2])
    return _int4(_nibbles(b[:, 2:18], 16), d, np.zeros_like(d), rows)


def _q4_1(b: np.ndarray, rows: int) -> Int4Codes:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return _int4(_nibbles(b[:, 4:20], 16), d, m + 8 * d, rows)


def _q8_0(b: np.ndarray, rows: int) -> GroupedCodes:
    return _int8(b[:, 2:34].view(np.int8), _f16(b[:, 0:2]), None, rows, 32)


def _q5_0(b: np.ndarray, rows: int) -> GroupedCodes:
    q = _nibbles(b[:, 6:22], 16) | (_high_bits(b[:, 2:6], 32) << 4)
    return _int8(q.astype(np.int16) - 16, _f16(b[:, 0:2]), None, rows, 32)


def _q5_1(b: np.ndarray, rows: int) -> GroupedCodes:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 8:24], 16) | (_high_bits(b[:, 4:8], 32) << 4)
    return _int8(q.astype(np.int16) - 16, d, m + 16 * d, rows, 32)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit sub-block scales and eight 6-bit minimums."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_sub_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d * sc, dmin * m) of each 32-element sub-block of a Q4_K/Q5_K super-block: [blocks, 8] each."""
    sc, mn = _k_scale_min(b[:, 4:16])
    return _f16(b[:, 0:2])[:, None] * sc, _f16(b[:, 2:4])[:, None] * mn


def _q4_k(b: np.ndarray, rows: int) -> Int4Codes:
    scale, minimum = _k_sub_scales(b)
    qs = b[:, 16:144].reshape(-1, 4, 32)  # 32 bytes hold sub-blocks 2j (low nibbles) and 2j + 1 (high)
    codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 32)
    return _int4(codes, scale.reshape(-1), (8 * scale - minimum).reshape(-1), rows)


def _q5_k(b: np.ndarray, rows: int) -> GroupedCodes:
    scale, minimum = _k_sub_scales(b)
    qs, qh = b[:, 48:176].reshape(-1, 4, 32), b[:, 16:48]
    low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = (low | (high << 4)).astype(np.int16) - 16
    return _int8(q.reshape(-1, 32), scale.reshape(-1), (16 * scale - minimum).reshape(-1), rows, 32)


def _q6_k(b: np.ndarray, rows: int) -> GroupedCodes:
    ql, qh, scales = b[:, 0:128], b[:, 128:192], b[:, 192:208].view(np.int8).astype(np.float32)
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8)[None, None, :, None]) & 0x0F
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 0x03
    q = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)).astype(np.int16) - 32
    scale = _f16(b[:, 208:210])[:, None] * scales  # [blocks, 16]: one per 16 elements
    return _int8(q.reshape(-1, 16), scale.reshape(-1), None, rows, 16)


_DECODERS: dict[str, tuple[int, int, Callable]] = {  # type name -> (elements, bytes per block, decoder)
    "Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1), "Q8_0": (32, 34, _q8_0), "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1), "Q4_K": (QK_K, 144, _q4_k), "Q5_K": (QK_K, 176, _q5_k), "Q6_K": (QK_K, 210, _q6_k),
}
PACKED_TYPES = tuple(_DECODERS)


def decode_blocks(raw: np.ndarray, type_name: str, in_features: int) -> Int4Codes | GroupedCodes | None:
    """A 2-D tensor's blocks (uint8 [N, bytes per row], rows in output-channel order) as packed codes, or
    None for a type without a packed kernel."""
    if type_name not in _DECODERS:
        return None
    elements, size, decoder = _DECODERS[type_name]
    rows = raw.shape[0]
    assert in_features % elements == 0 and raw.shape[1] == in_features // elements * size, (raw.shape, type_name)
    return decoder(np.ascontiguousarray(raw).reshape(-1, size), rows)
