"""Prompts to token ids, and every check a request must pass before it is queued."""

from sobrio.errors import InvalidRequestError
from sobrio.types.params import SamplingParams


def check_text(text: str, param: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate such as "\\ud800" cannot be encoded)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"{param} is not valid Unicode text (lone surrogate at character {exc.start})",
                                  param=param) from None


# apply_chat_template's own arguments (and what the template gets from them): not for chat_template_kwargs
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "continue_final_message", "tokenize",
    "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "kwargs",
})


class InputProcessor:
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int, max_logprobs: int = 20):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = vocab_size if max_logprobs < 0 else min(max_logprobs, vocab_size)  # --max-logprobs
        # No token covers more characters than its vocabulary string has (x2 for normalizers): text past
        # this length cannot fit the context, so it is refused without spending seconds tokenizing it.
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = 2 * longest * max_model_len

    def tokenize(self, prompt: str | list[int] | None) -> list[int]:
        """Text to ids (with the tokenizer's special tokens), or ids checked against the vocabulary."""
        if prompt is None:
            raise InvalidRequestError("prompt is missing", param="prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", param="prompt")
            return self._encode(prompt, "prompt", add_special_tokens=True)
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        self.check_token_ids(ids, "prompt")
        return ids

    def check_token_ids(self, ids: list[int], param: str) -> None:
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequestError(f"{param} token ids must be integers in [0, {self.vocab_size})", param=param)

    def _encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        check_text(text, param)
        if len(text) > self.max_prompt_chars:
            raise InvalidRequestError(f"{param} has {len(text)} characters, more than a context of "
                                      f"{self.max_model_len} tokens can hold", param=param)
        try:
            return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        except Exception as exc:  # the tokenizer refused the text: the client's input, not a server fault
            raise InvalidRequestError(f"{param} could not be tokenized ({type(exc).__name__})", param=param) from None

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Text to ids as `/tokenize` does it: empty text is allowed, special tokens are the caller's choice."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"{param} must be a string", param=param)
        return self._encode(text, param, add_special_tokens)

    def decode(self, ids: list[int], param: str = "tokens") -> str:
        """Ids to text with special tokens kept (vLLM's /detokenize); ids outside the vocabulary are refused."""
        self.check_token_ids(ids, param)
        return self.tokenizer.decode(ids)

    def token_strs(self, ids: list[int]) -> list[str]:
        """The vocabulary's string of each id (`return_token_strs`)."""
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(ids)]

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                        chat_template: str | None = None, template_kwargs: dict | None = None,
                        add_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]:
        """Apply the model's chat template (or the one given) and tokenize the result. `template_kwargs` (vLLM's
        `chat_template_kwargs`) become variables of the template; as in vLLM they may set
        `add_generation_prompt`, but not the other arguments of `apply_chat_template`. `tools`: OpenAI tool
        definitions, for a template that describes tools itself (server/tool_calls.py decides)."""
        template_kwargs = dict(template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs))
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)}",
                                      param="chat_template_kwargs")
        add_generation_prompt = template_kwargs.pop("add_generation_prompt", add_generation_prompt)
        if not isinstance(add_generation_prompt, bool):
            raise InvalidRequestError("chat_template_kwargs.add_generation_prompt must be a boolean",
                                      param="chat_template_kwargs")
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequestError("this model has no chat template: use /v1/completions, or start the server "
                                      "with --chat-template", param="messages")
        if not messages:
            raise InvalidRequestError("messages is empty", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False,
                tools=tools, **template_kwargs,
            )
        except Exception as exc:  # jinja errors: the template rejected the conversation's shape
            raise InvalidRequestError(f"chat template failed: {type(exc).__name__}", param="messages") from None
        return self._encode(text, "messages", add_special_tokens=add_special_tokens)

    def validate_params(self, params: SamplingParams, cache_salt: str | None) -> None:
        """Checks that need the vocabulary: stop token ids must name real tokens; a salt must not be empty."""
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        self.check_token_ids(list(params.logit_bias or ()), "logit_bias")
        for name in ("logprobs", "prompt_logprobs"):
            wanted = getattr(params, name, None)
            if wanted is not None and wanted > self.max_logprobs:
                raise InvalidRequestError(f"{name} asks for {wanted} log-probabilities per token; this server allows "
                                          f"at most {self.max_logprobs} (--max-logprobs)", param=name)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string", param="cache_salt")
        if cache_salt is not None:
            check_text(cache_salt, "cache_salt")
        for stop in params.stop:
            check_text(stop, "stop")

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
