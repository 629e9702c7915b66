"""GLM-4 GGUF files (llama.cpp's `glm4`), which transformers' GGUF reader does not map: the config from the
file's metadata and the tokenizer from its vocabulary.

llama.cpp's convert_hf_to_gguf.py writes GLM-4's gate/up fused as `ffn_up` (gate rows first, as Hugging Face's
`gate_up_proj`), its q/k rows unpermuted (the rotary is interleaved already, llama.cpp's normal rope), the
rotated part of a head as `rope.dimension_count`, and the two post-norms under Gemma 2's names
(`post_attention_norm`, `post_ffw_norm`); no field says whether q/k/v have biases: the tensors do.
"""

from pathlib import Path

GLM4_LAYER_NAMES = {  # GGUF name after `blk.N.` -> Hugging Face's after `model.layers.N.`, beyond the shared ones
    "ffn_up": "mlp.gate_up_proj",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_self_attn_layernorm",
    "post_ffw_norm": "post_mlp_layernorm",
}


def _fields(reader) -> dict:
    return {key: field.contents() for key, field in reader.fields.items()
            if not key.startswith("tokenizer.ggml.") or key.endswith("_token_id")}


def glm4_config(gguf_path: Path):
    """A Glm4Config from the file's `glm4.*` metadata and tensor names."""
    from gguf import GGUFReader
    from transformers import AutoConfig

    reader = GGUFReader(str(gguf_path))
    meta, tensors = _fields(reader), {t.name for t in reader.tensors}
    arch = "glm4"
    heads = meta[f"{arch}.attention.head_count"]
    head_dim = meta.get(f"{arch}.attention.key_length", meta[f"{arch}.embedding_length"] // heads)
    rotary = meta.get(f"{arch}.rope.dimension_count", head_dim // 2)
    vocab = meta.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    special = {f"{name}_token_id": meta[f"tokenizer.ggml.{name}_token_id"] for name in ("bos", "eos", "pad")
               if f"tokenizer.ggml.{name}_token_id" in meta}
    return AutoConfig.for_model(
        "glm4", architectures=["Glm4ForCausalLM"], hidden_size=meta[f"{arch}.embedding_length"],
        intermediate_size=meta[f"{arch}.feed_forward_length"], num_hidden_layers=meta[f"{arch}.block_count"],
        num_attention_heads=heads, num_key_value_heads=meta.get(f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim, rms_norm_eps=meta[f"{arch}.attention.layer_norm_rms_epsilon"], vocab_size=vocab,
        max_position_embeddings=meta[f"{arch}.context_length"], attention_bias="blk.0.attn_q.bias" in tensors,
        tie_word_embeddings="output.weight" not in tensors,
        rope_parameters={"rope_type": "default", "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
                         "partial_rotary_factor": rotary / head_dim}, **special)


def glm4_tokenizer(gguf_path: Path):
    """The file's vocabulary as a fast tokenizer, built by transformers' GGUF tokenizer converter (the one
    `AutoTokenizer.from_pretrained(gguf_file=...)` uses, which first asks for a config it cannot map)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, vocabulary, settings = get_gguf_tokenizer(str(gguf_path))
    backend, _ = convert_gguf_tokenizer(architecture, vocabulary)
    return PreTrainedTokenizerFast(tokenizer_object=backend,
                                   **{key: value for key, value in settings.items() if value is not None})
