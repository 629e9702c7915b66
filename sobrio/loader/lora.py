"""PEFT LoRA adapter folders: `adapter_config.json` + `adapter_model.safetensors`, checked against a base model.

What sobrio computes: plain LoRA (rank r, `lora_alpha`, rsLoRA's alpha / sqrt(r) scaling) on q/k/v/o_proj and
gate/up/down_proj of every layer. Every other PEFT feature (DoRA, modules_to_save, biases, other targets,
per-module rank or alpha patterns, a subset of layers) is refused by name when the adapter is registered, so
an adapter is never served half-applied.
"""

import json
import math
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sobrio.errors import InvalidRequestError
from sobrio.loader.hf import read_fully, safetensors_layout

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
# PEFT fields whose non-default value changes the computation: (name, the values that mean "off")
_REFUSED_FIELDS = (("use_dora", (False, None)), ("modules_to_save", (None, [])), ("bias", ("none", None)),
                   ("lora_bias", (False, None)), ("rank_pattern", ({}, None)), ("alpha_pattern", ({}, None)),
                   ("layers_to_transform", (None, [])), ("fan_in_fan_out", (False, None)),
                   ("trainable_token_indices", (None, {}, [])), ("target_parameters", (None, [])),
                   ("layer_replication", (None, [])))


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with (vLLM's name): `lora_int_id` is unique per registration, so an adapter
    re-registered under the same name never shares KV blocks or loaded weights with its predecessor."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    @property
    def hash_root(self) -> bytes:
        """The parent hash of its first prefix-cache block: blocks of two adapters never coincide."""
        return f"lora:{self.lora_int_id}:{self.lora_name}".encode()


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scaling: float
    targets: tuple[str, ...]
    base_model_name: str | None


def read_adapter_config(path: str | Path, max_rank: int) -> AdapterConfig:
    """The adapter's rank, scaling and targets; InvalidRequestError naming the PEFT field sobrio lacks."""
    folder = Path(path)
    cfg_file, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not cfg_file.is_file() or not weights.is_file():
        raise InvalidRequestError(f"LoRA adapter {str(path)!r}: expected a PEFT folder with adapter_config.json "
                                  "and adapter_model.safetensors", param="lora_path")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"LoRA adapter {str(path)!r}: unreadable adapter_config.json ({exc})",
                                  param="lora_path") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _refuse(path, f"peft_type {cfg.get('peft_type')!r} (only LORA)")
    for name, off in _REFUSED_FIELDS:
        if cfg.get(name, off[0]) not in off:
            raise _refuse(path, f"{name}={cfg[name]!r}")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    other = [t for t in targets if t not in TARGETS]
    if other or not targets:
        raise _refuse(path, f"target_modules {other or targets!r} (sobrio applies LoRA to {', '.join(TARGETS)})")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)
    if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, (int, float)):
        raise _refuse(path, f"r={rank!r}, lora_alpha={alpha!r}")
    if rank > max_rank:
        raise InvalidRequestError(f"LoRA adapter {str(path)!r} has rank {rank}, more than --max-lora-rank "
                                  f"{max_rank}", param="lora_path")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, scaling, tuple(targets), cfg.get("base_model_name_or_path"))


def _refuse(path, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {str(path)!r}: sobrio does not support {what}", param="lora_path")


def target_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each PEFT target in the base model's layers; a mixture-of-experts
    model has no dense gate/up/down to adapt."""
    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv, hidden = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim, c.hidden_size
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q)}
    if not (getattr(c, "num_experts", 0) or getattr(c, "num_local_experts", 0)):
        inter = c.intermediate_size
        shapes |= {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    return shapes


_TENSOR_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
TensorNames = dict[tuple[int, str], tuple[str, str]]  # (layer, target) -> names of its A and B


def check_adapter(path: str | Path, max_rank: int, num_layers: int, shapes: dict[str, tuple[int, int]]
                  ) -> tuple[AdapterConfig, TensorNames]:
    """The adapter's config and the names of each module's A and B, checked against the base model from the
    safetensors header alone (no tensor is read): `shapes[target] = (out_features, in_features)` of its
    modules. Every targeted module of every layer must have its pair, and no tensor may be left unused."""
    cfg, _, names, _ = _checked(path, max_rank, num_layers, shapes, read=None)
    return cfg, names


class ReadBuffer:
    """Memory that one adapter read after another reuses for the file's bytes and its stacks, so its pages are
    mapped once: in fresh memory each 4 KB page cost a fault (~2 us on a 2-core Zen 4 VM), ~5 ms of a
    rank-16 adapter's 10 MB. An anonymous map of its own, which measured faster than numpy's memory
    (docs/lora.md). Kept up to `KEEP_BYTES`; a larger adapter is read into fresh memory."""

    KEEP_BYTES = 256 << 20

    def __init__(self):
        self.memory = np.empty(0, dtype=np.uint8)
        self.used = 0

    def take(self, nbytes: int) -> np.ndarray:
        """`nbytes` of the buffer after those taken since `reset` (valid until the next `reset`)."""
        if self.used + nbytes > self.memory.size:
            if self.used + nbytes > self.KEEP_BYTES:
                return np.empty(nbytes, dtype=np.uint8)
            size = max(self.used + nbytes, 2 * self.memory.size)
            self.memory = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)  # views taken before keep the old
            self.used = 0
        view, self.used = self.memory[self.used:self.used + nbytes], self.used + nbytes
        return view

    def reset(self) -> None:
        self.used = 0


def read_adapter(path: str | Path, max_rank: int, num_layers: int, shapes: dict[str, tuple[int, int]],
                 buffer: ReadBuffer | None = None) -> tuple[float, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The adapter's scaling and, for each target, every layer's A and B stacked ([layers, r, in] and
    [layers, out, r], as the file stores them), checked as `check_adapter` checks them. The file is read in
    one call and each target's tensors stacked from its bytes by numpy: safetensors makes a tensor of each
    (hundreds for an adapter on every target), which cost more than reading the file (docs/lora.md). With
    `buffer`, the bytes and stacks are in its memory: valid until the next read into it."""
    buffer = buffer or ReadBuffer()
    buffer.reset()
    cfg, layout, names, raw = _checked(path, max_rank, num_layers, shapes, read=buffer)
    stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for target in cfg.targets:
        a, b = ([names[layer, target][i] for layer in range(num_layers)] for i in (0, 1))
        stacks[target] = _stack(path, raw, layout, a, buffer), _stack(path, raw, layout, b, buffer)
    return cfg.scaling, stacks


def _checked(path: str | Path, max_rank: int, num_layers: int, shapes: dict[str, tuple[int, int]],
             read: ReadBuffer | None) -> tuple[AdapterConfig, dict, TensorNames, np.ndarray | None]:
    """(config, the file's layout, each module's pair of names, with `read` the file's bytes in its memory),
    checked as `check_adapter` says: the one check the front and the engine core both run."""
    cfg = read_adapter_config(path, max_rank)
    raw = None
    with open(Path(path) / "adapter_model.safetensors", "rb", buffering=0) as f:
        layout = _layout(path, f)
        if read is not None:
            f.seek(0)
            raw = read.take(os.fstat(f.fileno()).st_size)
            raw = raw[:read_fully(f, memoryview(raw))]
    names = _pair_names(path, cfg, layout, num_layers, shapes)
    _check_shapes(path, cfg, names, shapes, layout)
    return cfg, layout, names, raw


_SAME_WIDTH = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}  # numpy's stand-in for a dtype of that width


def _layout(path, f) -> dict[str, tuple[torch.dtype, tuple[int, ...], int]]:
    try:
        return safetensors_layout(f, Path(f.name))
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidRequestError(f"LoRA adapter {str(path)!r}: unreadable adapter_model.safetensors ({exc})",
                                  param="lora_path") from None


def _stack(path, raw: np.ndarray, layout, names: list[str], buffer: ReadBuffer) -> torch.Tensor:
    """The named tensors (one dtype and shape) of the file's bytes `raw`, stacked in `buffer`'s memory: one
    copy, no tensor each."""
    dtype, shape, _ = layout[names[0]]
    if not dtype.is_floating_point or any(layout[name][0] != dtype for name in names):
        raise _refuse(path, f"LoRA weights of dtype {dtype} or of mixed dtypes")
    size = math.prod(shape) * dtype.itemsize
    if any(layout[name][2] + size > raw.size for name in names):
        raise InvalidRequestError(f"LoRA adapter {str(path)!r}: adapter_model.safetensors is cut short",
                                  param="lora_path")
    same = _SAME_WIDTH[dtype.itemsize]
    parts = [raw[layout[name][2]:layout[name][2] + size].view(same) for name in names]
    out = buffer.take(size * len(names)).view(same).reshape(len(names), size // dtype.itemsize)
    np.stack(parts, out=out)
    return torch.from_numpy(out).view(dtype).view(len(names), *shape)


def _pair_names(path, cfg: AdapterConfig, keys, num_layers: int, shapes: dict[str, tuple[int, int]]
                ) -> TensorNames:
    """Each targeted module's A and B by name, in layer order; refused if a pair is missing, a tensor would
    be left unused, or a target has no dense module in this model."""
    missing = [t for t in cfg.targets if t not in shapes]
    if missing:
        raise _refuse(path, f"target_modules {missing!r} on this model (its layers have no such dense module)")
    block_of = {target: "self_attn" if target in ATTENTION_TARGETS else "mlp" for target in cfg.targets}
    found: dict[tuple[int, str, str], str] = {}
    unused = []
    for name in keys:
        match = _TENSOR_NAME.search(name)
        layer, block, target, kind = match.groups() if match else ("0", "", "", "")
        if block_of.get(target) != block or int(layer) >= num_layers:
            unused.append(name)
        else:
            found[int(layer), target, kind] = name
    if unused:
        raise _refuse(path, f"tensors sobrio would not use ({sorted(unused)[0]!r}, ...)")
    names: TensorNames = {}
    for layer in range(num_layers):
        for target in cfg.targets:
            pair = found.get((layer, target, "A")), found.get((layer, target, "B"))
            if None in pair:
                raise _refuse(path, f"an adapter without {target} in layer {layer}")
            names[layer, target] = pair
    return names


def _check_shapes(path, cfg: AdapterConfig, names: TensorNames, shapes: dict[str, tuple[int, int]], layout
                  ) -> None:
    """Every A [r, in] and B [out, r] as the base model's modules need them (`layout[name][1]`: a tensor's
    shape): otherwise the adapter was made for another base model."""
    for (layer, target), pair in names.items():
        out_f, in_f = shapes[target]
        a, b = (layout[name][1] for name in pair)
        if a != (cfg.rank, in_f) or b != (out_f, cfg.rank):
            raise InvalidRequestError(f"LoRA adapter {str(path)!r}: {target} of layer {layer} has A {a} and "
                                      f"B {b}, the base model needs ({cfg.rank}, {in_f}) and ({out_f}, "
                                      f"{cfg.rank}): another base model", param="lora_path")
