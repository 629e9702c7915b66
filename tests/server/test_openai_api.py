"""The OpenAI API through the official client against a real server."""

import asyncio
import time

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from sobrio import SamplingParams

SMOL, GEMMA = "smollm2-135m", "gemma3-270m"


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")


def test_models_lists_both(client):
    assert {m.id for m in client.models.list().data} == {SMOL, GEMMA}


def test_chat_greedy_equals_offline(client, smollm2):
    messages = [{"role": "user", "content": "Name three colours."}]
    resp = client.chat.completions.create(model=SMOL, messages=messages, max_tokens=24, temperature=0)
    offline = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert resp.choices[0].message.content == offline.outputs[0].text
    assert resp.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert resp.usage.completion_tokens == len(offline.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completion_greedy_equals_offline_and_tokenizer_counts(client, smollm2):
    prompt = "The three laws of motion are"
    resp = client.completions.create(model=SMOL, prompt=prompt, max_tokens=20, temperature=0)
    offline = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert resp.choices[0].text == offline.outputs[0].text
    assert resp.usage.prompt_tokens == len(smollm2.get_tokenizer()(prompt).input_ids)
    assert resp.usage.completion_tokens == 20 and resp.choices[0].finish_reason == "length"


@pytest.mark.parametrize("model", [SMOL, GEMMA])
def test_streaming_assembles_to_non_streamed(client, model):
    kwargs = dict(model=model, prompt="A short story about a lighthouse:", max_tokens=30, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == 30


def test_chat_streaming_assembles(client):
    kwargs = dict(model=SMOL, messages=[{"role": "user", "content": "Say hello in French."}], max_tokens=20,
                  temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == full


def test_n_logprobs_stop_seed(client):
    resp = client.completions.create(model=SMOL, prompt="Once upon a time", max_tokens=8, n=2, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1] and resp.choices[0].text == resp.choices[1].text
    lp = client.completions.create(model=SMOL, prompt="Once upon a time", max_tokens=4, logprobs=3, temperature=0)
    assert len(lp.choices[0].logprobs.tokens) == 4 and all(len(t) == 3 for t in lp.choices[0].logprobs.top_logprobs)
    chat = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          logprobs=True, top_logprobs=2, temperature=0)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    full = client.completions.create(model=SMOL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0).choices[0].text
    stop = full.strip()[:2]
    cut = client.completions.create(model=SMOL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    seeded = [client.completions.create(model=GEMMA, prompt="My dog", max_tokens=12, temperature=1.0, seed=5)
              .choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_64_concurrent_streams(server):
    prompts = [f"Write one sentence about the number {i}." for i in range(8)]
    sync = OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
    expected = {p: sync.completions.create(model=SMOL, prompt=p, max_tokens=16, temperature=0).choices[0].text
                for p in prompts}

    async def one(client: AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=SMOL, prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def run_all():
        client = AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(client, prompts[i % 8]) for i in range(64)))

    texts = asyncio.run(run_all())
    assert texts == [expected[prompts[i % 8]] for i in range(64)]


def test_disconnect_frees_blocks(server):
    idle = server.metric("kv_cache_usage_perc", SMOL)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.base_url}/v1/completions",
                         json={"model": SMOL, "prompt": "Tell a very long story.", "max_tokens": 1000,
                               "ignore_eos": True, "stream": True}) as resp:
            for i, _ in enumerate(resp.iter_lines()):
                if i > 4:
                    break
    for _ in range(50):  # 5 s, far less than the 1000 tokens would take: the request was aborted
        if server.metric("num_requests_running", SMOL) == 0:
            break
        time.sleep(0.1)
    assert server.metric("num_requests_running", SMOL) == 0
    assert server.metric("kv_cache_usage_perc", SMOL) == idle


def test_metrics_exposed(server, client):
    client.completions.create(model=SMOL, prompt="Hello", max_tokens=3, temperature=0)
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
                 "prefix_cache_hits", "num_preemptions", "prompt_tokens_total", "generation_tokens_total",
                 "request_success_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket"]:
        assert f"sobrio:{name}" in text, name
    assert 'model_name="smollm2-135m"' in text and 'finished_reason="length"' in text


def test_model_auto_is_routed_and_says_where(client, server):
    """Both models served: "auto" goes through the router; the answer names the model that answered, the
    headers say so with the score, and the ledger row keeps "auto" beside the model that served it."""
    routed = set()
    for question in ("What is the capital of Peru? Answer in one word.", "What is 7 + 2?",
                     "How many grams are in 3 kilograms?", "What is 48 x 97? Answer with the number only."):
        raw = client.completions.with_raw_response.create(model="auto", prompt=f"Question: {question}\nAnswer:",
                                                          max_tokens=8, temperature=0)
        answer = raw.parse()
        assert answer.model == raw.headers["x-sobrio-routed-to"] in (SMOL, GEMMA)
        assert 0.0 <= float(raw.headers["x-sobrio-router-score"]) <= 1.0
        routed.add(answer.model)
        rows = httpx.get(f"{server.base_url}/v1/usage", params={"limit": 5}).json()["data"]
        row = next(r for r in rows if r["request_id"] == answer.id)
        assert (row["requested_model"], row["served_model"]) == ("auto", answer.model)


def test_model_auto_routes_chats_only_to_a_model_with_a_chat_template(client):
    """The base Gemma 3 has no chat template: "auto" once sent it chats it could only refuse (400)."""
    for question in ("What is 48 x 97? Answer with the number only.", "Prove that there are infinitely many primes.",
                     "hi"):
        raw = client.chat.completions.with_raw_response.create(
            model="auto", messages=[{"role": "user", "content": question}], max_tokens=4, temperature=0)
        assert raw.parse().model == raw.headers["x-sobrio-routed-to"] == SMOL
