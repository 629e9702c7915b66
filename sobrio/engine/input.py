"""Prompts to token ids, and every check a request must pass before it is queued."""

from sobrio.errors import InvalidRequestError
from sobrio.sample.params import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def tokenize(self, prompt: str | list[int] | None) -> list[int]:
        """Text to ids (with the tokenizer's special tokens), or ids checked against the vocabulary."""
        if prompt is None:
            raise InvalidRequestError("prompt is missing", param="prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", param="prompt")
            return self.tokenizer(prompt).input_ids
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {self.vocab_size})", param="prompt")
        return ids

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                        chat_template: str | None = None) -> list[int]:
        """Apply the model's chat template (or the one given) and tokenize the result."""
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequestError("this model has no chat template; use a completion prompt", param="messages")
        if not messages:
            raise InvalidRequestError("messages is empty", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as exc:  # jinja errors: the template rejected the conversation's shape
            raise InvalidRequestError(f"chat template failed: {type(exc).__name__}", param="messages") from None
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Check the context fits; return the output length limit."""
        if num_prompt_tokens >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {num_prompt_tokens} tokens but max_model_len is {self.max_model_len} "
                "(at least one token must be left for the output)", param="prompt")
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise InvalidRequestError(
                f"max_model_len is {self.max_model_len} tokens, but the request asks for "
                f"{num_prompt_tokens + params.max_tokens} ({num_prompt_tokens} in the prompt, "
                f"{params.max_tokens} to generate)", param="max_tokens")
        return params.max_tokens
