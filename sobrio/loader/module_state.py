"""A quantized module as tensors and JSON, and back: what the quantization cache (loader/quantization_cache.py)
writes for each module `--quantization` made, and reads to rebuild it without quantizing again.

A module is its class, its buffers and its plain attributes (numbers, strings, dtypes, tensors, and the
dataclasses that hold a packed weight: `VnniCodes`, `Int4Weight`, `GroupedCodes`, `Outliers`); a `ModuleList`
of such modules (a mixture of experts' quantized experts, layers/moe.py) is its items in order. Tensors are
kept exactly as the kernels read them (the packed layouts of this CPU), once each: a tensor two modules
share (the tied LM head reads the embedding's codes) is written once and comes back shared. Only the
classes listed in `MODULES` (and lists of them) are taken; anything else (oneDNN's opaque packed weight, a
module with children) is `Unsupported`, and the caller quantizes as before.
"""

import dataclasses
from typing import Any

import torch

from sobrio.layers.grouped import GroupedCodes, GroupedEmbedding, GroupedLinear
from sobrio.layers.int4 import Int4Linear, Int4Weight
from sobrio.layers.quantization import Outliers, QuantizedEmbedding, QuantizedLinear
from sobrio.layers.vnni import VnniCodes, VnniEmbedding, VnniLinear

MODULES = {cls.__name__: cls for cls in (VnniLinear, VnniEmbedding, Int4Linear, QuantizedLinear, QuantizedEmbedding,
                                         GroupedLinear, GroupedEmbedding)}
RECORDS = {cls.__name__: cls for cls in (VnniCodes, Int4Weight, GroupedCodes, Outliers)}
DTYPE_NAMES = {str(dtype): dtype for dtype in (torch.float32, torch.bfloat16, torch.float16)}


class Unsupported(Exception):
    """A module (or an attribute of one) this format does not hold."""


class TensorTable:
    """The tensors written so far, each once, by name (`t0`, `t1`, ...): the same tensor (same memory, shape
    and strides) met twice gets one name."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._names: dict[tuple, str] = {}

    def name_of(self, tensor: torch.Tensor) -> str:
        if tensor.layout != torch.strided or tensor.device.type != "cpu" or tensor.is_quantized:
            raise Unsupported(f"a {tensor.layout} tensor on {tensor.device}")
        identity = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if identity not in self._names:
            self._names[identity] = name = f"t{len(self.tensors)}"
            self.tensors[name] = tensor.contiguous()
        return self._names[identity]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def is_quantized_list(module: torch.nn.Module) -> bool:
    """A non-empty ModuleList of quantized modules only (`FusedExperts.quantize`'s experts)."""
    return (type(module) is torch.nn.ModuleList and len(module) > 0
            and all(MODULES.get(type(m).__name__) is type(m) for m in module))


def encode_module(module: torch.nn.Module, table: TensorTable) -> dict:
    """{"class", "buffers", "attributes"} of one quantized module ({"class": "ModuleList", "items"} of a list
    of them), its tensors added to `table`."""
    if is_quantized_list(module):
        return {"class": "ModuleList", "items": [encode_module(m, table) for m in module]}
    cls = type(module).__name__
    if MODULES.get(cls) is not type(module) or module._modules or module._parameters:
        raise Unsupported(f"{type(module).__qualname__} (children or parameters, or not a known quantized module)")
    attributes = {k: _encode(v, table) for k, v in vars(module).items() if not k.startswith("_") and k != "training"}
    return {"class": cls, "buffers": {k: _encode(v, table) for k, v in module._buffers.items()},
            "attributes": attributes}


def decode_module(state: dict, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The module `encode_module` described, over `tensors` (by name; shared ones stay shared). Built without
    its constructor, which would quantize or pack again: its state is set as the constructor left it."""
    if state["class"] == "ModuleList":
        return torch.nn.ModuleList(decode_module(item, tensors) for item in state["items"])
    cls = MODULES.get(state["class"])
    if cls is None:
        raise Unsupported(f"module class {state['class']!r}")
    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    for name, value in state["buffers"].items():
        module.register_buffer(name, _decode(value, tensors))
    for name, value in state["attributes"].items():
        setattr(module, name, _decode(value, tensors))
    return module


def _encode(value: Any, table: TensorTable) -> Any:
    if isinstance(value, torch.Tensor):
        return {"tensor": table.name_of(value)}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value)}
    if dataclasses.is_dataclass(value) and RECORDS.get(type(value).__name__) is type(value):
        return {"record": type(value).__name__,
                "fields": {f.name: _encode(getattr(value, f.name), table) for f in dataclasses.fields(value)}}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise Unsupported(f"an attribute of type {type(value).__qualname__}")


def _decode(value: dict, tensors: dict[str, torch.Tensor]) -> Any:
    if "tensor" in value:
        return tensors[value["tensor"]]
    if "dtype" in value:
        return DTYPE_NAMES[value["dtype"]]
    if "record" in value:
        return RECORDS[value["record"]](**{k: _decode(v, tensors) for k, v in value["fields"].items()})
    return value["value"]
