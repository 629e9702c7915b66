"""Backends of the gateway without a model: the TOML file, the choice of a replica (least outstanding,
prefix affinity, health, regions), and the proxy's failure rules against remote servers mocked at the
transport (a retry before the first byte, a backend's 4xx passed on, a stream cut mid-way)."""

import json
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from sobrio.errors import ConfigError, PermissionDeniedError
from sobrio.gateway.backends import ModelBackends, NoBackendAvailable, RemoteReplica, Replica, prefix_hashes
from sobrio.gateway.config import RemoteSpec, load_gateway_config
from sobrio.gateway.tenants import Limits
from sobrio.server.app import create_app

TOML = """
port = 8123
region = "ITA"
[models.small]
local = true
[[models.small.remote]]
url = "http://10.0.0.7:8000/v1"
region = "France"
api_key_env = "SMALL_KEY"
[[models.big.remote]]
url = "https://api.example.com/v1"
model = "big-2"
kind = "openai"
region = "USA"
joules_per_output_token = 2.0
[router]
small = "small"
large = "big"
threshold = 0.4
[tenant_defaults]
allowed_regions = ["EU"]
requests_per_minute = 60
"""


def test_the_toml_file_describes_models_backends_router_and_tenant_defaults(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(TOML)
    config = load_gateway_config(str(path))
    assert config.local_models == ["small"]
    (small_remote,) = config.models["small"].remotes
    assert small_remote.region == "FRA" and small_remote.model == "small" and small_remote.sends_cache_salt
    assert small_remote.health_url == "http://10.0.0.7:8000/health"
    (big,) = config.models["big"].remotes
    assert big.model == "big-2" and not big.sends_cache_salt and big.health_url == "https://api.example.com/v1/models"
    assert (config.router.small, config.router.large, config.router.threshold) == ("small", "big", 0.4)
    assert config.tenant_defaults == Limits(requests_per_minute=60, allowed_regions=("EU",))
    assert Limits(requests_per_minute=5).or_defaults(config.tenant_defaults) == Limits(5, allowed_regions=("EU",))
    assert load_gateway_config(None).models == {}


def test_the_example_file_in_docs_parses():
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "docs" / "gateway.example.toml"
    config = load_gateway_config(str(example))
    assert config.local_models == ["smollm2-135m"] and len(config.models["gemma3-270m"].remotes) == 2
    assert (config.router.strong_share, config.router.large_usd_per_mtok) == (0.3, 0.3)


@pytest.mark.parametrize("text, message", [
    ("[models.m]\n", "has no backend"),
    ("[[models.m.remote]]\nurl = 'ftp://x'\n", "must start with http"),
    ("[[models.m.remote]]\nurl = 'http://x/v1'\nweight = 2\n", "unknown key(s) weight"),
    ("[[models.m.remote]]\nurl = 'http://x/v1'\nkind = 'tgi'\n", "kind must be one of"),
    ("[[models.m.remote]]\nurl = 'http://x/v1'\nregion = 'Atlantis'\n", "unknown region"),
    ("[tenant_defaults]\nrequests_per_minute = 0\n", "positive integer"),
    ("[router]\nstrong_share = 1.5\n", "strong_share must be in [0, 1]"),
    ("[models\n", "not valid TOML"),
])
def test_a_bad_file_is_a_config_error_that_names_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_gateway_config(str(path))
    assert message in str(exc.value)


def test_the_toml_files_top_level_keys_are_flags_and_its_tables_are_not(tmp_path):
    from sobrio.cli import build_parser
    from sobrio.engine_args import apply_config_file

    path = tmp_path / "gateway.toml"
    path.write_text(TOML)
    serve = build_parser().commands["serve"]
    apply_config_file(serve, str(path))
    args = serve.parse_args(["--config", str(path)])
    assert args.port == 8123 and args.region == "ITA"


class FakeReplica(Replica):
    def __init__(self, name: str, region: str = "FRA", load: int = 0, up: bool = True):
        super().__init__(name, region)
        self.in_flight, self.up = load, up

    @property
    def healthy(self) -> bool:
        return self.up


def tenant(*regions: str):
    return SimpleNamespace(name="t", limits=Limits(allowed_regions=regions or None))


def test_least_outstanding_then_prefix_affinity_within_the_slack():
    a, b = FakeReplica("a", load=3), FakeReplica("b", load=1)
    pool = ModelBackends("m", [a, b], balance_slack=4)
    shared = prefix_hashes("You are a careful assistant. " * 20 + "First question")
    assert pool.choose([]) is b  # no prefix: the least loaded
    assert pool.choose(shared) is b  # first time: least loaded, and b remembers the prefix
    a.in_flight, b.in_flight = 0, 3
    assert pool.choose(prefix_hashes("You are a careful assistant. " * 20 + "Second")) is b  # its prefix, 3 <= 0 + 4
    b.in_flight = 5
    assert pool.choose(shared) is a  # past the slack: balance wins
    assert b.matched(shared) == len(shared) and len(shared) > 5


def test_prefix_hashes_match_up_to_the_first_different_block():
    one, two = prefix_hashes("x" * 200 + "a" * 100), prefix_hashes("x" * 200 + "b" * 100)
    assert one[:3] == two[:3] and one[3] != two[3]
    assert prefix_hashes("short") == []


def test_a_down_replica_is_skipped_and_regions_bound_the_choice():
    fra, usa = FakeReplica("fra", "FRA", load=9), FakeReplica("usa", "USA")
    pool = ModelBackends("m", [fra, usa])
    assert pool.choose([], tenant("EU")) is fra
    fra.up = False
    with pytest.raises(NoBackendAvailable):
        pool.choose([], tenant("EU"))
    assert pool.choose([], tenant()) is usa
    with pytest.raises(PermissionDeniedError) as exc:
        ModelBackends("m", [usa]).choose([], tenant("EU"))
    assert exc.value.code == "region_not_allowed" and "is served in USA" in str(exc.value)


def remote(name: str, handler, **spec) -> RemoteReplica:
    replica = RemoteReplica(RemoteSpec(url=f"http://{name}:8000/v1", model="theirs", **spec))
    replica._clients = [httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url=f"http://{name}:8000/v1/")]
    return replica


def test_health_checks_take_a_replica_out_and_bring_it_back():
    import asyncio

    answers = iter([503, 200])
    replica = remote("r", lambda request: httpx.Response(next(answers)))
    asyncio.run(replica.check())
    assert not replica.healthy
    asyncio.run(replica.check())
    assert replica.healthy


def completion(model: str = "theirs", text: str = "hi") -> dict:
    return {"id": "cmpl-1", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}}


def gateway_with(*replicas: RemoteReplica) -> TestClient:
    app = create_app({})
    app.state.server.gateway.backends.models["m"] = ModelBackends("m", list(replicas))
    return TestClient(app)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def test_a_5xx_or_a_refused_connection_before_the_first_byte_is_retried_once_on_another_replica():
    seen = []

    def broken(request):
        seen.append(("broken", json.loads(request.content)))
        raise httpx.ConnectError("refused", request=request)

    def failing(request):
        seen.append(("failing", None))
        return httpx.Response(500, json={"error": {"message": "boom"}})

    def good(request):
        seen.append(("good", json.loads(request.content)))
        return httpx.Response(200, json=completion())

    a, b = remote("a", broken), remote("b", good)
    b.in_flight = 1  # a is chosen first
    answer = gateway_with(a, b).post("/v1/chat/completions", json=CHAT)
    assert answer.status_code == 200 and answer.json()["model"] == "m", answer.text
    assert [s[0] for s in seen] == ["broken", "good"] and seen[1][1]["model"] == "theirs"
    assert not a.healthy and a.in_flight == 0 and b.in_flight == 1
    both_fail = gateway_with(remote("c", failing), remote("d", failing)).post("/v1/chat/completions", json=CHAT)
    assert both_fail.status_code == 502 and both_fail.json()["error"]["type"] == "server_error"


def test_a_backends_4xx_passes_through_and_its_refusal_of_our_key_is_a_502():
    bad = {"error": {"message": "max_tokens too large", "type": "invalid_request_error", "param": "max_tokens",
                     "code": None}}
    answer = gateway_with(remote("a", lambda r: httpx.Response(400, json=bad))).post("/v1/chat/completions", json=CHAT)
    assert answer.status_code == 400 and answer.json() == bad
    answer = gateway_with(remote("a", lambda r: httpx.Response(401, json=bad))).post("/v1/chat/completions", json=CHAT)
    assert answer.status_code == 502 and "credentials" in answer.json()["error"]["message"]


def sse(*events) -> bytes:
    return b"".join(f"data: {json.dumps(e) if isinstance(e, dict) else e}\n\n".encode() for e in events)


def chunk(text: str | None, usage: dict | None = None) -> dict:
    choices = [] if text is None else [{"index": 0, "delta": {"content": text}, "finish_reason": None}]
    return {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "theirs", "choices": choices,
            "usage": usage}


def events_of(body: str) -> list:
    return [line[6:] for line in body.splitlines() if line.startswith("data: ")]


def test_a_stream_is_relayed_renamed_with_usage_only_when_asked_and_the_backend_always_asked_for_it():
    asked = []
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}

    def handler(request):
        asked.append(json.loads(request.content)["stream_options"])
        return httpx.Response(200, content=sse(chunk("Hel"), chunk("lo"), chunk(None, usage), "[DONE]"),
                              headers={"content-type": "text/event-stream"})

    client = gateway_with(remote("a", handler))
    plain = events_of(client.post("/v1/chat/completions", json={**CHAT, "stream": True}).text)
    assert [json.loads(e)["choices"][0]["delta"]["content"] for e in plain[:-1]] == ["Hel", "lo"]
    assert plain[-1] == "[DONE]" and all("usage" not in json.loads(e) for e in plain[:-1])
    assert all(json.loads(e)["model"] == "m" for e in plain[:-1])
    with_usage = events_of(client.post("/v1/chat/completions", json={
        **CHAT, "stream": True, "stream_options": {"include_usage": True}}).text)
    assert json.loads(with_usage[-2])["usage"] == usage
    assert asked == [{"include_usage": True}] * 2


def test_a_stream_that_breaks_after_its_first_event_ends_with_an_error_event_and_done():
    async def body():
        yield sse(chunk("Hel"))
        raise httpx.ReadError("reset")

    def handler(request):
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    replica = remote("a", handler)
    events = events_of(gateway_with(replica).post("/v1/chat/completions", json={**CHAT, "stream": True}).text)
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == "Hel"
    assert json.loads(events[1])["error"]["type"] == "server_error" and events[2] == "[DONE]"
    assert replica.in_flight == 0 and not replica.healthy
