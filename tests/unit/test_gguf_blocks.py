"""GGUF blocks decoded into the kernels' codes stand for exactly the weights the `gguf` package's reference
dequantizers read from the same bytes, for every block type with a packed kernel."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, dequantize

from sobrio.layers.grouped import GroupedCodes
from sobrio.layers.int4 import Int4Codes, dequantize_int4, pack_int4
from sobrio.loader.gguf_blocks import PACKED_TYPES, decode_blocks

FP16_FIELDS = {  # byte offsets of each block's fp16 scales: random bytes there could be inf or NaN
    "Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(type_name: str, rows: int, in_features: int, seed: int = 0) -> np.ndarray:
    """Random block bytes (every code, sub-scale and high bit pattern), with finite fp16 scales."""
    block, size = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q5_0": (32, 22), "Q5_1": (32, 24),
                   "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * in_features // block, size), dtype=np.uint8)
    for offset in FP16_FIELDS[type_name]:
        scales = rng.uniform(-0.05, 0.05, raw.shape[0]).astype(np.float16)
        raw[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def dequantized(codes: Int4Codes | GroupedCodes) -> np.ndarray:
    if isinstance(codes, GroupedCodes):
        return codes.dequantize().numpy()
    n, k = codes.codes.shape
    g = codes.group_size
    scale, zero = codes.scales_and_zeros.float().permute(2, 1, 0)  # [N, K / g] each
    w = (codes.codes.float().view(n, k // g, g) - 8) * scale[..., None] + zero[..., None]
    return w.view(n, k).numpy()


@pytest.mark.parametrize("type_name", PACKED_TYPES)
def test_codes_stand_for_the_reference_weights(type_name: str) -> None:
    rows, k = 32, 512
    raw = random_blocks(type_name, rows, k)
    codes = decode_blocks(raw, type_name, k)
    assert codes is not None and (codes.out_features, codes.in_features) == (rows, k)
    reference = dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, k)
    np.testing.assert_allclose(dequantized(codes), reference, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_blocks_pack_for_the_kernel(type_name: str) -> None:
    """Through the int4 kernel's packing the weights are the file's, the scales rounded to bf16 only."""
    raw = random_blocks(type_name, 32, 256, seed=1)
    codes = decode_blocks(raw, type_name, 256)
    packed = pack_int4(codes.codes, codes.scales_and_zeros, codes.group_size)
    reference = dequantize(raw, GGMLQuantizationType[type_name]).reshape(32, 256)
    scale_step = codes.scales_and_zeros[..., 0].abs().max().item()
    assert np.abs(dequantize_int4(packed).numpy() - reference).max() <= 0.02 * 15 * scale_step


def test_types_without_a_packed_kernel_are_left_to_the_loader() -> None:
    assert decode_blocks(np.zeros((1, 84), np.uint8), "Q2_K", 256) is None


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_a_4_bit_token_embedding_looks_up_the_files_rows(type_name: str) -> None:
    """llama.cpp's quantizer writes `token_embd` in 4 bits too (a Q4_0 file of Llama-3.2-1B): its rows are the
    file's, the scales rounded to fp16 (VNNI) at most, and a tied LM head reads the same codes (one copy)."""
    import torch

    from sobrio.layers import vnni

    raw = random_blocks(type_name, 96, 256, seed=2)
    codes = decode_blocks(raw, type_name, 256)
    embedding = codes.embedding(torch.float32)
    ids = torch.tensor([[0, 95, 17], [17, 3, 64]])
    reference = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).reshape(96, 256))
    scale_step = codes.scales_and_zeros[..., 0].abs().max().item()
    torch.testing.assert_close(embedding(ids), reference[ids], rtol=0, atol=0.01 * 15 * scale_step)
    if vnni.usable(codes.group_size):
        assert codes.linear(None).weight_codes is embedding.weight_codes
