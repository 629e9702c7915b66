"""OpenAI request and response shapes (pydantic). Unknown fields are rejected, never silently ignored.

OpenAI fields that change nothing sobrio computes (`IGNORED_FIELDS`: storage, metadata, billing tiers, user
ids, tool options without tools, reasoning effort on models that do not reason) are accepted, and the server
logs their names (never their values) at DEBUG. Fields that would change the answer and are not implemented
are refused with a 400 that says "not supported".
"""

import logging
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sobrio.errors import InvalidRequestError
from sobrio.server.tool_calls import MAX_TOOLS, ToolCallIn, ToolChoice, ToolDefinition
from sobrio.types import params as sampling
from sobrio.types.params import (
    INT32_MAX,
    MAX_STOP_TOKEN_IDS,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
    StructuredOutputsParams,
)

logger = logging.getLogger("sobrio.server")

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Priority = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
# accepted, no effect on what sobrio computes; logged by name at DEBUG (see `ignored_fields`)
IGNORED_FIELDS = ("store", "metadata", "service_tier", "user", "safety_identifier", "prompt_cache_key",
                  "parallel_tool_calls", "reasoning_effort", "prediction")


class StrictModel(BaseModel):
    """Unknown fields are refused by name; NaN and infinity are refused in every float; types are strict (a
    string is never an integer: `"max_tokens": "10"` is a 400; an integer is still a valid float)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False


def ignored_fields(body: BaseModel) -> list[str]:
    """The accepted-but-ignored fields this request set (names only: their values are the user's);
    `parallel_tool_calls` counts only without tools."""
    with_tools = bool(getattr(body, "tools", None))
    return [name for name in IGNORED_FIELDS if name in body.model_fields_set
            and not (with_tools and name == "parallel_tool_calls")]


def log_ignored(names: list[str], request_id: str) -> None:
    """One DEBUG line naming the accepted-but-ignored fields a request set (names only, never values)."""
    if names:
        logger.debug("request %s: ignored field(s) %s (no effect in sobrio)", request_id, ", ".join(names))


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if not bias:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise InvalidRequestError("logit_bias keys must be token ids", param="logit_bias") from None


class JsonSchemaFormat(StrictModel):
    """OpenAI's `response_format.json_schema`: the schema is enforced while decoding, `strict` or not."""

    name: str = Field(default="response", max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")  # `schema` would shadow pydantic's
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only with it")
        return self

    def structured(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema.json_schema)
        return None


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs` request field: one of a JSON schema, a regex, a choice, a Lark/GBNF grammar."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                       json_object=bool(self.json_object))


def given(**fields) -> dict:
    """The sampling fields a request set: those it left unset take SamplingParams' own defaults."""
    return {name: value for name, value in fields.items() if value is not None}


class _SamplingFields(StrictModel):
    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None  # count and length checked by SamplingParams
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = Field(default=None, max_length=sampling.MAX_LOGIT_BIAS)
    # accepted and ignored (IGNORED_FIELDS)
    user: str | None = Field(default=None, max_length=256)
    store: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    # sobrio's own (as vLLM's)
    priority: Priority = 0  # lower first; needs --scheduling-policy priority
    prompt_logprobs: int | None = Field(default=None, ge=0, le=sampling.MAX_LOGPROBS)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # structured output: OpenAI's response_format, or vLLM's structured_outputs (not both)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    def structured(self) -> StructuredOutputsParams | None:
        from_format = self.response_format.structured() if self.response_format else None
        if from_format is not None and self.structured_outputs is not None:
            raise InvalidRequestError("give response_format or structured_outputs, not both",
                                      param="structured_outputs")
        return self.structured_outputs.params() if self.structured_outputs else from_format

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n, **given(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty or None),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            prompt_logprobs=self.prompt_logprobs, logit_bias=logit_bias_ids(self.logit_bias),
            structured_outputs=self.structured(),
        )

    @model_validator(mode="after")
    def _no_streamed_prompt_logprobs(self):
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported with stream=true")  # as vLLM
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, ...: passed to the chat template
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls (its content may be null)
    tool_call_id: str | None = None  # a tool message: the call it answers

    def template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):  # OpenAI content parts: only text is supported
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        role = "system" if self.role == "developer" else self.role
        message = {**(self.model_extra or {}), "role": role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, le=INT32_MAX)
    max_completion_tokens: int | None = Field(default=None, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=sampling.MAX_LOGPROBS)  # --max-logprobs bounds it
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: variables for the chat template
    # tool calling (server/tool_calls.py); parallel_tool_calls is ignored (IGNORED_FIELDS) without tools
    tools: list[ToolDefinition] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # accepted and ignored (IGNORED_FIELDS): no reasoning models, predictions only save time
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    prediction: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's current name), else max_tokens; None: the server decides."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(self.requested_max_tokens(), (self.top_logprobs or 0) if self.logprobs else None)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=SamplingParams.max_tokens, le=INT32_MAX)  # OpenAI's default: 16
    logprobs: int | None = Field(default=None, ge=0, le=sampling.MAX_LOGPROBS)
    echo: bool = False  # the prompt before the completion (and, with logprobs, the prompt's logprobs)
    suffix: str | None = None  # only empty: insertion is not supported

    @model_validator(mode="after")
    def _echo_logprobs_not_streamed(self):
        if self.echo and self.logprobs is not None and self.stream:
            raise ValueError("echo with logprobs is not supported with stream=true")
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            return [[]]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self) -> SamplingParams:
        params = self.sampling_params(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = self.logprobs  # vLLM: echo's logprobs cover the prompt too
        return params


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})


def now() -> int:
    return int(time.time())
