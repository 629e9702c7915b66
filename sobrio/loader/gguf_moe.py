"""Mixture-of-experts GGUF files (llama.cpp's `llama` with experts, i.e. Mixtral, and `qwen3moe`): the
config transformers does not derive, and the experts' stacked tensors under Hugging Face's per-expert names.

llama.cpp stores a layer's experts as one 3-D tensor per matrix, `blk.N.ffn_{gate,up,down}_exps` [E, I, H]
(down: [E, H, I]), and the router as `blk.N.ffn_gate_inp` [E, H]. transformers reads a `llama` file with
`llama.expert_count` as a dense Llama, and a `qwen3moe` one without its `expert_feed_forward_length`:
`moe_config` fixes both from the metadata. llama.cpp renormalises Qwen3-MoE's top-k weights always (its
`qwen3moe` graph), as Qwen3-MoE's released checkpoints do (`norm_topk_prob`); a file that says
`expert_weights_norm` is taken at its word.

Under `--quantization gguf` each expert's matrix keeps its blocks (a slice of the stacked tensor, decoded as a
dense weight's are, loader/gguf_blocks.py) and runs the kernels a dense quantized Linear runs, as
`--quantization int8/int4` quantizes them (`FusedExperts`' per-expert modules): dequantized, a Qwen3-30B-A3B
file's experts would take ~60 GB in float32. Without the flag, or in a block type without a packed kernel,
they are dequantized. The router (`ffn_gate_inp`) is dequantized always, as `--quantization int8/int4` keeps
it float (loader/gguf.py).
"""

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from sobrio.errors import ConfigError

EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
ROUTER = {"ffn_gate_inp": "mlp.gate"}  # GGUF name after `blk.N.` -> Hugging Face's after `model.layers.N.`
_EXPERT_NAME = re.compile(r"blk\.(\d+)\.(ffn_gate_exps|ffn_up_exps|ffn_down_exps)\.weight")


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def moe_config(gguf_path: Path, config):
    """`config` (transformers' reading of the file) made right for a mixture of experts: a `llama` file with
    experts becomes a Mixtral config, a `qwen3moe` one gets its experts' intermediate size; a dense file's
    config comes back as it was. An architecture with experts that sobrio does not run is a ConfigError."""
    from gguf import GGUFReader
    from transformers import AutoConfig

    reader = GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    experts = _field(reader, f"{arch}.expert_count")
    if not experts:
        return config
    used = _field(reader, f"{arch}.expert_used_count")
    if arch == "llama":
        fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        return AutoConfig.for_model("mixtral", **fields, num_local_experts=experts, num_experts_per_tok=used,
                                    architectures=["MixtralForCausalLM"])
    if arch == "qwen3moe":
        config.num_experts, config.num_experts_per_tok = experts, used
        config.moe_intermediate_size = _field(reader, f"{arch}.expert_feed_forward_length")
        norm = _field(reader, f"{arch}.expert_weights_norm")
        config.norm_topk_prob = True if norm is None else bool(norm)
        return config
    raise ConfigError(f"{gguf_path.name}: GGUF architecture {arch!r} with experts is not supported (supported: "
                      f"llama with experts (Mixtral), qwen3moe)", "--model")


def expert_shapes(tensor) -> list[tuple[str, tuple[int, int]]] | None:
    """The Hugging Face names and [out, in] shapes of an expert tensor's matrices, one per expert, from its entry
    in the file's tensor table alone; None for a tensor that is no expert stack."""
    match = _EXPERT_NAME.fullmatch(tensor.name)
    if match is None:
        return None
    layer, part = match.group(1), EXPERT_TENSORS[match.group(2)]
    cols, rows, experts = (int(n) for n in tensor.shape[:3])  # GGUF lists dimensions innermost first
    return [(f"model.layers.{layer}.mlp.experts.{e}.{part}.weight", (rows, cols)) for e in range(experts)]


def expert_weights(tensor, dequantize, packed: bool = False) -> Iterator[tuple[str, object]] | None:
    """An expert tensor's matrices as (Hugging Face name, float32 [out, in]), one per expert, or None for a
    tensor that is no expert stack. `dequantize(tensor)` gives its values as a numpy array. `packed`
    (`--quantization gguf`): each matrix as its packed codes instead, where its block type has a kernel."""
    from sobrio.loader.gguf_blocks import PACKED_TYPES, decode_blocks

    shapes = expert_shapes(tensor)
    if shapes is None:
        return None
    if packed and tensor.tensor_type.name in PACKED_TYPES:  # data: [E, rows, bytes a row], an expert a slice
        in_features = shapes[0][1][1]
        return ((name, decode_blocks(tensor.data[e], tensor.tensor_type.name, in_features))
                for e, (name, _) in enumerate(shapes))
    values = np.asarray(dequantize(tensor), dtype=np.float32).reshape(len(shapes), *shapes[0][1])
    return ((name, torch.from_numpy(values[e].copy())) for e, (name, _) in enumerate(shapes))
