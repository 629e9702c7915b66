"""AWQ and GPTQ checkpoints: 4-bit Linear weights with an integer zero point per group, w = (q - z) * s,
read into `layers.int4.Int4Codes` (the value of code 8 is (8 - z) * s), so they run on the same packed CPU
kernel as `--quantization int4`. The layouts (as AutoAWQ, GPTQModel and vLLM's pack helpers write them),
for a Linear [N out, K in] with groups of g inputs, eight 4-bit values to an int32, value i at bits 4i..4i+3:

- AWQ (AutoAWQ's GEMM version): `qweight` int32 [K, N / 8] packed along N, nibble i holding column
  `AWQ_ORDER[i]` of its eight; `qzeros` int32 [K / g, N / 8] the same way; `scales` fp16 [K / g, N].
- GPTQ (v1): `qweight` int32 [K / 8, N] packed along K in order; `qzeros` int32 [K / g, N / 8] packed along
  N in order, storing z - 1 (`checkpoint_format: gptq_v2` stores z); `scales` fp16 [K / g, N]; `g_idx`
  int32 [K], the group of each input: k // g, unless act-order (`desc_act`) permuted it, which is refused.

Every other tensor (embedding, norms, LM head, biases) is a float tensor under its own name. `export_awq`
and `export_gptq` write such checkpoints from a float model folder with sobrio's integer-zero quantizer
(`layers.int4.quantize_int4_zero_point`): the same codes in both formats, so both load the same model.
"""

import json
import re
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from sobrio.errors import ConfigError
from sobrio.layers.int4 import GROUP_SIZES, Int4Codes, check_int4_shape, quantize_int4_zero_point
from sobrio.loader.hf import iter_safetensors_weights, safetensors_files, safetensors_names
from sobrio.models.weights import WeightItem

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble i holds column AWQ_ORDER[i] of eight
IN_ORDER = tuple(range(8))
PACK_FACTOR = 8  # 4-bit values per int32
METHODS = ("awq", "gptq")
QUANTIZED_PARTS = ("qweight", "qzeros", "scales", "g_idx")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")  # not copied
SKIPPED_FILES = ("config.json", ".index.json")  # written anew / naming shards that are not copied
LINEAR_WEIGHT = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")  # what the exporters quantize


@dataclass(frozen=True)
class AwqGptqConfig:
    """The parts of a checkpoint's `quantization_config` that decide how its tensors read (vLLM's AWQConfig
    and GPTQConfig keys)."""

    method: str  # "awq" or "gptq"
    group_size: int
    zeros_minus_one: bool  # GPTQ v1 stores z - 1


def read_quantization_config(folder: Path) -> dict | None:
    """The `quantization_config` of a model folder's config.json, or None for a float checkpoint."""
    path = folder / "config.json"
    return json.loads(path.read_text()).get("quantization_config") if path.is_file() else None


def parse_quantization_config(qc: dict, where: str) -> AwqGptqConfig:
    """Check what sobrio can load (4 bits, zero points, a kernel group size, GPTQ v1 or v2) and read it;
    anything else is a ConfigError naming the key."""
    method = qc.get("quant_method")
    if method not in METHODS:
        raise ConfigError(f"{where}: quantization_config.quant_method {method!r} is not supported (supported: "
                          f"{', '.join(METHODS)}, or a float checkpoint)", "--quantization")
    if problems := _unsupported(qc, method):
        raise ConfigError(f"{where}: {method} checkpoint with {', '.join(problems)} is not supported",
                          "--quantization")
    group_size = _first(qc, "group_size", "q_group_size")
    return AwqGptqConfig(method, group_size, method == "gptq" and qc.get("checkpoint_format", "gptq") == "gptq")


def _unsupported(qc: dict, method: str) -> list[str]:
    """The keys of a quantization_config sobrio cannot honour, each with what it can (AutoAWQ's and GPTQ's
    key names, as vLLM reads them)."""
    bits, group_size = _first(qc, "bits", "w_bit"), _first(qc, "group_size", "q_group_size")
    version, fmt = str(qc.get("version", "gemm")).lower(), qc.get("checkpoint_format", "gptq")
    checks = [(bits == 4, f"bits {bits} (only 4)"),
              (group_size in GROUP_SIZES, f"group_size {group_size} (int4: group size must be one of {GROUP_SIZES})")]
    if method == "awq":
        checks += [(qc.get("zero_point", True), "zero_point false (only zero points)"),
                   (version == "gemm", f"version {qc.get('version')!r} (only gemm)")]
    else:
        checks.append((fmt in ("gptq", "gptq_v2"), f"checkpoint_format {fmt!r} (only gptq, gptq_v2)"))
    return [problem for ok, problem in checks if not ok]


def _first(qc: dict, *keys: str):
    return next((qc[k] for k in keys if k in qc), None)


def check_quantization_flag(flag: str | None, qc: dict | None, is_gguf: bool, batch_invariant: bool,
                            where: str) -> None:
    """`--quantization` against what the checkpoint holds (vLLM's rule: a checkpoint's quantization_config
    applies with or without the flag; a flag naming another method is an error)."""
    if flag == "gguf" and not is_gguf:
        raise ConfigError(f"--quantization gguf needs a .gguf model; {where} is not one", "--quantization")
    if qc is None:
        if flag in METHODS:
            raise ConfigError(f"--quantization {flag}: {where} holds no {flag} weights (its config.json has no "
                              f"quantization_config)", "--quantization")
        return
    method = qc.get("quant_method")
    if flag is not None and flag != method:
        raise ConfigError(f"--quantization {flag} does not match {where}, whose quantization_config is "
                          f"{method}: leave the flag unset or give --quantization {method}", "--quantization")
    if batch_invariant:
        raise ConfigError(f"{where} holds {method} weights, whose int4 kernels change with the step's row "
                          f"count: it cannot be used with --batch-invariant", "--quantization")


def pack_nibbles(values: torch.Tensor, order: tuple[int, ...] = IN_ORDER) -> torch.Tensor:
    """int32 [R, C / 8] from 4-bit values [R, C]: nibble i of each int32 holds column order[i] of its eight.
    Nibble i is the low (even i) or high half of byte i // 2 of the little-endian int32, so the packing is
    byte-wide work and a view."""
    r, c = values.shape
    assert c % PACK_FACTOR == 0 and sys.byteorder == "little", (values.shape, sys.byteorder)
    assert values.min() >= 0 and values.max() <= 15, "4-bit values are 0..15"
    nibbles = values.to(torch.uint8).view(r, c // PACK_FACTOR, PACK_FACTOR)[..., list(order)]
    packed = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)  # [R, C / 8, 4] bytes
    return packed.contiguous().view(torch.int32).view(r, c // PACK_FACTOR)


def unpack_nibbles(packed: torch.Tensor, order: tuple[int, ...] = IN_ORDER) -> torch.Tensor:
    """The 4-bit values int32 [R, C] of `pack_nibbles(values, order)`."""
    r, c8 = packed.shape
    assert packed.dtype == torch.int32 and sys.byteorder == "little", (packed.dtype, sys.byteorder)
    by_byte = packed.contiguous().view(torch.uint8).view(r, c8, PACK_FACTOR // 2)
    nibbles = torch.stack((by_byte & 0xF, by_byte >> 4), -1).view(r, c8, PACK_FACTOR)  # nibble i at [..., i]
    column_at = [order.index(column) for column in range(PACK_FACTOR)]  # column c is nibble column_at[c]
    return nibbles[..., column_at].to(torch.int32).view(r, c8 * PACK_FACTOR)


def awq_codes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Codes:
    """An AWQ layer's Int4Codes: both packed along N in AWQ's order; codes come out [K, N], transposed."""
    codes = unpack_nibbles(qweight, AWQ_ORDER).T
    return Int4Codes.from_zero_point(codes, scales, unpack_nibbles(qzeros, AWQ_ORDER), group_size)


def gptq_codes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
               config: AwqGptqConfig, name: str) -> Int4Codes:
    """A GPTQ layer's Int4Codes: qweight packed along K (so unpacked as the rows of its transpose), zero
    points + 1 in v1. A g_idx other than k // g (act-order) is a ConfigError naming the layer."""
    codes = unpack_nibbles(qweight.T.contiguous())
    k = codes.shape[1]
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // config.group_size):
        raise ConfigError(f"gptq: {name} has a permuted g_idx (desc_act / act-order): sobrio's int4 kernel needs "
                          f"the inputs in groups of {config.group_size} in order; use a checkpoint quantized with "
                          f"desc_act false", "--quantization")
    zeros = unpack_nibbles(qzeros) + (1 if config.zeros_minus_one else 0)
    return Int4Codes.from_zero_point(codes, scales, zeros, config.group_size)


def layer_codes(parts: dict[str, torch.Tensor], config: AwqGptqConfig, name: str) -> Int4Codes:
    """One quantized layer's tensors (by suffix) as Int4Codes; a shape the kernel cannot take is a ConfigError
    naming the layer."""
    if missing := [p for p in ("qzeros", "scales") if p not in parts]:
        raise ConfigError(f"{config.method} checkpoint: {name} has a qweight but no {', '.join(missing)}",
                          "--quantization")
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    k = qweight.shape[0] * (PACK_FACTOR if config.method == "gptq" else 1)
    try:
        check_int4_shape(scales.shape[1], k, config.group_size, name)
    except ValueError as exc:
        raise ConfigError(f"{config.method} checkpoint: {exc}", "--quantization") from None
    if scales.shape[0] * config.group_size != k:
        raise ConfigError(f"{config.method} checkpoint: {name} has {scales.shape[0]} groups of scales for "
                          f"{k} inputs, not groups of {config.group_size} (quantization_config.group_size)",
                          "--quantization")
    if config.method == "awq":
        return awq_codes(qweight, qzeros, scales, config.group_size)
    return gptq_codes(qweight, qzeros, scales, parts.get("g_idx"), config, name)


def iter_awq_gptq_weights(folder: Path, config: AwqGptqConfig) -> Iterator[WeightItem]:
    """The checkpoint's tensors under Hugging Face names: each quantized layer once, as
    (`<layer>.weight`, Int4Codes), the rest as float tensors. Read with plain reads in file order, as float
    checkpoints are (loader/hf.py: nothing of the files stays mapped); a layer's parts, which may lie in
    different shards, are held until its last one is read."""
    names = {name for file in safetensors_files(folder) for name in safetensors_names(file)}
    quantized = {name.rpartition(".")[0] for name in names if name.endswith(".qweight")}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in iter_safetensors_weights(folder):
        prefix, _, part = name.rpartition(".")
        if part not in QUANTIZED_PARTS or prefix not in quantized:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if len(parts) == sum(f"{prefix}.{p}" in names for p in QUANTIZED_PARTS):
            yield f"{prefix}.weight", layer_codes(pending.pop(prefix), config, prefix)


def awq_tensors(prefix: str, weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """One Linear weight [N, K] in AutoAWQ's GEMM layout."""
    codes, scales, zeros = quantize_int4_zero_point(weight, group_size)
    return {f"{prefix}.qweight": pack_nibbles(codes.T.contiguous(), AWQ_ORDER),
            f"{prefix}.qzeros": pack_nibbles(zeros, AWQ_ORDER), f"{prefix}.scales": scales}


def gptq_tensors(prefix: str, weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """One Linear weight [N, K] in GPTQ's v1 layout (zero points stored minus one)."""
    codes, scales, zeros = quantize_int4_zero_point(weight, group_size)
    if (zeros == 0).any():  # v1 cannot store z = 0 (its z - 1 wraps to 15, read back as 16)
        raise ConfigError(f"gptq v1: {prefix} has a group of weights all >= 0 (zero point 0), which v1 cannot "
                          f"store; write it as awq", "--method")
    k = codes.shape[1]
    return {f"{prefix}.qweight": pack_nibbles(codes).T.contiguous(),
            f"{prefix}.qzeros": pack_nibbles(zeros - 1), f"{prefix}.scales": scales,
            f"{prefix}.g_idx": (torch.arange(k, dtype=torch.int32) // group_size)}


def awq_config(group_size: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}


def gptq_config(group_size: int) -> dict:
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": False,
            "checkpoint_format": "gptq"}


def export_awq(model_folder: Path, out_folder: Path, group_size: int = 128) -> None:
    """Write a float model folder as an AutoAWQ (GEMM) checkpoint, quantized by sobrio (no activation search)."""
    _export(Path(model_folder), Path(out_folder), awq_config(group_size), awq_tensors)


def export_gptq(model_folder: Path, out_folder: Path, group_size: int = 128) -> None:
    """Write a float model folder as a GPTQ (v1, desc_act false) checkpoint, quantized by sobrio (rounding to
    the nearest code; no GPTQ error feedback): the same codes as `export_awq`'s."""
    _export(Path(model_folder), Path(out_folder), gptq_config(group_size), gptq_tensors)


def _export(model_folder: Path, out_folder: Path, qc: dict, layer_tensors) -> None:
    """Every decoder Linear weight quantized by `layer_tensors`, every other tensor in fp16; config.json with
    the quantization_config; tokenizer and the other small files copied."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in iter_safetensors_weights(model_folder):
        if LINEAR_WEIGHT.match(name):
            try:
                check_int4_shape(*tensor.shape, qc["group_size"], name.removesuffix(".weight"))
            except ValueError as exc:
                raise ConfigError(f"{qc['quant_method']}: {exc}", "--group-size") from None
            tensors |= layer_tensors(name.removesuffix(".weight"), tensor, qc["group_size"])
        else:
            tensors[name] = tensor.half().contiguous() if tensor.is_floating_point() else tensor
    out_folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_folder / "model.safetensors"), metadata={"format": "pt"})
    for path in model_folder.iterdir():
        if path.is_file() and path.suffix not in WEIGHT_SUFFIXES and not path.name.endswith(SKIPPED_FILES):
            shutil.copy2(path, out_folder / path.name)  # tokenizer, chat template, generation config
    config = json.loads((model_folder / "config.json").read_text())
    config["quantization_config"] = qc
    config["torch_dtype"] = "float16"
    (out_folder / "config.json").write_text(json.dumps(config, indent=2))

