"""A GGUF file of a tiny checkpoint's own weights (float32), under llama.cpp's tensor names and metadata, written
with the `gguf` package: the same model as the safetensors folder, so both must answer alike."""

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from tests.model.tiny_checkpoints import VOCAB

# Hugging Face module (after `model.layers.N.`) -> llama.cpp tensor (after `blk.N.`)
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_GEMMA = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
          "post_feedforward_layernorm": "post_ffw_norm"}
_PHI3 = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
# GLM-4: gate/up stay fused in ffn_up (gate rows first) and q/k unpermuted (its rotary is interleaved already),
# as llama.cpp's convert_hf_to_gguf.py writes them; the two post-norms are Gemma 2's names
_GLM4 = {"mlp.gate_up_proj": "ffn_up", "post_self_attn_layernorm": "post_attention_norm",
         "post_mlp_layernorm": "post_ffw_norm"}
ARCHITECTURES = {"qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "phi3": "phi3", "glm4": "glm4"}
_ARCH_LAYER = {"gemma2": _GEMMA, "phi3": _PHI3, "glm4": _GLM4}


def write_gguf(folder: Path, path: Path) -> Path:
    """`folder`'s config and weights as a GGUF at `path` (its tokenizer as a byte-level BPE vocabulary)."""
    import json

    from gguf import GGUFWriter

    config = json.loads((folder / "config.json").read_text())
    arch = ARCHITECTURES[config["model_type"]]
    writer = GGUFWriter(str(path), arch)
    _write_metadata(writer, config)
    layer_names = {**_LAYER, **_ARCH_LAYER.get(arch, {})}
    for name, tensor in sorted(load_file(str(folder / "model.safetensors")).items()):
        if arch == "gemma2" and name.endswith("norm.weight"):
            tensor = tensor + 1  # llama.cpp stores Gemma's (1 + w)
        writer.add_tensor(_gguf_name(name, layer_names), np.ascontiguousarray(tensor.to(torch.float32).numpy()))
    if arch == "phi3":
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight", np.array(config["rope_parameters"][f"{kind}_factor"],
                                                                      dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_name(name: str, layer_names: dict[str, str]) -> str:
    base, _, suffix = name.rpartition(".")
    parts = base.split(".")
    if parts[:2] == ["model", "layers"]:
        return f"blk.{parts[2]}.{layer_names['.'.join(parts[3:])]}.{suffix}"
    return f"{_GLOBAL[base]}.{suffix}"


def _write_metadata(writer, config: dict) -> None:
    from gguf import TokenType

    rope = config["rope_parameters"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") in ("linear", "yarn"):
        writer.add_string(f"{writer.arch}.rope.scaling.type", rope["rope_type"])
        writer.add_float32(f"{writer.arch}.rope.scaling.factor", rope["factor"])
        if "original_max_position_embeddings" in rope:
            writer.add_uint32(f"{writer.arch}.rope.scaling.original_context_length",
                              rope["original_max_position_embeddings"])
    writer.add_vocab_size(VOCAB)
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(cap):
            writer.add_float32(f"{writer.arch}.{cap}", config[cap])
    if "partial_rotary_factor" in rope:
        writer.add_rope_dimension_count(int(config["head_dim"] * rope["partial_rotary_factor"]))
    if rope.get("rope_type") == "longrope":
        writer.add_uint32(f"{writer.arch}.rope.scaling.original_context_length",
                          rope["original_max_position_embeddings"])
    writer.add_tokenizer_model("gpt2")
    tokens = ["<pad>", "<s>", "</s>", "w", "1", "w1", *(f"w{i}" for i in range(6, VOCAB))]
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL] * 3 + [TokenType.NORMAL] * (VOCAB - 3))
    writer.add_token_merges(["w 1"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
