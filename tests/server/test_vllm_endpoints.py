"""vLLM's and OpenAI's other endpoints and request fields, against one small server: /tokenize and
/detokenize, /v1/models/{id}, /ping, /v1/responses (through the official client), OpenAI error bodies for
unknown routes, ignored and refused fields, X-Request-Id, chat_template_kwargs, priority, logit_bias, echo and
prompt_logprobs; structured output (response_format, structured_outputs, bad specs as 400s)."""

import json
import math
from typing import Literal

import httpx
import pytest
from openai import NotFoundError, OpenAI
from pydantic import BaseModel, Field

from sobrio.engine.input import InputProcessor
from sobrio.errors import InvalidRequestError
from tests.server.conftest import SMALL, serving

SMOL = "smollm2-135m"
CANARY = "CANARY-e1b2-heron"  # in prompts whose requests set ignored fields: must reach no log line
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def srv():
    with serving(*SMALL, "--scheduling-policy", "priority", "--log-level", "debug",
                 "--dtype", "float32") as server:
        yield server


@pytest.fixture(scope="module")
def client(srv):
    return OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)


def _post(srv, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{srv.base_url}{path}", json=body, timeout=60, **kwargs)


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_tokenize_and_detokenize_equal_the_tokenizer(srv, tokenizer):
    text = "Tokenize me, then back: naïve café ✓"
    for special in (True, False):
        got = _post(srv, "/tokenize", {"model": SMOL, "prompt": text, "add_special_tokens": special,
                                       "return_token_strs": True}).json()
        ids = tokenizer(text, add_special_tokens=special).input_ids
        assert got == {"count": len(ids), "max_model_len": 512, "tokens": ids,
                       "token_strs": tokenizer.convert_ids_to_tokens(ids)}
        assert _post(srv, "/detokenize", {"model": SMOL, "tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    chat = _post(srv, "/tokenize", {"messages": MESSAGES}).json()  # model optional, as in vLLM
    templated = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer(templated, add_special_tokens=False).input_ids
    assert chat["token_strs"] is None
    _error(_post(srv, "/tokenize", {"model": "nope", "prompt": "x"}), 404)
    assert _error(_post(srv, "/detokenize", {"tokens": [10**8]}), 400)["param"] == "tokens"
    assert _error(_post(srv, "/tokenize", {"prompt": "x", "bogus": 1}), 400)["param"] == "bogus"


def test_chat_template_kwargs_reach_the_template(srv, client, tokenizer):
    with_prompt = _post(srv, "/tokenize", {"messages": MESSAGES}).json()["count"]
    body = {"messages": MESSAGES, "chat_template_kwargs": {"add_generation_prompt": False}}
    without = _post(srv, "/tokenize", body).json()["count"]
    assert without == with_prompt - len(tokenizer("<|im_start|>assistant\n", add_special_tokens=False).input_ids)
    chat = client.chat.completions.create(model=SMOL, messages=MESSAGES, max_tokens=1,
                                          extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert chat.usage.prompt_tokens == without
    _error(_post(srv, "/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}),
           400)
    # a template variable of the request's own reaches the template
    processor = InputProcessor(tokenizer, 512, len(tokenizer))
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    plain = processor.chat_prompt_ids(MESSAGES, chat_template=template)
    greeted = processor.chat_prompt_ids(MESSAGES, chat_template=template, template_kwargs={"greeting": "Hello! "})
    assert greeted == tokenizer("Hello! " + MESSAGES[0]["content"], add_special_tokens=False).input_ids != plain
    with pytest.raises(InvalidRequestError):
        processor.chat_prompt_ids(MESSAGES, template_kwargs={"chat_template": "{{ 1 }}"})


def test_model_by_id_and_ping(srv, client):
    model = client.models.retrieve(SMOL)
    assert model.id == SMOL and model.object == "model"
    with pytest.raises(NotFoundError):
        client.models.retrieve("nope")
    assert _error(httpx.get(f"{srv.base_url}/v1/models/nope"), 404)["code"] == "model_not_found"
    assert httpx.get(f"{srv.base_url}/ping").status_code == 200
    assert httpx.post(f"{srv.base_url}/ping").status_code == 200


def test_responses_round_trip(client):
    kwargs = dict(model=SMOL, instructions="Answer briefly.", input="What is the capital of France?",
                  max_output_tokens=8, temperature=0)
    resp = client.responses.create(**kwargs)
    chat = client.chat.completions.create(model=SMOL, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": kwargs["input"]}])
    assert resp.output_text == chat.choices[0].message.content and resp.output_text
    assert resp.object == "response" and resp.output[0].type == "message" and resp.output[0].role == "assistant"
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")

    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == resp.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == resp.usage.output_tokens

    listed = client.responses.create(model=SMOL, max_output_tokens=4, input=[
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}])
    assert listed.output[0].content[0].type == "output_text"


@pytest.mark.parametrize("body", [
    {"tools": [{"type": "function", "name": "f", "parameters": {}}]},
    {"previous_response_id": "resp_1"},
    {"background": True},
    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
    {"conversation": "conv_1"},
])
def test_responses_refuse_what_they_cannot_honour(srv, body):
    error = _error(_post(srv, "/v1/responses", {"model": SMOL, "input": "hi", **body}), 400)
    assert "not supported" in error["message"]


def test_responses_text_format_is_enforced(srv, client):
    """`text.format` json_schema and json_object through the official client, sampled, streamed and parsed: the
    output validates and the format is echoed; a bad schema is a 400 naming text.format."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 99},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "rank", "sunny"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "city", "schema": schema, "strict": True}

    def check(value: dict) -> None:
        assert set(value) == {"city", "rank", "sunny"} and 1 <= len(value["city"]) <= 12
        assert type(value["rank"]) is int and 1 <= value["rank"] <= 99 and type(value["sunny"]) is bool

    kwargs = dict(model=SMOL, input="Name a city as JSON.", max_output_tokens=60, temperature=1.0,
                  text={"format": fmt})
    resp = client.responses.create(**kwargs)
    assert resp.status == "completed", resp.status
    check(json.loads(resp.output_text))
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "city"
    assert resp.text.format.schema_ == schema
    events = list(client.responses.create(stream=True, **kwargs))
    check(json.loads("".join(e.delta for e in events if e.type == "response.output_text.delta")))
    assert events[-1].type == "response.completed" and events[-1].response.text.format.type == "json_schema"

    class Weather(BaseModel):
        city: str = Field(max_length=12)
        sky: Literal["sunny", "cloudy", "rainy"]
        celsius: int = Field(ge=-40, le=50)

    parsed = client.responses.parse(model=SMOL, input="The weather today:", max_output_tokens=60, temperature=0,
                                    text_format=Weather)
    assert isinstance(parsed.output_parsed, Weather)
    anything = client.responses.create(model=SMOL, input='Reply with {"ok": true}', max_output_tokens=60,
                                       temperature=0, text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(anything.output_text), dict) and anything.text.format.type == "json_object"

    bad = [({"type": "json_schema", "name": "x", "schema": {"type": "foo"}}, "foo", "text.format"),
           ({"type": "json_schema", "name": "x"}, "schema", "text"),
           ({"type": "json_object", "schema": schema}, "schema", "text"),
           ({"type": "xml"}, "type", "text")]
    for body, word, param in bad:
        error = _error(_post(srv, "/v1/responses", {"model": SMOL, "input": "hi", "text": {"format": body}}), 400)
        assert word in error["message"] and error["param"] == param, error
    assert _post(srv, "/v1/responses", {"input": "x", "max_output_tokens": 1}).status_code == 200


def test_unknown_routes_and_methods_get_openai_errors(srv):
    assert _error(httpx.get(f"{srv.base_url}/v1/nope"), 404)["type"] == "invalid_request_error"
    assert _error(httpx.post(f"{srv.base_url}/nope", json={}), 404)
    _error(httpx.delete(f"{srv.base_url}/v1/chat/completions"), 405)
    _error(httpx.get(f"{srv.base_url}/v1/responses"), 405)


def test_ignored_fields_are_accepted_and_logged_by_name(srv):
    ignored = {"store": True, "metadata": {"k": "v"}, "service_tier": "auto", "user": "u1",
               "safety_identifier": "s1", "prompt_cache_key": "p1"}
    chat_only = {"parallel_tool_calls": False, "reasoning_effort": "low",
                 "prediction": {"type": "content", "content": "x"}}
    messages = [{"role": "user", "content": f"Say {CANARY}"}]
    for name, value in {**ignored, **chat_only}.items():
        resp = _post(srv, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, name: value})
        assert resp.status_code == 200, (name, resp.text)
    assert _post(srv, "/v1/completions", {"prompt": CANARY, "max_tokens": 2, **ignored}).status_code == 200
    resp = _post(srv, "/v1/responses", {"input": CANARY, "max_output_tokens": 2, "reasoning": {"effort": "low"},
                                        "parallel_tool_calls": True, "truncation": "disabled", **ignored})
    assert resp.status_code == 200, resp.text
    log = srv.log_text()
    assert "ignored field(s) store, metadata, service_tier, user, safety_identifier, prompt_cache_key" in log
    for name in ["reasoning_effort", "prediction", "parallel_tool_calls", "reasoning"]:
        assert f"ignored field(s) {name}" in log or f", {name}" in log
    assert "CANARY" not in log.upper()


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": MESSAGES, "functions": []}),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}),
    ("/v1/completions", {"prompt": "x", "best_of": 2}),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}),
])
def test_fields_that_would_change_the_answer_are_refused(srv, path, body):
    assert "not supported" in _error(_post(srv, path, body), 400)["message"]


def test_request_id_header_is_echoed(srv):
    sent = _post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": "my-id-42"})
    assert sent.headers["x-request-id"] == "my-id-42"
    own = _post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert own.headers["x-request-id"] == own.json()["id"]
    resp = _post(srv, "/v1/responses", {"input": "x", "max_output_tokens": 1})
    assert resp.headers["x-request-id"] == resp.json()["id"]


def test_priority_logit_bias_echo_and_prompt_logprobs(srv, client, tokenizer):
    assert _post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 2, "priority": -3}).status_code == 200
    forced = tokenizer(" zebra", add_special_tokens=False).input_ids[0]
    biased = _post(srv, "/v1/completions", {"prompt": "One, two,", "max_tokens": 3, "temperature": 0,
                                            "logit_bias": {str(forced): 100}}).json()
    assert biased["choices"][0]["text"] == tokenizer.decode([forced] * 3)
    _error(_post(srv, "/v1/completions", {"prompt": "x", "logit_bias": {"1": 500}}), 400)

    prompt = "The quick brown fox"
    echo = _post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True,
                                          "logprobs": 1}).json()["choices"][0]
    prompt_ids = tokenizer(prompt).input_ids
    assert echo["text"].startswith(prompt) and len(echo["logprobs"]["tokens"]) == len(prompt_ids) + 2
    assert echo["logprobs"]["token_logprobs"][0] is None and echo["logprobs"]["top_logprobs"][0] is None
    assert len(echo["prompt_logprobs"]) == len(prompt_ids)
    streamed = client.completions.create(model=SMOL, prompt=prompt, max_tokens=2, temperature=0, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == echo["text"]

    # the logprob of a sampled token equals its prompt logprob once it is part of the prompt
    first = _post(srv, "/v1/completions", {"prompt": prompt_ids, "max_tokens": 1, "temperature": 0,
                                           "logprobs": 0}).json()["choices"][0]
    token = tokenizer(first["text"], add_special_tokens=False).input_ids[-1]
    scored = _post(srv, "/v1/completions", {"prompt": prompt_ids + [token], "max_tokens": 1,
                                            "prompt_logprobs": 2}).json()["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(prompt_ids) + 1
    last = scored[-1][str(token)]
    assert last["rank"] == 1 and math.isclose(last["logprob"], first["logprobs"]["token_logprobs"][0], abs_tol=1e-3)
    assert all(len(entry) in (2, 3) for entry in scored[1:])  # the prompt's token and the top 2
    chat = _post(srv, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_structured_output_over_http(srv, client):
    """response_format json_schema through the official client (chat), vLLM's structured_outputs on completions,
    and bad specs as 400s that name the problem; the server keeps serving."""
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["colour", "count"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model=SMOL, messages=MESSAGES, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": True}})
    value = json.loads(reply.choices[0].message.content)
    assert reply.choices[0].finish_reason == "stop"
    assert value["colour"] in ("red", "green", "blue") and 0 <= value["count"] <= 9
    assert set(value) == set(schema["required"])

    class Pick(BaseModel):
        colour: Literal["red", "green", "blue"]
        count: int

    parsed = client.chat.completions.parse(model=SMOL, messages=MESSAGES, max_tokens=40, temperature=0,
                                           response_format=Pick).choices[0].message.parsed
    assert isinstance(parsed, Pick)
    choice = _post(srv, "/v1/completions", {"prompt": "Is the sky blue?", "max_tokens": 5, "seed": 1,
                                            "structured_outputs": {"choice": ["yes", "no"]}}).json()
    assert choice["choices"][0]["text"] in ("yes", "no")
    bad = [("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}, "foo"),
           ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(ab"}}, "unclosed group"),
           ("/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": "start: nope"}}, "nope"),
           ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"},
                                "structured_outputs": {"regex": "a"}}, "not both")]
    for path, body, word in bad:
        assert word in _error(_post(srv, path, body), 400)["message"]
    assert _post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200
