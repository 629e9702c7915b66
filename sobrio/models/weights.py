"""Load Hugging Face-named tensors into sobrio modules, packing q/k/v and gate/up into one matrix each.

A checkpoint may also hold Linear weights already quantized (AWQ, GPTQ, GGUF blocks): its iterator yields
those as records (`PrequantizedWeight`) under the weight's name instead of a float tensor. `load_weights`
collects them by module, a fused module's shards in order, and `models.registry.build_model` puts in each
module's quantized form (`concat(shards).linear(bias)`) once the float parameters are cast.
"""

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from sobrio.layers.linear import Linear

if TYPE_CHECKING:
    from sobrio.models.pack_on_load import PackOnLoad

# HF sub-module name -> (packed module name, shard index)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

# A routed expert's matrix (Mixtral's w1/w3/w2, Qwen's gate/up/down_proj) -> (stacked parameter, shard)
_EXPERT_NAME = re.compile(r"(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_EXPERT_SHARDS = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
                  "up_proj": ("gate_up_proj", 1), "w2": ("down_proj", None), "down_proj": ("down_proj", None)}


class PrequantizedWeight(Protocol):
    """A Linear (or embedding) weight [out_features, in_features] that a checkpoint holds quantized: what a
    weights iterator may yield in place of a float tensor (`layers.int4.Int4Codes` is one). Records of one
    fused module are joined by `concat` (along the output channels, in shard order) before `linear` builds
    the module that computes with them. An embedding record also has `embedding(dtype) -> torch.nn.Module`
    (a lookup of rows); one that cannot be an embedding raises NotImplementedError there."""

    @property
    def out_features(self) -> int: ...

    @property
    def in_features(self) -> int: ...

    @staticmethod
    def concat(parts: Sequence["PrequantizedWeight"]) -> "PrequantizedWeight": ...

    def linear(self, bias: torch.Tensor | None) -> torch.nn.Module: ...


@runtime_checkable
class DeferredTensor(Protocol):
    """A float tensor not read yet (`loader.hf.StoredTensor`): `load_weights` reads it straight into its
    parameter where the parameter (or its shard's rows) has its dtype and shape, so it is written once."""

    dtype: torch.dtype
    shape: torch.Size

    def read(self) -> torch.Tensor: ...

    def read_into(self, dest: torch.Tensor) -> None: ...


WeightItem = tuple[str, torch.Tensor | DeferredTensor | PrequantizedWeight]
EXPERT_RECORD = "#"  # `experts#3.gate_up_proj`: a routed expert's records in `load_weights`' result
Prequantized = dict[str, list[PrequantizedWeight]]  # module name -> its records, a fused module's in shard order


def load_weights(model: torch.nn.Module, weights: Iterable[WeightItem],
                 pack_on_load: "PackOnLoad | None" = None, only: Callable[[str], bool] | None = None,
                 install: Callable[[str, list[PrequantizedWeight]], None] | None = None) -> Prequantized:
    """Copy every float tensor into its parameter and collect the pre-quantized records (a recorded weight
    counts as filled; its float parameter stays as built until the module is replaced); assert that every
    parameter was filled. Returns the records by module name (`model.layers.0.self_attn.qkv_proj`,
    `model.embed_tokens`, `lm_head`). `pack_on_load`: each Linear packed as soon as its weight is in
    (`models.pack_on_load`). `only`: the parameters (by name) this call fills; the checkpoint's other
    tensors are skipped unread (a streamed load reads a decoder layer at a time). `install(module, records)`:
    each module's records handed over as soon as all its shards are read (and not returned), so that a GGUF's
    decoded blocks become their modules one by one instead of all being held first (4.5 GB at the peak of
    two layers of Qwen3-30B-A3B's widths in Q4_0, a 1 GB file)."""
    params = {name: p for name, p in model.named_parameters() if only is None or only(name)}
    filled: set[str] = set()
    records: dict[str, dict[int | None, PrequantizedWeight]] = {}
    for name, tensor in weights:
        if name == "lm_head.weight" and "lm_head.weight" not in params:
            continue  # tied embeddings: the file may still carry a copy
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's sparse FFN
        if (key := _load_expert(model, params, name, tensor, records, install)) is not None:
            filled.add(key)
            continue
        target, shard = _packed_target(name)
        param = params.get(target)
        if param is None:
            continue  # e.g. rotary inv_freq buffers saved by old checkpoints
        if isinstance(tensor, (torch.Tensor, DeferredTensor)):
            if pack_on_load is None or not pack_on_load.before_fill(target, param, tensor):
                _copy_tensor(model, name, param, target, shard, tensor)
            if pack_on_load is not None:
                pack_on_load.after_fill(target, shard, param)
        else:
            _check_record(model, name, param, target, shard, tensor)
            records.setdefault(target.rsplit(".", 1)[0], {})[shard] = tensor
            _hand_over(model, records, target.rsplit(".", 1)[0], install)
        filled.add(f"{target}#{shard}")
    missing = [n for n in params if not any(f.startswith(n + "#") for f in filled)]
    missing += _missing_experts(model, filled)
    assert not missing, f"weights missing from the checkpoint: {missing[:5]}"
    return {module: _in_shard_order(model, module, shards) for module, shards in records.items()}


def _load_expert(model: torch.nn.Module, params: dict[str, torch.nn.Parameter], name: str,
                 tensor: torch.Tensor | DeferredTensor | PrequantizedWeight,
                 records: dict[str, dict[int | None, PrequantizedWeight]],
                 install: Callable[[str, list[PrequantizedWeight]], None] | None) -> str | None:
    """Copy one routed expert's matrix into its row of the layer's stacked weights (layers/moe.py
    `FusedExperts`), or put its pre-quantized record (a GGUF's blocks) into `records` under
    `experts#expert.stacked` (handed to `install` once complete: `registry.PrequantizedInstaller` makes it the
    expert's module); returns the filled key (`param#expert.shard`), or None for a name that is no expert's."""
    match = _EXPERT_NAME.fullmatch(name)
    if match is None:
        return None
    stacked, shard = _EXPERT_SHARDS[match.group(3)]
    target, expert = f"{match.group(1)}.{stacked}", int(match.group(2))
    if target not in params:
        return None
    rows = params[target][expert]
    if shard is not None:
        start, size = model.get_submodule(match.group(1)).shard_offsets[shard]
        rows = rows[start:start + size]
    if not isinstance(tensor, (torch.Tensor, DeferredTensor)):
        got, expected = (tensor.out_features, tensor.in_features), tuple(rows.shape)
        assert got == expected, f"{name}: quantized weight {got}, expected {expected}"
        module = f"{match.group(1)}{EXPERT_RECORD}{expert}.{stacked}"
        records.setdefault(module, {})[shard] = tensor
        _hand_over(model, records, module, install)
        return f"{target}#{expert}.{shard}"
    assert rows.shape == tensor.shape, f"{name}: {tuple(tensor.shape)} vs {tuple(rows.shape)}"
    _fill(rows, tensor)
    return f"{target}#{expert}.{shard}"


def _missing_experts(model: torch.nn.Module, filled: set[str]) -> list[str]:
    """Experts of a stacked weight that the checkpoint did not fill, where it filled some one by one."""
    missing = []
    for target in {key.split("#")[0] for key in filled if "#" in key and "." in key.split("#")[1]}:
        module = model.get_submodule(target.rsplit(".", 1)[0])
        shards = [0, 1] if target.endswith("gate_up_proj") else [None]
        missing += [f"{target}[{e}]" for e in range(module.num_experts) for s in shards
                    if f"{target}#{e}.{s}" not in filled]
    return missing


def _copy_tensor(model: torch.nn.Module, name: str, param: torch.nn.Parameter, target: str, shard: int | None,
                 tensor: torch.Tensor | DeferredTensor) -> None:
    if shard is None:
        assert param.shape == tensor.shape, f"{name}: {tuple(tensor.shape)} vs {tuple(param.shape)}"
        _fill(param, tensor)
    else:
        start, size = model.get_submodule(target.rsplit(".", 1)[0]).shard_offsets[shard]
        assert tensor.shape[0] == size, f"{name}: {tensor.shape[0]} rows, expected {size}"
        _fill(param[start:start + size], tensor)


def _fill(dest: torch.Tensor, tensor: torch.Tensor | DeferredTensor) -> None:
    """Copy into `dest` (cast to its dtype); a deferred tensor of dest's dtype is read straight into it."""
    with torch.no_grad():
        if isinstance(tensor, DeferredTensor):
            if dest.is_contiguous() and dest.dtype == tensor.dtype and dest.shape == tensor.shape:
                return tensor.read_into(dest)
            tensor = tensor.read()
        dest.copy_(tensor)


def _check_record(model: torch.nn.Module, name: str, param: torch.nn.Parameter, target: str, shard: int | None,
                  record: PrequantizedWeight) -> None:
    """A record stands for a whole weight matrix (or one shard of a fused one) of the parameter's shape."""
    assert target.endswith(".weight") and param.dim() == 2, f"{name}: a quantized record for a non-weight"
    rows = param.shape[0] if shard is None else model.get_submodule(target.rsplit(".", 1)[0]).shard_offsets[shard][1]
    got, expected = (record.out_features, record.in_features), (rows, param.shape[1])
    assert got == expected, f"{name}: quantized weight {got}, expected {expected}"


def _hand_over(model: torch.nn.Module, records: dict[str, dict[int | None, PrequantizedWeight]], module: str,
               install: Callable[[str, list[PrequantizedWeight]], None] | None) -> None:
    """`install` the module's records once all its shards are in, and forget them; a module with a float bias
    waits for the end (its bias may come later in the file, and the record's module takes it)."""
    if install is None or set(records[module]) != set(_expected_shards(model, module)):
        return
    if EXPERT_RECORD not in module and getattr(model.get_submodule(module), "bias", None) is not None:
        return
    install(module, _in_shard_order(model, module, records.pop(module)))


def _expected_shards(model: torch.nn.Module, module_name: str) -> list[int | None]:
    """A module's shards in order: [None], or 0 .. n - 1 of a fused one."""
    if EXPERT_RECORD in module_name:  # an expert's gate and up (shards 0 and 1), or its down
        return [0, 1] if module_name.endswith("gate_up_proj") else [None]
    offsets = getattr(model.get_submodule(module_name), "shard_offsets", None)
    return [None] if offsets is None else list(range(len(offsets)))


def _in_shard_order(model: torch.nn.Module, module_name: str,
                    shards: dict[int | None, PrequantizedWeight]) -> list[PrequantizedWeight]:
    """A fused module's records in shard order; all of its shards must be quantized (or none)."""
    expected = _expected_shards(model, module_name)
    assert sorted(shards, key=str) == sorted(expected, key=str), \
        f"{module_name}: shards {sorted(shards, key=str)} quantized, {expected} expected (a fused layer is " \
        f"quantized whole or not at all)"
    return [shards[i] for i in expected]


def _packed_target(name: str) -> tuple[str, int | None]:
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in PACKED_MODULES:
        packed, shard = PACKED_MODULES[parts[-2]]
        return ".".join(parts[:-2] + [packed, parts[-1]]), shard
    return name, None


class PackedLinear(Linear):
    """One matrix for several projections of the same input (q/k/v or gate/up): one matmul instead of 3."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(out_sizes), bias=bias)
        starts = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.shard_offsets = list(zip(starts, out_sizes))


def held_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The tensors a module and its children hold, as parameters, buffers or attributes (views included)."""
    for sub in module.modules():
        yield from sub.parameters(recurse=False)
        yield from sub.buffers(recurse=False)
        yield from (v for v in vars(sub).values() if isinstance(v, torch.Tensor))


def tensor_memory(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the memory a tensor lives in: its storage's, or oneDNN's opaque packed copy's (its
    elements' bytes)."""
    if t.is_mkldnn:
        return torch.ops.mkldnn.data_ptr(t), t.numel() * t.element_size()
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def resident_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct tensors a module and its children hold, as parameters, buffers or attributes
    (oneDNN's opaque packed weights counted by their elements, once with the views of their memory)."""
    memory: dict[int, int] = {}
    for t in held_tensors(module):
        address, nbytes = tensor_memory(t)
        memory.setdefault(address, nbytes)
    return sum(memory.values())
