"""SamplingParams, in vLLM's names; validated on construction so bad input fails before it queues.

Every field is checked at the edge of its range, not only its sign: integers must fit the engine's
types (a 2^64 `top_k` overflowed the tensor that holds it, a 2^70 `seed` the generator), floats must be
finite, token ids non-negative (the vocabulary bound is checked where the vocabulary is known).
"""

import json
import math
from dataclasses import dataclass, field
from typing import Any

from sobrio.errors import InvalidRequestError

_EPS = 1e-5
INT32_MAX = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries; OpenAI allows -100..100 per token
MAX_LOGPROBS = 1 << 20  # a bound on the type only: the engine refuses more than --max-logprobs (default 20)


MAX_GRAMMAR_CHARS = 1 << 20  # a schema, regex or grammar; the body limit (4 MiB) bounds it too
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output (vLLM's names): exactly one of a JSON schema (`json`, a dict or its JSON text),
    a `regex`, a `choice` of strings, a Lark (or GBNF) `grammar`, or `json_object` (any JSON object).

    Checked for shape here; the schema, regex or grammar itself is checked by the front before queuing
    (`sobrio.structured.edge.GrammarGate`), and compiled by the engine core."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidRequestError("structured output takes exactly one of json, regex, choice, grammar, "
                                      f"json_object; got {', '.join(given) or 'none'}", param="structured_outputs")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequestError("structured output json must be a JSON schema (an object or its text)",
                                      param="structured_outputs")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidRequestError(f"structured output {name} must be a string", param="structured_outputs")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice or len(self.choice) > MAX_CHOICES
                    or not all(isinstance(c, str) for c in self.choice)):
                raise InvalidRequestError(f"structured output choice must be 1 to {MAX_CHOICES} strings",
                                          param="structured_outputs")
            object.__setattr__(self, "choice", list(self.choice))
        if len(self.spec[1]) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(f"structured output spec is longer than {MAX_GRAMMAR_CHARS} characters",
                                      param="structured_outputs")

    @property
    def spec(self) -> tuple[str, str]:
        """(kind, text): a hashable key of what constrains the output (the compile cache's key)."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)  # key order is output order
            return "json", text
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json_object", ""


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off; larger than the vocabulary means the whole vocabulary
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n log-probabilities per output token
    prompt_logprobs: int | None = None  # top-n log-probabilities per prompt token (vLLM's); None: none
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice or grammar
    # the LoRA adapter it runs with (a loader.lora.LoRARequest, set by the front from the model name; None:
    # the base model): it crosses to the engine core with the parameters, and keys the prefix cache
    lora_request: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise InvalidRequestError("stop must be a string or a list of strings", param="stop")
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise InvalidRequestError("logit_bias must map token ids to numbers", param="logit_bias")
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidRequestError("structured_outputs must be a StructuredOutputsParams",
                                      param="structured_outputs")
        if self.top_k == -1:
            self.top_k = 0
        self._validate_types()
        self._validate_ranges()

    def _validate_types(self) -> None:
        ints = {"n": self.n, "top_k": self.top_k, "min_tokens": self.min_tokens, "seed": self.seed,
                "max_tokens": self.max_tokens, "logprobs": self.logprobs, "prompt_logprobs": self.prompt_logprobs}
        for name, value in ints.items():
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise InvalidRequestError(f"{name} must be an integer", param=name)
        floats = {"temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p,
                  "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                  "repetition_penalty": self.repetition_penalty}
        for name, value in floats.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be a finite number", param=name)
        if not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("stop must be a string or a list of strings", param="stop")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative integers", param="stop_token_ids")
        for token_id, bias in (self.logit_bias or {}).items():
            if (not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0
                    or not isinstance(bias, (int, float)) or isinstance(bias, bool) or not math.isfinite(bias)):
                raise InvalidRequestError("logit_bias must map token ids to finite numbers", param="logit_bias")

    def _validate_ranges(self) -> None:
        checks = [
            (1 <= self.n <= 256, "n", f"n must be in [1, 256], got {self.n}"),
            (0 <= self.temperature <= 100, "temperature", f"temperature must be in [0, 100], got {self.temperature}"),
            (0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.top_k <= INT32_MAX, "top_k", f"top_k must be -1, 0 or in [1, {INT32_MAX}]"),
            (0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
            (0 < self.repetition_penalty <= 100, "repetition_penalty", "repetition_penalty must be in (0, 100]"),
            (self.seed is None or SEED_MIN <= self.seed <= SEED_MAX, "seed",
             f"seed must be in [{SEED_MIN}, {SEED_MAX}]"),
            (self.max_tokens is None or 1 <= self.max_tokens <= INT32_MAX, "max_tokens",
             f"max_tokens must be in [1, {INT32_MAX}], got {self.max_tokens}"),
            (0 <= self.min_tokens <= INT32_MAX, "min_tokens", f"min_tokens must be in [0, {INT32_MAX}]"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "min_tokens must not exceed max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"logprobs must be in [0, {MAX_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]"),
            (len(self.logit_bias or ()) <= MAX_LOGIT_BIAS, "logit_bias",
             f"at most {MAX_LOGIT_BIAS} logit_bias entries"),
            (all(-100 <= b <= 100 for b in (self.logit_bias or {}).values()), "logit_bias",
             "logit_bias values must be in [-100, 100]"),
            (len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings"),
            (all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop), "stop",
             f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters"),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
             f"at most {MAX_STOP_TOKEN_IDS} stop token ids"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)

    def child_seed(self, index: int) -> int | None:
        """The seed of the index-th of n sequences: seed + index, wrapped into the generator's range."""
        return None if self.seed is None else (self.seed + index) % (SEED_MAX + 1)

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
