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
