"""A gateway of remote backends only (`sobrio serve --config gateway.toml`) in front of two real sobrio
replicas on 127.0.0.1, through the official `openai` client: both replicas take requests, a shared prompt
prefix goes back to the replica that has it cached, a tenant's salt reaches the replicas' prefix caches, an
EU-only tenant is never served outside the EU (403 when only a US backend serves the model), a replica
killed mid-run fails no request that had not started streaming, and no prompt text is kept anywhere."""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from sobrio.gateway.tenants import Limits, TenantStore
from tests.server.conftest import SMALL, ServerProcess, serving, wait_until
from tests.server.test_gateway import _files_written_since

CANARY = "qx9gatewaycanary"
OPERATOR = "operator-key-for-backend-tests"
REPLICA_KEY = "replica-key-for-tests"
KEY_ENV = "SOBRIO_TEST_REPLICA_KEY"
SYSTEM = "You are a terse assistant for a travel agency. Answer in one short sentence, never more. " * 3


@dataclass
class Setup:
    gateway: ServerProcess
    replicas: list[ServerProcess]
    db: Path
    keys: dict[str, str]

    def client(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway.base_url}/v1", api_key=self.keys[tenant], max_retries=0)

    def rows(self, tenant: str) -> list[dict]:
        answer = httpx.get(f"{self.gateway.base_url}/v1/usage", params={"limit": 1000},
                           headers={"Authorization": f"Bearer {self.keys[tenant]}"})
        assert answer.status_code == 200, answer.text
        return answer.json()["data"]


def start_replicas(folder: Path) -> list[ServerProcess]:
    """Two replicas at once (each its own database and operator key)."""
    args = [(*SMALL, "--db", str(folder / f"replica{i}.db"), "--api-key", REPLICA_KEY) for i in range(2)]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(ServerProcess, *a) for a in args]
    started = [f.result() for f in futures if f.exception() is None]
    if len(started) < 2:
        for srv in started:
            srv.stop()
        raise next(f.exception() for f in futures if f.exception() is not None)
    return started


def gateway_toml(replicas: list[ServerProcess]) -> str:
    remote = [f'[[models.smollm2-135m.remote]]\nurl = "{r.base_url}/v1"\napi_key_env = "{KEY_ENV}"\n'
              f'region = "{region}"\n' for r, region in zip(replicas, ("FRA", "DEU"))]
    return "".join(remote) + (f'[[models.us-smollm2.remote]]\nurl = "{replicas[0].base_url}/v1"\n'
                              f'model = "smollm2-135m"\napi_key_env = "{KEY_ENV}"\nregion = "USA"\n')


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("backends")
    store = TenantStore(folder / "gateway.db")
    keys = {}
    for name, limits in {"acme": Limits(), "globex": Limits(), "in-eu": Limits(allowed_regions=("EU",))}.items():
        store.create_tenant(name, limits)
        keys[name] = store.create_key(name)[1]
    store.close()
    replicas = start_replicas(folder)
    (folder / "gateway.toml").write_text(gateway_toml(replicas))
    os.environ[KEY_ENV] = REPLICA_KEY
    try:
        with serving("--config", str(folder / "gateway.toml"), "--db", str(folder / "gateway.db"),
                     "--api-key", OPERATOR, "--log-level", "debug") as gateway:
            yield Setup(gateway, replicas, folder / "gateway.db", keys)
    finally:
        os.environ.pop(KEY_ENV, None)
        for srv in replicas:
            srv.stop()
            os.unlink(srv.log.name)


def ask(client: openai.OpenAI, question: str, model: str = "smollm2-135m", **kwargs):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return client.chat.completions.create(model=model, messages=messages, temperature=0,
                                          max_tokens=kwargs.pop("max_tokens", 4), **kwargs)


def test_a_shared_prefix_returns_to_its_replica_and_distinct_prompts_spread(setup):
    acme = setup.client("acme")
    for city in ("Rome", "Paris", "Berlin", "Lyon"):
        answer = ask(acme, f"{CANARY} Best month to visit {city}?")
        assert answer.model == "smollm2-135m" and answer.choices[0].message.content
    rows = setup.rows("acme")[:4]
    assert len({r["backend"] for r in rows}) == 1, rows
    assert all(r["cached_tokens"] > 0 for r in rows[:3]), rows  # the three later ones hit the first's prefix
    assert all(r["energy_source"] == "estimate" and r["energy_j"] > 0 and r["co2_g"] > 0 for r in rows)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: acme.completions.create(model="smollm2-135m", prompt=f"{i} {CANARY}",
                                                        max_tokens=24, extra_body={"ignore_eos": True}), range(8)))
    spread = {r["backend"] for r in setup.rows("acme")[:8]}
    assert len(spread) == 2, spread  # least outstanding: both replicas took some


def test_a_tenants_salt_reaches_the_replicas_prefix_caches(setup):
    question = f"{CANARY} Which museum first in Madrid?"
    ask(setup.client("acme"), question)
    assert ask(setup.client("acme"), question).usage.prompt_tokens_details.cached_tokens > 0
    other = ask(setup.client("globex"), question, extra_body={"cache_salt": "anything"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_an_eu_tenant_is_never_served_outside_the_eu(setup):
    eu = setup.client("in-eu")
    with pytest.raises(openai.PermissionDeniedError) as exc:
        ask(eu, f"{CANARY} hi", model="us-smollm2")
    assert exc.value.body["code"] == "region_not_allowed" and "USA" in exc.value.body["message"]
    assert ask(eu, f"{CANARY} hi").choices[0].message.content
    assert ask(setup.client("acme"), f"{CANARY} hi", model="us-smollm2").model == "us-smollm2"
    assert {r["backend"] for r in setup.rows("in-eu") if r["status"] == 200} <= {
        f"remote:127.0.0.1:{r.port}" for r in setup.replicas}


def one_request(client: openai.OpenAI, i: int) -> tuple[str, int]:
    """("ok", chunks) or ("failed", chunks received before the failure)."""
    extra = {"ignore_eos": True}
    chunks = 0
    try:
        if i % 2:
            ask(client, f"{CANARY} request {i}", max_tokens=48, extra_body=extra)
            return "ok", 0
        for _ in ask(client, f"{CANARY} request {i}", max_tokens=48, extra_body=extra, stream=True):
            chunks += 1
        return "ok", chunks
    except openai.APIError:
        return "failed", chunks


def test_zz_a_replica_killed_mid_run_fails_no_request_that_had_not_started_streaming(setup):
    """Named to run last: it kills a replica. Then nothing of the canary is anywhere (ZDR)."""
    start = time.time() - 1
    acme = setup.client("acme")
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one_request, acme, i) for i in range(16)]
        assert wait_until(lambda: setup.replicas[1].metric("num_requests_running", "smollm2-135m") > 0, 60)
        setup.replicas[1].proc.send_signal(signal.SIGKILL)
        results = [f.result() for f in futures]
    assert all(status == "ok" or chunks > 0 for status, chunks in results), results
    assert sum(status == "ok" for status, _ in results) >= 8  # every non-streamed one at least
    assert all(ask(acme, f"{CANARY} after {i}").choices for i in range(4))  # the dead one is out
    assert "is out" in setup.gateway.log_text()
    time.sleep(0.5)
    needle = CANARY.encode()
    logs = [Path(s.log.name) for s in (setup.gateway, *setup.replicas)]
    databases = [p for p in setup.db.parent.iterdir() if ".db" in p.name]
    for path in {*_files_written_since(start), *logs, *databases}:
        assert needle not in path.read_bytes(), f"the canary was written to {path}"
    assert CANARY not in str(setup.rows("acme")) and CANARY not in httpx.get(f"{setup.gateway.base_url}/metrics").text
