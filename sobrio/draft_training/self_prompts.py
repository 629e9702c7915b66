"""User requests the target writes itself, for `sobrio train-draft` (Magpie's idea: Xu et al. 2024).

A chat model given its template up to the start of a user turn, and nothing more, samples something a user
might ask it: what it was tuned on, in its own words. Hundreds of these vary far more than a shipped list
can (the 320 shipped prompts are 8 templates over 40 subjects: a head trained on their answers alone
learned them by heart, 97% top-1 on them against 36% on other prompts), and they cost one short sampled
generation each, with the template's prefix computed once (prefix caching).
Nothing is written anywhere but the trained head's folder, and only as its training figures.
"""

from sobrio.errors import ConfigError
from sobrio.types.params import SamplingParams

MARK = "\u2063SOBRIO-USER-TURN\u2063"  # placeholder content; the template's text around it is the turn's frame
MIN_WORDS, MAX_WORDS = 3, 80


def user_turn_frame(tokenizer) -> tuple[str, list[int]]:
    """The template's text before a user turn's content (system prompt included, as the model sees it), and
    the token ids that end a turn (the template's own end marker, and the tokenizer's EOS)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the model has no chat template, so it cannot write a user's turn: train on the "
                          "shipped prompts only (--self-prompts 0)", "--self-prompts")
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False,
                                         add_generation_prompt=False)
    if MARK not in text:
        raise ConfigError("the chat template does not show a user turn's content as given: train on the "
                          "shipped prompts only (--self-prompts 0)", "--self-prompts")
    before, after = text.split(MARK, 1)
    end = after.strip().splitlines()[0] if after.strip() else ""
    ids = tokenizer.encode(end, add_special_tokens=False) if end else []
    stop = ids[:1] if len(ids) == 1 else []
    if tokenizer.eos_token_id is not None:
        stop.append(tokenizer.eos_token_id)
    if not stop:
        raise ConfigError("the chat template's user turn has no single end token, and the tokenizer no EOS: "
                          "train on the shipped prompts only (--self-prompts 0)", "--self-prompts")
    return before, sorted(set(stop))


def self_prompts(llm, count: int, max_tokens: int = 64, seed: int = 0) -> list[str]:
    """`count` distinct requests sampled from the target (temperature 1, top-p 0.95, one seed each): only
    turns that ended by themselves within `max_tokens`, of MIN_WORDS..MAX_WORDS words, no duplicates. Asks
    for a few more than `count` to make up for those dropped; may return fewer, never more."""
    tokenizer = llm.get_tokenizer()
    frame, stop = user_turn_frame(tokenizer)
    prefix = tokenizer.encode(frame, add_special_tokens=False)
    asked = count + count // 4 + 8
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens, seed=seed + i,
                             stop_token_ids=stop) for i in range(asked)]
    outputs = llm.generate([{"prompt_token_ids": prefix}] * asked, params, use_tqdm=True)
    kept, seen = [], set()
    for output in outputs:
        completion = output.outputs[0]
        text = completion.text.strip()
        key = " ".join(text.lower().split())
        if completion.finish_reason == "stop" and MIN_WORDS <= len(key.split()) <= MAX_WORDS and key not in seen:
            seen.add(key)
            kept.append(text)
    return kept[:count]
