"""Hostile and careless clients against a real server, while healthy streams run beside them.

Each poison request of issue 9 gets a 4xx (or is served) without harming the 8 healthy streams; a
property-based fuzz of request bodies finds no 5xx and harms no healthy stream; afterwards every
per-request table of the engine and the server is empty.
"""

import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import ServerProcess, serving

SMOL = "smollm2-135m"
HEALTHY_TOKENS = 24


class HealthyStreams:
    """Streams that must all finish intact (full length, [DONE]) whatever the other clients do."""

    def __init__(self, base_url: str, count: int, repeat: bool):
        self.base_url, self.repeat = base_url, repeat
        self.failures: list[str] = []
        self.finished = 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]

    def __enter__(self) -> "HealthyStreams":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)
        assert not any(t.is_alive() for t in self.threads), "a healthy stream hung"

    def _run(self, i: int) -> None:
        while True:
            try:
                self._one(i)
                self.finished += 1
            except Exception as exc:  # noqa: BLE001 - recorded and asserted by the test
                self.failures.append(f"stream {i}: {type(exc).__name__}: {exc}")
            if not self.repeat or self.stop.is_set():
                return

    def _one(self, i: int) -> None:
        body = {"model": SMOL, "prompt": f"Healthy stream number {i} counts:", "max_tokens": HEALTHY_TOKENS,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{self.base_url}/v1/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200, resp.status_code
            lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]", lines[-1]
        chunks = [json.loads(line) for line in lines[:-1]]
        assert not any("error" in c for c in chunks), chunks
        assert chunks[-1]["usage"]["completion_tokens"] == HEALTHY_TOKENS
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def table_entries(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {line.split("{", 1)[1].split("}", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("sobrio:request_table_entries{")}


def wait_idle_and_assert_empty(server: ServerProcess, model: str = SMOL, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tables = table_entries(server)
        if tables and not any(tables.values()) and server.metric("kv_cache_usage_perc", model) == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"tables not empty once idle: { {k: v for k, v in table_entries(server).items() if v} }")


def assert_error_body(resp: httpx.Response) -> None:
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error


POISON = [
    ("/v1/completions", {"prompt": "hi", "top_k": 2**64}),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**7], "min_tokens": 3}),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}),
    ("/v1/completions", {"prompt": "a\ud800"}),
    ("/v1/completions", {"prompt": "hi", "cache_salt": ""}),
    ("/v1/completions", {"prompt": "hi", "temperature": float("nan")}),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": float("inf")}),
    ("/v1/completions", {"prompt": [[1, 2], [3, 2**70]]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "b\udfff"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 2**40}),
]


def test_poison_requests_beside_healthy_streams(server):
    with HealthyStreams(server.base_url, 8, repeat=False) as healthy:
        time.sleep(0.5)  # the streams are in flight
        for path, body in POISON:
            resp = httpx.post(f"{server.base_url}{path}", content=json.dumps({"model": SMOL, **body}),
                              headers={"content-type": "application/json"}, timeout=60)
            assert resp.status_code == 400, (body, resp.status_code, resp.text)
            assert_error_body(resp)
        # Valid at the edge of the ranges: served, and the second sequence's seed wraps instead of failing.
        resp = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
            "model": SMOL, "prompt": "hi", "n": 2, "seed": 2**64 - 1, "max_tokens": 3, "top_k": 2**31 - 1})
        assert resp.status_code == 200 and len(resp.json()["choices"]) == 2
    assert not healthy.failures, healthy.failures
    assert healthy.finished == 8
    wait_idle_and_assert_empty(server)


# ---- property-based fuzz of request bodies ----

EDGE_INTS = [0, 1, -1, 2, 16, 17, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -(2**63) - 1]
ints = st.one_of(st.integers(-3, 64), st.sampled_from(EDGE_INTS))
floats = st.one_of(st.floats(-3, 3), st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308, 2.0000001]))
texts = st.one_of(st.text(max_size=24), st.sampled_from(["", "a\ud800", "\udfff\x00", "Hello there", "<|im_end|>"]))
json_values = st.recursive(st.none() | st.booleans() | ints | floats | texts,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                           max_leaves=6)
WILD = {  # any of these may hold anything
    "max_tokens": ints, "temperature": floats, "top_p": floats, "top_k": ints, "min_p": floats, "n": ints,
    "seed": ints, "stop": st.one_of(texts, st.lists(texts, max_size=20)), "stop_token_ids": st.lists(ints, max_size=4),
    "min_tokens": ints, "presence_penalty": floats, "frequency_penalty": floats, "repetition_penalty": floats,
    "ignore_eos": json_values, "stream": json_values, "cache_salt": texts, "logprobs": json_values,
    "stream_options": json_values, "user": texts, "skip_special_tokens": json_values, "top_logprobs": ints,
    "max_completion_tokens": ints, "tools": json_values, "echo": json_values, "bogus_field": json_values,
    "messages": json_values, "prompt": json_values, "model": json_values,
}
plain_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=24)
VALID = {  # within range: these requests reach the engine
    "max_tokens": st.integers(1, 12), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 2**31 - 1), "min_p": st.floats(0, 1), "n": st.integers(1, 3),
    "seed": st.integers(-(2**63), 2**64 - 1), "stop": st.lists(plain_text, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3), "min_tokens": st.integers(0, 2),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "ignore_eos": st.booleans(), "stream": st.booleans(),
    "cache_salt": plain_text, "user": plain_text, "skip_special_tokens": st.booleans(),
}
valid_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": plain_text})
valid_chat = st.fixed_dictionaries(
    {"model": st.just(SMOL), "messages": st.lists(valid_message, min_size=1, max_size=3)},
    optional={**VALID, "logprobs": st.booleans()})
valid_completion = st.fixed_dictionaries(
    {"model": st.just(SMOL), "prompt": st.one_of(plain_text, st.lists(st.integers(0, 49151), min_size=1, max_size=6))},
    optional={**VALID, "logprobs": st.integers(0, 5)})


def with_one_wild_field(valid: st.SearchStrategy) -> st.SearchStrategy:
    """A valid body with, half of the time, one field replaced by anything."""
    def mutate(case):
        body, (key, value), keep = case
        return body if keep else {**body, key: value}
    wild = st.sampled_from(sorted(WILD)).flatmap(lambda key: st.tuples(st.just(key), WILD[key]))
    return st.tuples(valid, wild, st.booleans()).map(mutate)


bodies = st.one_of(st.tuples(st.just("/v1/chat/completions"), with_one_wild_field(valid_chat) | json_values),
                   st.tuples(st.just("/v1/completions"), with_one_wild_field(valid_completion) | json_values))


@pytest.fixture(scope="module")
def small_server():
    """A short context bounds the work any fuzzed request can ask for, and a chat that gives no max_tokens
    gets 12 (as the valid ones ask at most): the fuzz is of the bodies, not of long answers."""
    with serving("--model", SMOL, "--max-model-len", "96", "--kv-cache-memory", str(32 << 20),
                 "--default-max-tokens", "12") as srv:
        yield srv


@pytest.fixture(scope="module")
def fuzz_log() -> dict[int, int]:
    return {}


def send(base_url: str, path: str, body) -> int:
    """One fuzzed request: never a 5xx; an error is an OpenAI body; a stream ends in [DONE]."""
    raw = json.dumps(body)  # NaN and infinity go out as the literals a careless client would send
    headers = {"content-type": "application/json"}
    with httpx.stream("POST", f"{base_url}{path}", content=raw, headers=headers, timeout=60) as resp:
        text = "".join(resp.iter_text())
    assert resp.status_code < 500, (resp.status_code, text[:500])
    if resp.status_code >= 400:
        assert_error_body(httpx.Response(resp.status_code, content=text.encode()))
    elif resp.headers["content-type"].startswith("text/event-stream"):
        assert text.rstrip().endswith("data: [DONE]"), text[-300:]
    else:
        assert json.loads(text)["choices"]
    return resp.status_code


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(case=bodies)
def test_fuzzed_bodies(small_server, fuzz_log, case):
    status = send(small_server.base_url, *case)
    fuzz_log[status] = fuzz_log.get(status, 0) + 1


def test_fuzz_reached_the_engine(fuzz_log):
    """The fuzz is worth something only if some of its requests were served, not all refused."""
    print(f"fuzz statuses: {sorted(fuzz_log.items())}")
    assert fuzz_log.get(200, 0) >= 25 and fuzz_log.get(400, 0) >= 25, fuzz_log


def test_fuzz_harmed_no_healthy_stream_and_left_nothing(small_server):
    """The fuzz again, with 8 healthy streams looping beside it; then every table must be empty."""
    fuzz = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))(given(case=bodies)(
        lambda case: None if send(small_server.base_url, *case) else None))
    with HealthyStreams(small_server.base_url, 8, repeat=True) as healthy:
        fuzz()
    assert not healthy.failures, healthy.failures[:5]
    assert healthy.finished >= 8
    assert httpx.get(f"{small_server.base_url}/health").status_code == 200
    wait_idle_and_assert_empty(small_server)
