"""A request's worst case in tokens: what it reserves of its tenant's daily budget when it is admitted
(`gateway.gate.reserve_tokens`), settled to what it really used when it ends."""

import json

from sobrio.types.params import SamplingParams


def worst_case_tokens(prompts: list[list[int]], params: list[SamplingParams], max_model_len: int) -> int:
    """The most tokens a request's usage can count: each prompt, and for each of its n sequences max_tokens,
    or what the context leaves when max_tokens is unset (the engine never goes past the context)."""
    total = 0
    for prompt, p in zip(prompts, params, strict=True):
        room = max(0, max_model_len - len(prompt))
        total += len(prompt) + p.n * (room if p.max_tokens is None else min(p.max_tokens, room))
    return total


def remote_worst_case(body, default_max_tokens: int | None) -> int:
    """A remote replica's tokens are not known before it answers: the prompt is bounded by its UTF-8 bytes
    (a byte-level tokenizer's token holds at least one) plus 16 per message for the chat template, the
    completion by max_tokens (or the server's default) for each of its n sequences."""
    max_tokens = body.requested_max_tokens()
    if hasattr(body, "messages"):
        prompt = sum(len(json.dumps(m.model_dump(mode="json")).encode()) + 16 for m in body.messages)
        prompts = 1
    else:
        texts = body.prompts()
        prompt = sum(len(p.encode()) if isinstance(p, str) else len(p) for p in texts)
        prompts = len(texts)
    return prompt + prompts * body.n * (max_tokens if max_tokens is not None else default_max_tokens or 0)
