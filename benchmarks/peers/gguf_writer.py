"""A GGUF file of a Hugging Face folder's weights (Llama or Qwen2 layout), quantized by the `gguf` package, the
way llama.cpp's convert_hf_to_gguf.py names and orders them (q/k rows permuted for llama.cpp's RoPE, norms in
float32), with the folder's BPE tokenizer, its token list padded to the model's vocabulary. Written tensor by
tensor (the header first, from the shapes alone), so an 8B model needs no more memory than its largest tensor.
"""

import json
from pathlib import Path

import numpy as np
import torch

NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in GLOBAL:
        return GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.N.<module>.<weight|bias>
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{NAMES[module]}.{kind}"


def permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k permutation (HF's rotate-half halves -> llama.cpp's interleaved pairs)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def prepared(name: str, tensor: torch.Tensor, config) -> np.ndarray:
    rows = tensor.float().numpy()
    if config.model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
        rows = permute(rows, heads)
    return rows


def write_gguf(folder: Path, path: Path, qtype_name: str) -> None:
    import gguf
    from transformers import AutoConfig

    from sobrio.loader.hf import iter_safetensors_weights

    config = AutoConfig.from_pretrained(folder)
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, config.model_type)
    add_hparams(writer, config, qtype_name)
    add_tokenizer(writer, folder, config.vocab_size)
    order = []
    for name, tensor in iter_safetensors_weights(folder):  # shapes first: the header precedes the data
        kind = qtype if tensor.dim() == 2 else gguf.GGMLQuantizationType.F32
        shape = list(tensor.shape)
        byte_shape = gguf.quant_shape_to_byte_shape(shape, kind) if tensor.dim() == 2 else shape
        nbytes = int(np.prod(byte_shape)) * (1 if tensor.dim() == 2 else 4)
        writer.add_tensor_info(gguf_name(name), byte_shape, np.uint8 if tensor.dim() == 2 else np.float32, nbytes,
                               raw_dtype=kind if tensor.dim() == 2 else None)
        order.append(name)
    writer.write_header_to_file(tmp)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, tensor in iter_safetensors_weights(folder):
        rows = prepared(name, tensor, config)
        writer.write_tensor_data(gguf.quants.quantize(rows, qtype) if rows.ndim == 2 else rows.astype(np.float32))
    writer.close()
    tmp.replace(path)


def add_hparams(writer, config, qtype_name: str) -> None:
    import gguf

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_rope_freq_base(rope.get("rope_theta") or config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{qtype_name}"))


def add_tokenizer(writer, folder: Path, vocab_size: int) -> None:
    """The folder's byte-level BPE (tokenizer.json), padded with unused tokens to the model's vocabulary."""
    import gguf

    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    types = [gguf.TokenType.NORMAL] * len(tokens)
    for added in data.get("added_tokens", []):
        if added["id"] < len(tokens):
            types[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [gguf.TokenType.UNUSED] * (vocab_size - len(types))
    merges = data["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
