"""Tiny random-weight mixture-of-experts checkpoints written by transformers at test time (no downloads),
with a byte-level tokenizer of 256 tokens (one per byte), and their transformers references."""

import functools
from pathlib import Path

import torch

VOCAB = 256 + 64  # the byte tokens, then room for special tokens
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
              bos_token_id=256, eos_token_id=257, pad_token_id=None)
CONFIGS = {
    "mixtral": dict(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen2_moe": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=False, shared_expert_intermediate_size=64, qkv_bias=True),
}

# Each matrix 1 / sqrt(fan-in), so that every layer moves the residual stream (at transformers' 0.02 the
# experts' share of it was a few percent: a wrong expert would hardly show); the router 4x that, so that
# routing is decisive, not a near tie float rounding could flip.
STD = {"embed_tokens": 1.0, "lm_head": 0.3}


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges: token i is byte i; BOS 256, EOS 257."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    ordered = sorted(byte_chars, key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(ordered)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def _byte_of(char: str) -> int:
    """The byte GPT-2's byte-level alphabet shows as `char`."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(map(chr, cs), bs))[char]


def write_checkpoint(model_type: str, folder: Path, seed: int = 0, **overrides) -> Path:
    """A float32 checkpoint of `model_type` with random weights (`STD`), saved as transformers saves it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**COMMON, **CONFIGS[model_type], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif param.dim() >= 2 or name.endswith("bias"):
                part = name.rsplit(".", 2)[-2]
                param.normal_(0, STD.get(part, param.shape[-1] ** -0.5 * (4 if part == "gate" else 1)))
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


@functools.cache
def hf_model(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_greedy(folder: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model(folder).generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                        top_p=None, top_k=None, temperature=None)
    return out[0, len(prompt):].tolist()


# Hugging Face name (after `model.layers.N.`) -> llama.cpp's (after `blk.N.`)
_GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp"}
_GGUF_EXPERTS = {"w1": "ffn_gate_exps", "gate_proj": "ffn_gate_exps", "w3": "ffn_up_exps", "up_proj": "ffn_up_exps",
                 "w2": "ffn_down_exps", "down_proj": "ffn_down_exps"}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's interleaving of a llama Q or K projection's rows (convert_hf_to_gguf's `permute`)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(folder: Path, arch: str, config) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under llama.cpp's names, each layer's experts stacked [E, out, in]."""
    import re

    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if name in _GGUF_GLOBAL:
            out[_GGUF_GLOBAL[name]] = tensor
        elif m := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", name):
            experts.setdefault((m.group(1), _GGUF_EXPERTS[m.group(3)]), {})[int(m.group(2))] = tensor
        elif m := re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name):
            if arch == "llama" and m.group(2) in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
                tensor = _permute(tensor, heads)
            out[f"blk.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}.{m.group(3)}"] = tensor
    for (layer, part), by_expert in experts.items():
        out[f"blk.{layer}.{part}.weight"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def write_gguf(folder: Path, path: Path, blocks: str | None = None) -> Path:
    """The checkpoint in `folder` as a GGUF with llama.cpp's names and metadata (Mixtral as `llama` with
    experts, Qwen3-MoE as `qwen3moe`) and the byte tokenizer, written with the `gguf` package: float32, or
    with `blocks` ("Q8_0", "Q4_0") every matrix (and expert stack) in that block type."""
    import gguf
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    arch = {"mixtral": "llama", "qwen3_moe": "qwen3moe"}[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_expert_count(getattr(config, "num_local_experts", None) or config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    _add_tokenizer(writer)
    for name, tensor in gguf_tensors(folder, arch, config).items():
        values = tensor.float().numpy()
        if blocks and values.ndim >= 2:
            qtype = gguf.GGMLQuantizationType[blocks]
            writer.add_tensor(name, gguf.quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer) -> None:
    """The byte tokenizer as llama.cpp's `gpt2` (byte-level BPE) model: 256 byte tokens, BOS and EOS, and one
    merge (two spaces; transformers' reader wants one), token 258."""
    tok = byte_tokenizer()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + ["ĠĠ"] + [f"[PAD{i}]" for i in range(len(vocab) + 1, VOCAB)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] * (len(tokens) - 256))
    writer.add_token_merges(["Ġ Ġ"])
    writer.add_bos_token_id(COMMON["bos_token_id"])
    writer.add_eos_token_id(COMMON["eos_token_id"])
