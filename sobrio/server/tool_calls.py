"""OpenAI tool calling on /v1/chat/completions: the request's shapes, the prompt, the grammar, the parsing.

The call syntax (Hermes-style, as Qwen and Hermes models are trained to write it), one call per line:

    <tool_call>{"name": "get_weather", "arguments": {"city":"Paris"}}</tool_call>

Prompt. A chat template that reads `tools` (Qwen, Hermes) gets the OpenAI tool definitions and
renders them itself, and gets assistant `tool_calls` (arguments as objects) and `tool` messages as they are.
A template that does not (SmolLM2; Gemma 3) gets a system prompt, `SYSTEM_PROMPT`, appended to the first
system message (or sent as one): each function as one JSON line ({"name", "description", "parameters"}) inside
<tools></tools>, then the call syntax above. The history is rewritten into the same format: an assistant's
`tool_calls` become its content (one <tool_call> line each, after its text), and each run of `tool` messages
becomes one user message of lines `<tool_response>{"name": ..., "content": "<the result>"}</tool_response>`.

Grammar (llguidance Lark, enforced while decoding; `grammar`). Each function's `parameters` schema is embedded
with `%json`, compact (no free whitespace). `required`: one call, or 1..n calls separated by "\\n" when
`parallel_tool_calls` is true (the default); a named function: exactly one call of it; `auto`: either a text
answer that does not start with "<tool_call>" (or the `response_format` JSON, if one was given) or call(s) as
with `required`; `none`: no grammar, no tools in the prompt, no parsing. `strict` changes nothing: the schema is
always enforced.

Output. `ToolCallParser` splits the text into content and calls, incrementally (the same code serves streams
and whole answers): each call gets an id `call_<24 hex>`; a stream sends a call's id, type and name (arguments
"") as soon as the name is generated, then argument fragments as they come; `finish_reason` becomes
"tool_calls" when the answer holds calls and all of them are complete.
"""

import dataclasses
import json
import secrets
from typing import Any, Literal

from llguidance import LLMatcher
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sobrio.errors import InvalidRequestError
from sobrio.types.params import SamplingParams, StructuredOutputsParams

MAX_TOOLS = 128  # OpenAI's
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_ARGS_END = "}" + CLOSE  # what follows a call's arguments
_COMPACT = {"whitespace_flexible": False}  # as backend.JSON_OPTIONS: a small model cannot loop on newlines
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: omitted = none

SYSTEM_PROMPT = """# Tools

You may call one or more functions to answer. Each function is described below on one line, as JSON with its \
name, its description and the JSON schema of its arguments:
<tools>
{tools}
</tools>

To call a function, answer with nothing but the call, one call per line, exactly in this form:
<tool_call>{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}</tool_call>
Each result comes back in a user message, in this form:
<tool_response>{{"name": "<function name>", "content": "<the result>"}}</tool_response>
If no function is needed, answer in plain text."""


# ---- request shapes (OpenAI's) ----

class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule; it also keeps names grammar-safe
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the schema is enforced either way


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


ToolChoice = str | dict[str, Any]  # "none", "auto", "required" or a NamedToolChoice: checked by `plan`


class FunctionCallIn(BaseModel):
    """A call an assistant message carries back (what a client got from us, or wrote itself)."""

    model_config = ConfigDict(extra="ignore")  # a streamed call reassembled by a client may carry more
    name: str
    arguments: str


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


# ---- the plan: which calls the answer may or must hold ----

@dataclasses.dataclass(frozen=True)
class ToolPlan:
    functions: dict[str, dict]  # name -> its arguments' JSON schema
    choice: str  # "auto", "required" or "named"
    parallel: bool
    name: str | None = None  # the function a named choice names


def plan(tools: list[ToolDefinition] | None, choice: ToolChoice | None, parallel: bool | None) -> ToolPlan | None:
    """The request's tool plan (None: no tools, or `tool_choice` "none"); a 400 for a choice that names no tool,
    a choice without tools, two tools of one name, or a parameters schema llguidance cannot compile."""
    if not tools:
        if choice is not None:
            raise InvalidRequestError("tool_choice is only allowed when tools are given", param="tool_choice")
        return None
    functions = {}
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in functions:
            raise InvalidRequestError(f"two tools are named {name!r}", param="tools")
        functions[name] = _checked_schema(tool.function.parameters, i)
    choice, name = _choice("auto" if choice is None else choice)
    if choice == "none":
        return None
    if name is not None and name not in functions:
        raise InvalidRequestError(f"tool_choice names function {name!r}, which is not among the tools",
                                  param="tool_choice")
    return ToolPlan(functions, choice, parallel is not False and name is None, name)


def _choice(choice: ToolChoice) -> tuple[str, str | None]:
    """("none" | "auto" | "required", None), or ("named", the function's name)."""
    if isinstance(choice, str) and choice in ("none", "auto", "required"):
        return choice, None
    try:
        return "named", NamedToolChoice.model_validate(choice).function.name
    except ValidationError:
        raise InvalidRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                  '"function": {"name": ...}}', param="tool_choice") from None


def _checked_schema(schema: dict | None, index: int) -> dict:
    """The arguments' schema, compact, after llguidance has compiled it alone (its message names the problem)."""
    schema = _NO_PARAMETERS if schema is None else schema
    options = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
    schema = {**schema, "x-guidance": {**options, **_COMPACT}}
    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema))
    except (ValueError, TypeError) as exc:
        raise _bad_schema(index, str(exc)) from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        raise _bad_schema(index, messages[0] if messages else "cannot be compiled")
    return schema


def _bad_schema(index: int, why: str) -> InvalidRequestError:
    why = " ".join(why.split())[:500]
    return InvalidRequestError(f"tools[{index}].function.parameters is not a usable JSON schema: {why}",
                               param="tools")


# ---- the grammar ----

def grammar(p: ToolPlan, answer_schema: str | None = None) -> str:
    """The Lark grammar of what the answer may be (see the module docstring); `answer_schema`: the JSON schema
    a text answer must follow under `auto` (from response_format)."""
    names = [p.name] if p.name is not None else list(p.functions)
    lines = ["%llguidance {}"]
    if p.choice == "auto":
        lines.append("start: answer | calls")
        lines.append(f"answer: %json {answer_schema}" if answer_schema else "answer: TEXT")
        lines.append(r"TEXT: /(?s:.*)/ & ~/<tool_call>(?s:.*)/")
    else:
        lines.append("start: calls")
    lines.append('calls: call ("\\n" call)*' if p.parallel else "calls: call")
    lines.append("call: " + " | ".join(f"fn_{i}" for i in range(len(names))))
    for i, name in enumerate(names):
        head = json.dumps(f'{OPEN}{{"name": "{name}", "arguments": ')  # Lark literals are JSON strings
        lines.append(f"fn_{i}: {head} args_{i} {json.dumps(_ARGS_END)}")
        lines.append(f"args_{i}: %json {json.dumps(p.functions[name])}")
    return "\n".join(lines) + "\n"


def with_tool_grammar(params: SamplingParams, p: ToolPlan | None) -> SamplingParams:
    """The sampling parameters with the tool grammar in place of the structured output. A JSON response_format
    constrains the text answer of `auto` (and nothing else: a required call is no text); a regex, choice or
    grammar cannot be combined with tools (400)."""
    if p is None:
        return params
    answer = None
    if params.structured_outputs is not None:
        kind, spec = params.structured_outputs.spec
        if kind not in ("json", "json_object"):
            raise InvalidRequestError(f"structured output {kind} cannot be combined with tools",
                                      param="structured_outputs")
        answer = _answer_schema(spec if kind == "json" else '{"type": "object"}')
    return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(grammar=grammar(p, answer)))


def _answer_schema(text: str) -> str:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError:
        schema = None
    if not isinstance(schema, dict):
        raise InvalidRequestError("the response_format schema must be a JSON object", param="response_format")
    return json.dumps({**schema, "x-guidance": _COMPACT})


# ---- the prompt ----

def prompt(messages: list[dict], tools: list[ToolDefinition] | None, p: ToolPlan | None,
           template: str | None) -> tuple[list[dict], list[dict] | None]:
    """The messages for the chat template, and the `tools` to give it (None: it is not given any)."""
    from sobrio.config.chat_template import template_describes_tools

    if template_describes_tools(template):
        definitions = [t.model_dump(exclude_none=True) for t in tools] if p is not None else None
        return [_arguments_as_objects(m) for m in messages], definitions
    messages = _history_as_text(messages)
    if p is not None:
        messages = _with_system_prompt(messages, tools)
    return messages, None


def _arguments_as_objects(message: dict) -> dict:
    """Tool-aware templates write arguments with `tojson`: they expect objects, not JSON text (as vLLM does)."""
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c["function"], "arguments": _arguments(c)}} for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _arguments(call: dict) -> Any:
    try:
        return json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:
        raise InvalidRequestError("a tool call's function.arguments is not JSON", param="messages") from None


def _history_as_text(messages: list[dict]) -> list[dict]:
    """Assistant tool calls and tool results in the documented text format, for a template that knows neither;
    consecutive tool results become one user message (templates that alternate roles require it)."""
    names = {}  # tool_call_id -> function name
    out: list[dict] = []
    results_at = None  # the index in `out` of the user message holding the current run of tool results
    for message in messages:
        if message["role"] != "tool":
            results_at = None
            if message.get("tool_calls"):
                names.update({c["id"]: c["function"]["name"] for c in message["tool_calls"]})
                message = _calls_as_text(message)
            out.append(message)
            continue
        name = names.get(message.get("tool_call_id")) or message.get("name") or ""  # `name`: older clients'
        line = _response_line(name, message["content"])
        if results_at is None:
            results_at = len(out)
            out.append({"role": "user", "content": line})
        else:
            out[results_at]["content"] += "\n" + line
    return out


def _calls_as_text(message: dict) -> dict:
    lines = [message["content"]] if message.get("content") else []
    for call in message["tool_calls"]:
        arguments = json.dumps(_arguments(call), separators=(",", ":"), ensure_ascii=False)
        lines.append(f'{OPEN}{{"name": {json.dumps(call["function"]["name"])}, "arguments": {arguments}}}{CLOSE}')
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": "\n".join(lines)}


def _response_line(name: str, content: str) -> str:
    body = json.dumps({"name": name, "content": content}, ensure_ascii=False)
    return f"<tool_response>{body}</tool_response>"


def _with_system_prompt(messages: list[dict], tools: list[ToolDefinition]) -> list[dict]:
    lines = "\n".join(json.dumps({"name": t.function.name, "description": t.function.description or "",
                                  "parameters": t.function.parameters or _NO_PARAMETERS}, ensure_ascii=False)
                      for t in tools)
    text = SYSTEM_PROMPT.format(tools=lines)
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        content = f"{first['content']}\n\n{text}" if first["content"] else text
        return [{**first, "content": content}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# ---- the output ----

def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class ToolCallParser:
    """Splits generated text into content and tool calls as it arrives. The grammar guarantees the answer is
    either text or calls, so the first characters decide; a call's arguments end at the first `}</tool_call>`
    before which the text is complete JSON (a string argument may itself contain `}</tool_call>`)."""

    def __init__(self, forced: bool = False):
        self.forced = forced  # tool_choice "required" or a named function: the answer is calls, never text
        self.buffer = ""
        self.mode = "start"  # "start" (undecided), "text", "head" (before a call's name), "arguments"
        self.calls: list[dict] = []  # OpenAI tool calls, arguments as text so far
        self.sent = 0  # characters of the current call's arguments already handed out
        self.complete = 0  # calls whose arguments are complete

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """More generated text -> (content to send, tool-call deltas to send). `final`: no more text comes."""
        self.buffer += text
        content, deltas = "", []
        while True:
            if self.mode == "start":
                if self.buffer.startswith(OPEN):
                    self.mode = "head"
                elif OPEN.startswith(self.buffer) and not final:
                    return content, deltas
                elif OPEN.startswith(self.buffer) and self.buffer and self.forced:
                    self.mode = "head"  # a forced call cut inside its opening tag
                else:
                    self.mode = "text"
            if self.mode == "text":
                content, self.buffer = content + self.buffer, ""
                return content, deltas
            progressed = self._head(deltas) if self.mode == "head" else self._arguments(deltas, final)
            if not progressed:
                if final and self.mode == "head":
                    self.buffer = ""  # a call cut before its name: no call, and never its markup as content
                return content, deltas

    def _head(self, deltas: list[dict]) -> bool:
        """Start the next call once its name is complete."""
        start = self.buffer.lstrip("\n")
        prefix = OPEN + '{"name": "'
        end = start.find('", "arguments": ', len(prefix))
        if not start.startswith(prefix) or end < 0:
            return False
        name = start[len(prefix):end]
        call = {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
        deltas.append({"index": len(self.calls), **call, "function": {"name": name, "arguments": ""}})
        self.calls.append(call)
        self.buffer = start[end + len('", "arguments": '):]
        self.mode, self.sent = "arguments", 0
        return True

    def _arguments(self, deltas: list[dict], final: bool) -> bool:
        """Hand out the current call's arguments up to where `}</tool_call>` might begin; finish it at its end."""
        end = _arguments_end(self.buffer)
        complete = end is not None
        if not complete:
            end = _cut_arguments_end(self.buffer) if final else len(self.buffer) - len(_ARGS_END) + 1
        if end > self.sent:
            fragment = self.buffer[self.sent:end]
            self.calls[-1]["function"]["arguments"] += fragment
            deltas.append({"index": len(self.calls) - 1, "function": {"arguments": fragment}})
            self.sent = end
        if not complete:
            self.buffer = "" if final else self.buffer
            return False
        self.complete += 1
        self.buffer = self.buffer[end + len(_ARGS_END):]
        self.mode = "head"
        return True

    @property
    def all_complete(self) -> bool:
        return bool(self.calls) and self.complete == len(self.calls)


def _arguments_end(text: str) -> int | None:
    """Where the arguments end: the first `}</tool_call>` before which the text is complete JSON."""
    at = text.find(_ARGS_END)
    while at >= 0:
        if _is_json(text[:at]):
            return at
        at = text.find(_ARGS_END, at + 1)
    return None


def _cut_arguments_end(text: str) -> int:
    """A cut answer: the arguments, less a started `}</tool_call>` after complete JSON."""
    for k in range(len(_ARGS_END) - 1, 0, -1):
        if text.endswith(_ARGS_END[:k]) and _is_json(text[:-k]):
            return len(text) - k
    return len(text)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def message(text: str, forced: bool = False) -> tuple[dict, bool]:
    """A whole answer as an OpenAI assistant message, and whether every call in it is complete. A call cut
    before its name (max_tokens) leaves no call and no content: its finish_reason says "length"."""
    parser = ToolCallParser(forced)
    content, _ = parser.feed(text, final=True)
    if not parser.calls:
        return {"role": "assistant", "content": content if parser.mode == "text" else None}, False
    return {"role": "assistant", "content": content or None, "tool_calls": parser.calls}, parser.all_complete


def stream_delta(parser: ToolCallParser, text: str, finished: bool) -> dict:
    """One chunk's delta: content, tool-call deltas, or both (a held-back "<tool_c..." prefix sends nothing)."""
    content, calls = parser.feed(text, final=finished)
    delta: dict = {"content": content or None}
    if calls:
        delta["tool_calls"] = calls
    return delta


def finish_reason(reason: str | None, has_complete_calls: bool) -> str | None:
    """OpenAI's "tool_calls" for an answer that ended with its calls all complete, also when max_tokens ran
    out right after the last one: a complete call is never reported as cut ("length")."""
    return "tool_calls" if reason in ("stop", "length") and has_complete_calls else reason
