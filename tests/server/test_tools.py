"""OpenAI tool calling on /v1/chat/completions (server/tool_calls.py), through the official client against the shared
server: round trips (the call, the tool's result as a `tool` message, the final answer) streamed and not, with
`required` and with a named function; arguments that validate against their schema; `auto`; the 400s. With a
135M model the tests check what the grammar guarantees, not what the model chooses. Without a server: the
grammar against the tokenizer, the incremental parser, and the prompt for templates with and without tools."""

import json
import random

import httpx
import jsonschema
import pytest
from llguidance import LLMatcher
from openai import OpenAI, pydantic_function_tool
from pydantic import BaseModel, Field

from sobrio.server import tool_calls

SMOL = "smollm2-135m"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["tz"],
        "properties": {"tz": {"type": "string", "pattern": "^[A-Z][a-z]{2,8}$"}}}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')} of a place",
                                           "parameters": schema}} for name, schema in SCHEMAS.items()]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


class GetTime(BaseModel):
    """The local time in a timezone."""

    tz: str = Field(pattern="^[A-Z][a-z]{2,8}$")


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def assert_valid_call(call, names=tuple(SCHEMAS)) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def test_required_round_trip(client):
    """The call (exactly one: parallel_tool_calls false), its result sent back, then the final answer."""
    first = client.chat.completions.create(model=SMOL, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=64, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_valid_call(choice.message.tool_calls[0])
    messages = [*QUESTION, choice.message,  # the client's own message object, sent back as it came
                {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "22 C, sunny"}]
    final = client.chat.completions.create(model=SMOL, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=6, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length") and not final.choices[0].message.tool_calls
    assert isinstance(final.choices[0].message.content, str)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_max_tokens_is_length_without_markup(client, stream):
    answer = client.chat.completions.create(model=SMOL, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                            max_tokens=4, temperature=0, stream=stream)
    if stream:
        chunks = [c.choices[0] for c in answer if c.choices]
        content = "".join(c.delta.content or "" for c in chunks)
        finish = chunks[-1].finish_reason
    else:
        content, finish = answer.choices[0].message.content or "", answer.choices[0].finish_reason
    assert finish == "length" and "<tool" not in content and "name" not in content


def test_named_function_streamed_round_trip(client):
    """A named function through the client's stream helper (a pydantic tool: strict, parsed arguments): OpenAI's
    deltas (id, type and name first, then argument fragments), reassembled; then the result, streamed back."""
    tool = pydantic_function_tool(GetTime, name="get_time")
    named = {"type": "function", "function": {"name": "get_time"}}
    with client.chat.completions.stream(model=SMOL, messages=[{"role": "user", "content": "Time in Paris?"}],
                                        tools=[tool], tool_choice=named, max_tokens=48, temperature=0) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "get_time"
    assert deltas[0].function.arguments == "" and all(d.id is None for d in deltas[1:])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    call = final.choices[0].message.tool_calls[0]
    assert call.id == deltas[0].id and "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert isinstance(call.function.parsed_arguments, GetTime)
    assert_valid_call(call, ("get_time",))
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_time", "arguments": call.function.arguments}}]}
    messages = [{"role": "user", "content": "Time in Paris?"}, assistant,
                {"role": "tool", "tool_call_id": call.id, "content": "10:30"}]
    stream = client.chat.completions.create(model=SMOL, messages=messages, tools=[tool], tool_choice="none",
                                            max_tokens=6, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks)


def test_auto_gives_text_or_valid_calls(client):
    """`auto`: each answer is either text that is no call, or calls that validate; streamed the same."""
    resp = client.chat.completions.create(model=SMOL, messages=QUESTION, tools=TOOLS, n=4, max_tokens=24,
                                          temperature=1.0, seed=7)
    for choice in resp.choices:
        if choice.message.tool_calls:
            assert choice.finish_reason in ("tool_calls", "length")
            if choice.finish_reason == "tool_calls":
                assert all(assert_valid_call(c) for c in choice.message.tool_calls)
        else:
            assert choice.finish_reason in ("stop", "length")
            assert not choice.message.content.startswith(tool_calls.OPEN)
    streamed = client.chat.completions.create(model=SMOL, messages=QUESTION, tools=TOOLS, max_tokens=24,
                                              temperature=0, stream=True)
    plain = client.chat.completions.create(model=SMOL, messages=QUESTION, tools=TOOLS, max_tokens=24, temperature=0)
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    message = plain.choices[0].message
    if message.tool_calls:
        assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    else:
        assert text == message.content


def _error(resp: httpx.Response) -> dict:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize("body,param,words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_moon"}}}, "tool_choice",
     "get_moon"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "required"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "foo"}}}}}]}, "tools", "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string", "pattern": "(a"}}}]},
     "tools", "tools[0]"),
    ({"tools": []}, "tools", "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "get_weather"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools", "name"),
    ({"tools": TOOLS, "structured_outputs": {"regex": "a+"}}, "structured_outputs", "regex"),
    ({"tools": TOOLS, "messages": [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{not json"}}]}]},
     "messages", "arguments"),
])
def test_bad_tool_requests_are_400s(server, body, param, words):
    resp = httpx.post(f"{server.base_url}/v1/chat/completions",
                      json={"model": SMOL, "messages": QUESTION, **body}, timeout=60)
    error = _error(resp)
    assert error["param"] == param and words in error["message"], error
    if "parameters" in words:
        assert "foo" in error["message"]  # llguidance's own words: the bad type
    ok = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                    json={"model": SMOL, "messages": QUESTION, "max_tokens": 1})
    assert ok.status_code == 200


def test_tool_text_never_logged(server):
    """Tool names, descriptions, schemas, calls and results reach no log line, a refused schema's neither."""
    canary = "CANARY_3d1f_tools"
    tool = {"type": "function", "function": {"name": canary, "description": canary, "parameters": {
        "type": "object", "properties": {canary: {"const": canary}}, "required": [canary]}}}
    history = [*QUESTION, {"role": "assistant", "content": canary, "tool_calls": [{"id": canary, "type": "function",
               "function": {"name": canary, "arguments": json.dumps({canary: canary})}}]},
               {"role": "tool", "tool_call_id": canary, "content": canary}]
    url = f"{server.base_url}/v1/chat/completions"
    ok = httpx.post(url, json={"model": SMOL, "messages": history, "tools": [tool], "tool_choice": "required",
                               "max_tokens": 64, "temperature": 0}, timeout=60)
    assert ok.status_code == 200 and canary in ok.json()["choices"][0]["message"]["tool_calls"][0]["function"][
        "arguments"]
    bad = {**tool, "function": {**tool["function"], "parameters": {"type": canary}}}
    assert httpx.post(url, json={"model": SMOL, "messages": history, "tools": [bad]}, timeout=60).status_code == 400
    assert "CANARY" not in server.log_text().upper()


# ---- no server: the grammar, the parser, the prompt ----

def _accepts(matcher: LLMatcher, tokenizer, text: str) -> bool:
    matcher = matcher.deep_copy()
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


@pytest.fixture(scope="module")
def llg_tokenizer(tokenizer):
    from llguidance.hf import from_tokenizer

    return from_tokenizer(tokenizer)


def _call(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


@pytest.mark.parametrize("choice,parallel,accepted,refused", [
    ("required", False, [_call("get_time", '{"tz":"Paris"}')],
     ["Hi", _call("get_time", '{"tz":"paris"}'), _call("get_time", '{"tz": "Paris"}'),
      _call("get_time", '{"tz":"Paris"}') + "\n" + _call("get_time", '{"tz":"Rome"}')]),
    ("required", True, [_call("get_time", '{"tz":"Paris"}') + "\n" + _call("get_weather",
                                                                              '{"city":"Rome","unit":"celsius"}')],
     [_call("get_weather", '{"city":"Rome"}'), _call("get_moon", "{}")]),
    ("get_weather", True, [_call("get_weather", '{"city":"Rome","unit":"fahrenheit"}')],
     [_call("get_time", '{"tz":"Paris"}'), _call("get_weather", '{"city":"Rome","unit":"kelvin"}')]),
    ("auto", True, ["It is sunny.", "", "<tool", _call("get_time", '{"tz":"Paris"}')],
     ["<tool_call>It is sunny.", _call("get_time", '{"tz":"Paris","x":1}')]),
])
def test_grammar_guarantees_valid_calls(tokenizer, llg_tokenizer, choice, parallel, accepted, refused):
    plan = tool_calls.plan([tool_calls.ToolDefinition.model_validate(t) for t in TOOLS],
                      choice if choice in ("auto", "required") else {"type": "function", "function": {"name": choice}},
                      parallel)
    grammar = LLMatcher.grammar_from_lark(tool_calls.grammar(plan))
    matcher = LLMatcher(llg_tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    for text in accepted:
        assert _accepts(matcher, tokenizer, text), text
    for text in refused:
        assert not _accepts(matcher, tokenizer, text), text


def test_a_function_named_like_a_choice_is_still_named():
    definitions = [tool_calls.ToolDefinition.model_validate({"type": "function", "function": {"name": n}})
                   for n in ("required", "other")]
    plan = tool_calls.plan(definitions, {"type": "function", "function": {"name": "required"}}, True)
    assert (plan.choice, plan.name, plan.parallel) == ("named", "required", False)
    grammar = tool_calls.grammar(plan)
    assert '\\"required\\"' in grammar and "other" not in grammar and "calls: call\n" in grammar


@pytest.mark.parametrize("text", [
    "Just text, no call.",
    _call("get_time", '{"tz":"Pa}</tool_call>ris"}'),  # the closing tag inside a string argument
    _call("get_time", '{"tz":"Paris"}') + "\n" + _call("get_weather", '{"city":"Rome","unit":"celsius"}'),
    _call("get_time", '{"tz":"Par'),  # cut by max_tokens
    '<tool_call>{"name": "get_ti',
])
def test_streamed_deltas_reassemble_to_the_whole_parse(text):
    whole, complete = tool_calls.message(text)
    for seed in range(10):
        rng, parser, content, calls, at = random.Random(seed), tool_calls.ToolCallParser(), "", {}, 0
        while at < len(text):
            step = rng.randint(1, 6)
            delta = tool_calls.stream_delta(parser, text[at:at + step], at + step >= len(text))
            at += step
            content += delta["content"] or ""
            for d in delta.get("tool_calls", []):
                call = calls.setdefault(d["index"], {"id": d.get("id"), "name": d["function"].get("name"),
                                                     "arguments": ""})
                call["arguments"] += d["function"]["arguments"]
        expected = whole.get("tool_calls", [])
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
               [(c["function"]["name"], c["function"]["arguments"]) for c in expected]
        assert (content or None) == whole["content"]
        assert parser.all_complete == complete
    if "Pa}</tool_call>ris" in text:
        assert json.loads(whole["tool_calls"][0]["function"]["arguments"]) == {"tz": "Pa}</tool_call>ris"}


@pytest.mark.parametrize("text,forced", [
    ('<tool_call>{"name": "get_ti', False), ('<tool_call>{"name": "get_ti', True), ("<tool_c", True), ("<", True)])
def test_a_call_cut_before_its_name_leaves_no_markup_as_content(text, forced):
    """max_tokens ran out inside a call's head: no call, no content (the finish_reason says "length")."""
    whole, complete = tool_calls.message(text, forced)
    assert whole["content"] is None and "tool_calls" not in whole and not complete
    parser = tool_calls.ToolCallParser(forced)
    content = "".join(tool_calls.stream_delta(parser, ch, i == len(text) - 1)["content"] or ""
                      for i, ch in enumerate(text))
    assert content == "" and tool_calls.finish_reason("length", parser.all_complete) == "length"


def test_a_complete_call_is_never_reported_as_cut():
    whole, complete = tool_calls.message(_call("get_time", '{"tz":"Paris"}'), forced=True)
    assert complete and tool_calls.finish_reason("length", complete) == "tool_calls"
    assert tool_calls.message("<tool", forced=False)[0]["content"] == "<tool"  # "auto": a text answer may say it


HISTORY = [*QUESTION,
           {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
               "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
TOOL_TEMPLATE = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                 "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                 "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]"
                 "{% endfor %}{% endfor %}")


def test_prompt_for_templates_with_and_without_tools(tokenizer):
    from sobrio.engine.input import InputProcessor

    definitions = [tool_calls.ToolDefinition.model_validate(t) for t in TOOLS]
    plan = tool_calls.plan(definitions, "auto", None)
    messages, given = tool_calls.prompt(HISTORY, definitions, plan, tokenizer.chat_template)  # SmolLM2's: no tools
    assert given is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert json.dumps({"name": "get_weather", "description": "get weather of a place", "parameters": WEATHER}) \
        in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2]["content"] == _call("get_weather", '{"city":"Paris","unit":"celsius"}')
    assert messages[3]["content"] == ('<tool_response>{"name": "get_weather", "content": "22 C"}</tool_response>\n'
                                      '<tool_response>{"name": "get_weather", "content": "sunny"}</tool_response>')
    processor = InputProcessor(tokenizer, 1024, len(tokenizer))
    text = tokenizer.decode(processor.chat_prompt_ids(messages))
    assert "<tool_response>" in text and '"name": "get_time"' in text
    messages, given = tool_calls.prompt(HISTORY, definitions, None, tokenizer.chat_template)  # tool_choice none
    assert given is None and "<tools>" not in messages[0]["content"]
    messages, given = tool_calls.prompt(HISTORY, definitions, plan, TOOL_TEMPLATE)  # a template that takes tools
    assert [t["function"]["name"] for t in given] == ["get_weather", "get_time"]
    text = tokenizer.decode(processor.chat_prompt_ids(messages, chat_template=TOOL_TEMPLATE, tools=given))
    assert text.startswith("[tool get_weather][tool get_time]") and "[call get_weather Paris]" in text
    assert "<tool>22 C<tool>sunny" in text
