"""AWQ and GPTQ checkpoints (`sobrio/loader/awq_gptq.py`): the int32 packings round-trip in both formats (AWQ's
nibble order checked on a hand-computed word), a layer read back from either format dequantizes exactly to
the exporter's integer-zero weights (w = (q - z) * s), the Int4Codes of fused shards compute what their
dequantized matrix does, and what sobrio cannot load is a ConfigError naming the problem and the layer."""

import json

import pytest
import torch
from safetensors.torch import save_file

from sobrio.errors import ConfigError
from sobrio.layers.int4 import Int4Codes, Int4Linear, quantize_int4_zero_point
from sobrio.layers.vnni import VnniLinear
from sobrio.loader.awq_gptq import (
    AWQ_ORDER,
    awq_config,
    awq_tensors,
    check_quantization_flag,
    gptq_config,
    gptq_tensors,
    iter_awq_gptq_weights,
    pack_nibbles,
    parse_quantization_config,
    unpack_nibbles,
)

FORMATS = {"awq": (awq_config, awq_tensors), "gptq": (gptq_config, gptq_tensors)}


def weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Rows of different magnitudes and offsets (asymmetric groups), never a group of one sign only."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * (torch.rand(n, 1, generator=gen) * 0.1 + 0.01)


def integer_weights(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """The exporter's quantized weights in fp32, (q - z) * s, straight from its quantizer."""
    codes, scales, zeros = quantize_int4_zero_point(w, group_size)
    step = scales.float().repeat_interleave(group_size, 0).T
    return (codes - zeros.repeat_interleave(group_size, 0).T) * step


def write_checkpoint(folder, method: str, tensors: dict[str, torch.Tensor], group_size: int):
    folder.mkdir(exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"quantization_config": FORMATS[method][0](group_size)}))
    return parse_quantization_config(FORMATS[method][0](group_size), str(folder))


def test_awq_packs_eight_columns_in_its_interleaved_order():
    """Columns 0..7 holding the values 0..7: AWQ puts column [0, 2, 4, 6, 1, 3, 5, 7][i] in nibble i (bits
    4i..4i+3), so the word reads 0x75316420; in order (GPTQ) 0x76543210. A 15 in the top nibble is the sign."""
    values = torch.arange(8, dtype=torch.int32)[None]
    assert pack_nibbles(values, AWQ_ORDER).item() == 0x75316420
    assert pack_nibbles(values).item() == 0x76543210
    assert pack_nibbles(torch.tensor([[0, 0, 0, 0, 0, 0, 0, 15]]), AWQ_ORDER).item() == 0xF0000000 - (1 << 32)
    assert torch.equal(unpack_nibbles(torch.tensor([[0x75316420]], dtype=torch.int32), AWQ_ORDER), values)


@pytest.mark.parametrize("order", [AWQ_ORDER, tuple(range(8))])
def test_random_codes_round_trip(order):
    codes = torch.randint(0, 16, (48, 96), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    packed = pack_nibbles(codes, order)
    assert packed.shape == (48, 12) and packed.dtype == torch.int32 and (packed < 0).any()
    assert torch.equal(unpack_nibbles(packed, order), codes)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_a_checkpoint_layer_reads_back_exactly_the_exported_weights(tmp_path, method, group_size):
    """Both formats, through the loader's iterator: one record per quantized layer (under `.weight`),
    floats as they are, and the record's dequantized weight equal to (q - z) * s bit for bit."""
    w, norm = weight(80, 256, group_size), torch.rand(256)
    tensors = FORMATS[method][1]("model.layers.0.mlp.down_proj", w, group_size) | {"model.norm.weight": norm}
    config = write_checkpoint(tmp_path, method, tensors, group_size)
    items = dict(iter_awq_gptq_weights(tmp_path, config))
    assert set(items) == {"model.layers.0.mlp.down_proj.weight", "model.norm.weight"}
    record = items["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(record, Int4Codes) and (record.out_features, record.in_features) == (80, 256)
    assert torch.equal(record.dequantize(), integer_weights(w, group_size))
    assert torch.equal(items["model.norm.weight"], norm)


def test_awq_and_gptq_hold_the_same_codes():
    w = weight(64, 128, 0)
    awq = FORMATS["awq"][1]("l", w, 32)
    gptq = FORMATS["gptq"][1]("l", w, 32)
    assert torch.equal(unpack_nibbles(awq["l.qweight"], AWQ_ORDER).T, unpack_nibbles(gptq["l.qweight"].T.contiguous()))
    assert torch.equal(unpack_nibbles(awq["l.qzeros"], AWQ_ORDER), unpack_nibbles(gptq["l.qzeros"]) + 1)  # v1: z - 1


def test_fused_shards_compute_their_concatenated_weight():
    """q/k/v as one Int4Linear: concat along the output channels, packed once; the bias added."""
    shards = [Int4Codes.from_zero_point(*quantize_int4_zero_point(weight(n, 128, n), 64), 64) for n in (64, 32, 32)]
    fused = Int4Codes.concat(shards)
    assert (fused.out_features, fused.in_features) == (128, 128)
    assert torch.equal(fused.dequantize(), torch.cat([s.dequantize() for s in shards]))
    bias = torch.randn(128)
    layer = fused.linear(bias)
    assert isinstance(layer, (Int4Linear, VnniLinear)) and torch.equal(layer.bias, bias)
    x = torch.randn(5, 128)
    expected = x @ fused.dequantize().T + bias  # scales and zeros in bf16 (or fp16, x in int8): close, not equal
    assert ((layer(x) - expected).norm() / expected.norm()).item() < 2e-2
    rows = fused.embedding(torch.float32)(torch.tensor([0, 127, 64]))  # a 4-bit embedding looks its rows up
    torch.testing.assert_close(rows, fused.dequantize()[[0, 127, 64]], rtol=0, atol=2e-2)


@pytest.mark.parametrize("change, message", [
    ({"bits": 8}, "gptq checkpoint with bits 8 (only 4) is not supported"),
    ({"group_size": 16}, "group_size 16 (int4: group size must be one of (32, 64, 128))"),
    ({"group_size": -1}, "group_size -1"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "fp8"}, "quant_method 'fp8' is not supported"),
])
def test_unsupported_quantization_configs_name_the_key(change, message):
    with pytest.raises(ConfigError) as exc:
        parse_quantization_config(gptq_config(64) | change, "m")
    assert message in str(exc.value) and exc.value.option == "--quantization"
    with pytest.raises(ConfigError, match="version 'gemv'"):
        parse_quantization_config(awq_config(64) | {"version": "gemv"}, "m")


def test_gptq_act_order_is_refused_naming_the_layer(tmp_path):
    tensors = gptq_tensors("model.layers.3.self_attn.o_proj", weight(64, 128, 3), 32)
    tensors["model.layers.3.self_attn.o_proj.g_idx"] = tensors["model.layers.3.self_attn.o_proj.g_idx"].flip(0)
    config = write_checkpoint(tmp_path, "gptq", tensors, 32)
    with pytest.raises(ConfigError, match=r"model.layers.3.self_attn.o_proj has a permuted g_idx \(desc_act"):
        list(iter_awq_gptq_weights(tmp_path, config))


def test_a_shape_the_kernel_cannot_take_names_the_layer(tmp_path):
    config = write_checkpoint(tmp_path, "awq", awq_tensors("model.layers.0.mlp.down_proj", weight(40, 64, 0), 32), 32)
    with pytest.raises(ConfigError, match="int4: model.layers.0.mlp.down_proj has out_features 40"):
        list(iter_awq_gptq_weights(tmp_path, config))


@pytest.mark.parametrize("flag, qc, is_gguf, message", [
    ("gptq", awq_config(64), False, "--quantization gptq does not match m, whose quantization_config is awq"),
    ("int4", awq_config(64), False, "--quantization int4 does not match m, whose quantization_config is awq"),
    ("awq", None, False, "--quantization awq: m holds no awq weights"),
    ("gguf", None, False, "--quantization gguf needs a .gguf model"),
    ("awq", None, True, "--quantization awq: m holds no awq weights"),
])
def test_the_flag_must_agree_with_the_checkpoint(flag, qc, is_gguf, message):
    with pytest.raises(ConfigError) as exc:
        check_quantization_flag(flag, qc, is_gguf, False, "m")
    assert message in str(exc.value)
    for ok in (None, "awq"):
        check_quantization_flag(ok, awq_config(64), False, False, "m")
    check_quantization_flag("gguf", None, True, False, "m")
