"""Tiny random-weight checkpoints of each supported family, written by transformers itself at test time
(2 layers, hidden 64, float32), with a small word-level tokenizer: nothing is downloaded."""

import functools
from pathlib import Path

import torch

VOCAB = 512
WINDOW = 24  # sliding window of the tiny windowed models: the test prompts are several times longer
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=VOCAB, max_position_embeddings=512, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                short_factor=[1.0, 1.1, 1.2, 1.5], long_factor=[2.0, 3.0, 4.0, 6.0],
                original_max_position_embeddings=256)  # the tests' context: the short factors

# Phi-3 past `original_max_position_embeddings`: the long factors (equal to transformers for prompts past it)
PHI3_LONG = ("phi3", dict(rope_parameters={**LONGROPE, "original_max_position_embeddings": 64},
                          original_max_position_embeddings=64, max_position_embeddings=512))
# family id -> (model_type, config fields beyond BASE)
FAMILIES = {
    "llama-llama3-rope": ("llama", dict(rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                                             low_freq_factor=1.0, high_freq_factor=4.0,
                                                             original_max_position_embeddings=64))),
    "mistral-window": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2-window-bias": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3-qk-norm": ("qwen3", dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                         original_max_position_embeddings=128))),
    "phi3-longrope-partial": ("phi3", dict(sliding_window=WINDOW, rope_parameters=LONGROPE,
                                           original_max_position_embeddings=256, max_position_embeddings=1024)),
    "gemma2-softcap": ("gemma2", dict(sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                      final_logit_softcapping=3.0)),
    "glm4-partial-rotary": ("glm4", dict(attention_bias=True)),
}
EXHAUSTIVE_FAMILIES = {
    "llama-linear-rope": ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "llama-dynamic-rope": ("llama", dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))),
    "gemma3-window": ("gemma3_text", dict(sliding_window=WINDOW, query_pre_attn_scalar=16)),
}


def write_checkpoint(folder: Path, model_type: str, fields: dict, seed: int = 0, **save_kwargs) -> Path:
    """A random-weight checkpoint of `model_type` and a word-level tokenizer in `folder`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**BASE, **fields})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    spread_norms(model, model_type)
    if fields.get("attn_logit_softcapping"):
        sharpen_attention(model)
    model.save_pretrained(folder, **save_kwargs)
    tokenizer().save_pretrained(folder)
    return folder


def spread_norms(model: torch.nn.Module, model_type: str) -> None:
    """Norm weights away from 1 and 0 (random-weight checkpoints leave them at their init), so a wrong norm
    (Gemma's 1 + w) shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5) if model_type.startswith("gemma") else param.uniform_(0.5, 1.5)


def sharpen_attention(model: torch.nn.Module, factor: float = 8.0) -> None:
    """Query and key weights `factor` times their init, so attention scores reach several units instead of
    hundredths: an attention softcap of a few units then bends them (at init it changed no greedy token, and
    a backend that skipped it passed)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(factor)


@functools.cache
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def prompt(length: int, seed: int = 1) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=generator).tolist()


def hf_greedy(folder: Path, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """transformers' greedy continuation of one prompt (float32), stopping at EOS as the engine does (or not)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if ignore_eos:
        model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             top_p=None, top_k=None, temperature=None)
    return out[0, len(prompt_ids):].tolist()
