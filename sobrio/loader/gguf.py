"""GGUF files: config, tokenizer and dequantized tensors under Hugging Face names.

Reading a GGUF's config and tokenizer through transformers takes 5-15 s (it parses every field) and
dequantizing its tensors with `gguf`'s numpy kernels 4-25 s, so the first load writes them as a Hugging Face
folder under the cache (config.json and tokenizer files; the float32 model.safetensors only once the dense
path reads it, a GGUF served without `--quantization gguf`, written tensor by tensor); later loads read that
folder in about a second. `--quantization gguf` reads the blocks from the GGUF itself and writes no floats.
"""

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from sobrio.loader.gguf_glm4 import GLM4_LAYER_NAMES, glm4_config, glm4_tokenizer
from sobrio.loader.gguf_moe import ROUTER, expert_shapes, expert_weights, moe_config
from sobrio.loader.hf import write_safetensors_stream
from sobrio.loader.resolve import FLOAT_WEIGHTS, is_prepared, mark_prepared, prepared_path

# GGUF tensor name (after `blk.N.`) -> Hugging Face name (after `model.layers.N.`), per architecture.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA_LAYER_NAMES = {**_LAYER_NAMES, **ROUTER, "ffn_norm": "post_attention_layernorm"}
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER_NAMES = {**_LLAMA_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_GLM4_LAYER_NAMES = {**_LAYER_NAMES, **GLM4_LAYER_NAMES}
_TABLES = {"phi3": _PHI3_LAYER_NAMES, "glm4": _GLM4_LAYER_NAMES}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def gguf_tokenizer(gguf_path: Path):
    """The GGUF's tokenizer alone, for clients such as `sobrio bench` that never run the model: read from the
    prepared folder if one was made (about a second), else from the GGUF's metadata; writes nothing."""
    from transformers import AutoTokenizer

    folder = prepared_path(gguf_path)
    if (folder / "tokenizer_config.json").is_file():  # the folder appears whole (renamed into place)
        return AutoTokenizer.from_pretrained(folder)
    return _file_tokenizer(gguf_path, check_architecture(gguf_path))


def _file_tokenizer(gguf_path: Path, arch: str):
    """The tokenizer from the GGUF's metadata: transformers' reader, or sobrio's for GLM-4, which it does not map."""
    from transformers import AutoTokenizer

    if arch == "glm4":
        return glm4_tokenizer(gguf_path)
    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def _file_config(gguf_path: Path, arch: str):
    """The config from the GGUF's metadata: transformers' reading completed, or sobrio's for GLM-4."""
    from transformers import AutoConfig

    if arch == "glm4":
        return complete_config(glm4_config(gguf_path), gguf_path)
    config = complete_config(AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name), gguf_path)
    return moe_config(gguf_path, config)


# general.architecture values whose GGUF files sobrio reads (docs/models.md's GGUF column)
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3", "glm4")


def check_architecture(gguf_path: Path) -> str:
    """The GGUF's architecture; one sobrio does not read is refused, named, before transformers fails on it."""
    from gguf import GGUFReader

    from sobrio.errors import InvalidRequestError

    arch = str(GGUFReader(str(gguf_path)).fields["general.architecture"].contents())
    if arch not in GGUF_ARCHITECTURES:
        raise InvalidRequestError(f"{gguf_path.name}: GGUF architecture {arch!r} (general.architecture) is not "
                                  f"supported; supported: {', '.join(GGUF_ARCHITECTURES)}", "model")
    return arch


def prepared_folder(gguf_path: Path, prepare: bool = True, weights: bool = False) -> Path | None:
    """A folder with config.json and tokenizer files derived from the GGUF, made once and cached; with `weights`,
    also the float32 weights the dense path reads, written the first time they are wanted (with `prepare=False`:
    the folder if it holds what is asked already, else None)."""
    folder = prepared_path(gguf_path)
    if is_prepared(folder, weights):
        return folder
    if not prepare:
        return None
    if not is_prepared(folder):
        arch = check_architecture(gguf_path)
        tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")  # two processes may prepare at once
        tmp.mkdir(parents=True, exist_ok=True)
        _file_config(gguf_path, arch).save_pretrained(tmp)
        _file_tokenizer(gguf_path, arch).save_pretrained(tmp)
        mark_prepared(tmp)
        _move_into_place(tmp, folder)
    if weights and not is_prepared(folder, weights=True):
        _write_float_weights(gguf_path, folder)
    return folder


def _write_float_weights(gguf_path: Path, folder: Path) -> None:
    """The dense path's float32 weights, dequantized and written one tensor at a time (the header from the
    file's tensor table), so preparing holds one tensor, not the model (32 GB at 8B); written beside the folder
    and renamed into it, so a reader sees the whole file or none."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    specs = [(name, torch.float32, shape) for name, shape in float_weight_shapes(gguf_path, config)]
    tmp = folder.with_name(f"{folder.name}.{FLOAT_WEIGHTS}.tmp{os.getpid()}")
    try:
        write_safetensors_stream(tmp, specs, iter_gguf_weights(gguf_path, config), {"format": "pt"})
        tmp.replace(folder / FLOAT_WEIGHTS)
    finally:
        tmp.unlink(missing_ok=True)


def float_weight_shapes(gguf_path: Path, config) -> list[tuple[str, tuple[int, ...]]]:
    """The names and shapes of the float32 tensors `iter_gguf_weights` yields, from the file's tensor table alone
    (nothing dequantized): the float weights' header, and their size before they are written."""
    from gguf import GGUFReader

    shapes: list[tuple[str, tuple[int, ...]]] = []
    for tensor in GGUFReader(str(gguf_path)).tensors:
        experts = expert_shapes(tensor)
        if experts is not None:
            shapes += experts
        elif (name := _hf_name(tensor.name, config.model_type)) is not None:
            shapes.append((name, _float_shape(tensor)))
    return shapes


def _float_shape(tensor) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first


# llama.cpp metadata (after `{arch}.`) that transformers' GGUF reader skips for some architectures -> config field
_MISSED_FIELDS = {"attention.key_length": "head_dim", "attention.sliding_window": "sliding_window",
                  "attn_logit_softcapping": "attn_logit_softcapping",
                  "final_logit_softcapping": "final_logit_softcapping"}


def complete_config(config, gguf_path: Path):
    """The fields transformers' GGUF reader leaves at the class defaults although the file holds them (Qwen3's
    head_dim, Gemma 2's softcaps and window, Phi-3's window, partial rotary and longrope factors): with the
    defaults a model of other shapes would load wrong, or not at all."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    arch = str(reader.fields["general.architecture"].contents())
    values = {key[len(arch) + 1:]: field.contents() for key, field in reader.fields.items()
              if key.startswith(arch + ".")}
    for key, name in _MISSED_FIELDS.items():
        if key in values:
            setattr(config, name, values[key])
    scaling = values.get("rope.scaling.type", "none")
    if scaling in ("linear", "yarn"):
        params = dict(config.rope_parameters or {})
        params.update(rope_type=scaling, factor=values["rope.scaling.factor"])
        if "rope.scaling.original_context_length" in values:
            params["original_max_position_embeddings"] = values["rope.scaling.original_context_length"]
        config.rope_parameters = params
    elif scaling != "none":
        config.rope_parameters = {**(config.rope_parameters or {}), "rope_type": scaling}  # refused at load
    if arch == "phi3":
        _phi3_rope(config, values, {t.name: t for t in reader.tensors})
    if arch == "gemma2":  # not in the file: llama.cpp takes the head size, and hidden / heads for the 27B
        wide = config.num_hidden_layers == 46
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if wide else config.head_dim
    return config


def _phi3_rope(config, values: dict, tensors: dict) -> None:
    """Phi-3's partial rotary (`rope.dimension_count`) and longrope factors (tensors `rope_factors_*`)."""
    head_dim = config.hidden_size // config.num_attention_heads
    params = dict(config.rope_parameters or {})
    params["partial_rotary_factor"] = values.get("rope.dimension_count", head_dim) / head_dim
    if "rope_factors_long.weight" in tensors:
        original = values.get("rope.scaling.original_context_length", config.max_position_embeddings)
        params.update(rope_type="longrope", original_max_position_embeddings=original,
                      long_factor=tensors["rope_factors_long.weight"].data.tolist(),
                      short_factor=tensors["rope_factors_short.weight"].data.tolist())
        config.original_max_position_embeddings = original
    config.rope_parameters = params


def _move_into_place(tmp: Path, folder: Path) -> None:
    """Rename the made folder into place, unless another process got there first: its folder stays (it may
    be reading it: removing it under that reader broke a start of two servers at once) and ours goes."""
    if not is_prepared(folder):
        if folder.exists():
            shutil.rmtree(folder)  # a leftover from before folders were renamed into place
        try:
            tmp.replace(folder)
            return
        except OSError:  # another process renamed its folder in between
            pass
    shutil.rmtree(tmp)


def _hf_name(gguf_name: str, model_type: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if match:
        table = _GEMMA3_LAYER_NAMES if model_type.startswith("gemma") else \
            _TABLES.get(model_type, _LLAMA_LAYER_NAMES)
        part = table.get(match.group(2))
        return f"model.layers.{match.group(1)}.{part}.{suffix}" if part else None
    part = _GLOBAL_NAMES.get(base)
    return f"{part}.{suffix}" if part else None


def _unpermute_rope(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows so rotate-half RoPE applies (as transformers does)."""
    dim = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def iter_gguf_weights(gguf_path: Path, config, packed: bool = False) -> Iterator[tuple[str, object]]:
    """Yield (hf_name, float32 tensor) for every tensor, dequantized with the `gguf` package; with `packed`
    (`--quantization gguf`), a 2-D tensor in a block type with a packed kernel comes as its codes instead
    (loader/gguf_blocks.py), its rows unpermuted like the floats'."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    for tensor in reader.tensors:
        experts = expert_weights(tensor, _dequantized, packed)
        if experts is not None:  # a mixture of experts' stacked matrices, one per expert (loader/gguf_moe.py)
            yield from experts
            continue
        name = _hf_name(tensor.name, config.model_type)
        if name is None:
            continue
        codes = _packed(tensor, name, config) if packed and not name.endswith(".mlp.gate.weight") else None
        yield name, codes if codes is not None else _float_tensor(tensor, name, config)


def _packed(tensor, name: str, config):
    """The tensor's blocks as packed codes, or None (not a matrix, or a type without a packed kernel)."""
    from sobrio.loader.gguf_blocks import PACKED_TYPES, decode_blocks

    if len(tensor.shape) != 2 or tensor.tensor_type.name not in PACKED_TYPES:
        return None
    return decode_blocks(_unpermuted(tensor.data, name, config), tensor.tensor_type.name, int(tensor.shape[0]))


_ROWS_ELEMENTS = 1 << 22  # elements dequantized at once (gguf's kernels hold a few copies of what they are given)


def _dequantized(tensor) -> np.ndarray:
    """The tensor's values as a float32 array of its own, dequantized a run of rows at a time into it: gguf's
    kernels given the whole tensor hold copies of it beside the result (gigabytes for an 8B embedding)."""
    from gguf import dequantize

    rows = tensor.data.reshape(-1, tensor.data.shape[-1])  # blocks (or values) of one row each
    shape = _float_shape(tensor)
    out = np.empty((rows.shape[0], shape[-1]), dtype=np.float32)
    step = max(1, _ROWS_ELEMENTS // shape[-1])
    for start in range(0, rows.shape[0], step):
        out[start:start + step] = dequantize(rows[start:start + step], tensor.tensor_type)
    return out.reshape(shape)


def _float_tensor(tensor, name: str, config) -> torch.Tensor:
    weights = _unpermuted(_dequantized(tensor), name, config)
    if config.model_type.startswith("gemma") and name.endswith("norm.weight"):
        weights = weights - 1  # llama.cpp stores Gemma's (1 + w); transformers keeps w
    return torch.from_numpy(np.ascontiguousarray(weights))  # an array of its own already: no copy


def _unpermuted(rows: np.ndarray, name: str, config) -> np.ndarray:
    """Llama's Q and K rows (floats or whole rows of blocks) back in transformers' order."""
    if config.model_type in ("llama", "mistral", "mixtral") and (".q_proj." in name or ".k_proj." in name):
        heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
        return _unpermute_rope(rows, heads)
    return rows
