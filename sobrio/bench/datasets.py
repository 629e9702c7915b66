"""Benchmark prompts: random (exact token lengths), shared-prefix, multi-turn, or a JSONL file."""

import json
import random
from dataclasses import dataclass


@dataclass
class SampleRequest:
    prompt: str | list[int] | None  # completions: text or token ids (exact lengths)
    messages: list[dict] | None  # chat
    prompt_len: int
    output_len: int


def load_tokenizer(name: str):
    """The tokenizer of a model alias, HF folder or .gguf, without loading or preparing its weights: a
    benchmark client only builds prompts and counts tokens, and must not dequantize a model to do it."""
    from transformers import AutoTokenizer

    from sobrio.loader.gguf import gguf_tokenizer
    from sobrio.loader.resolve import resolve_model

    source = resolve_model(name)
    return gguf_tokenizer(source.path) if source.is_gguf else AutoTokenizer.from_pretrained(source.path)


def _lengths(rng: random.Random, mean: int, range_ratio: float) -> int:
    low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def _token_pool(tokenizer) -> list[int]:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    size = min(len(tokenizer), 30000) if tokenizer is not None else 30000
    return [t for t in range(100, size) if t not in special]


def random_dataset(tokenizer, num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   seed: int = 0) -> list[SampleRequest]:
    """Token-id prompts of exact lengths; each starts with a fresh token so no prompt cache can skip them."""
    rng = random.Random(seed)
    pool = _token_pool(tokenizer)
    out = []
    for _ in range(num):
        n = _lengths(rng, input_len, range_ratio)
        ids = [rng.choice(pool) for _ in range(n)]
        out.append(SampleRequest(ids, None, n, _lengths(rng, output_len, range_ratio)))
    return out


def shared_prefix_dataset(tokenizer, num: int, input_len: int, output_len: int, num_groups: int = 4,
                          prefix_len: int = 1000, seed: int = 0) -> list[SampleRequest]:
    """`num_groups` long system prefixes, each shared by its group; questions of `input_len` tokens."""
    rng = random.Random(seed)
    pool = _token_pool(tokenizer)
    prefixes = [[rng.choice(pool) for _ in range(prefix_len)] for _ in range(num_groups)]
    out = []
    for i in range(num):
        ids = prefixes[i % num_groups] + [rng.choice(pool) for _ in range(input_len)]
        out.append(SampleRequest(ids, None, len(ids), output_len))
    return out


def multi_turn_dataset(tokenizer, num: int, input_len: int, output_len: int, turns: int = 4,
                       seed: int = 0) -> list[SampleRequest]:
    """Chat conversations whose every next turn repeats the whole history (a prefix-cache workload)."""
    rng = random.Random(seed)
    words = ["river", "mountain", "cloud", "engine", "garden", "signal", "harbour", "lantern", "orbit", "meadow"]
    out = []
    conversations = max(1, num // turns)
    for c in range(conversations):
        history: list[dict] = []
        for t in range(turns):
            if len(out) >= num:
                break
            question = " ".join(rng.choice(words) for _ in range(input_len))
            history = history + [{"role": "user", "content": f"Conversation {c}, turn {t}: {question}"}]
            out.append(SampleRequest(None, list(history), 0, output_len))
            history = history + [{"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(20))}]
    return out


def jsonl_dataset(path: str, num: int, output_len: int) -> list[SampleRequest]:
    """Lines of {"prompt": ...} or {"messages": [...]}, optionally with "max_tokens"."""
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            out.append(SampleRequest(row.get("prompt"), row.get("messages"), 0, int(row.get("max_tokens", output_len))))
            if len(out) >= num:
                break
    return out
