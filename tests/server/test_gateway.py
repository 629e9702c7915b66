"""The gateway through the official `openai` client, on a real server: tenants and keys (401 once one
exists), per-tenant prefix-cache salts, limits (429 with Retry-After, 403 for a model not allowed), and the
usage ledger: one row per request, each tenant sees only its own, and nothing of any text anywhere (ZDR)."""

import os
import shutil
import sqlite3
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import httpx
import openai
import pytest

from sobrio.gateway.ledger import COLUMNS
from sobrio.gateway.tenants import Limits, TenantStore
from sobrio.kv.disk_tier import HEADER
from sobrio.kv.sealing import MASTER_KEY_ENV, tenant_digest
from tests.server.conftest import SMALL, serving, wait_until

CANARY = "zq7canaryxv"
BUDGET = 160  # tokens per day of the tenant "budget": eight parallel requests of ~45 tokens each would pass it
OPERATOR = "operator-key-for-tests"  # in prompts, and forced as completions (a regex), on every path
PROJECT = Path(__file__).resolve().parents[2]


@dataclass
class Gateway:
    srv: object
    store: TenantStore
    db: Path
    keys: dict[str, str]

    def client(self, tenant: str | None, **kwargs) -> openai.OpenAI:
        key = self.keys[tenant] if tenant else "sk-none"
        return openai.OpenAI(base_url=f"{self.srv.base_url}/v1", api_key=key, max_retries=0, **kwargs)

    def usage(self, tenant: str) -> dict:
        answer = httpx.get(f"{self.srv.base_url}/v1/usage", headers={"Authorization": f"Bearer {self.keys[tenant]}"})
        assert answer.status_code == 200, answer.text
        return answer.json()


TENANTS = {"acme": Limits(), "globex": Limits(), "minute": Limits(requests_per_minute=3),
           "single": Limits(max_concurrent=1), "frugal": Limits(tokens_per_day=60),
           "restricted": Limits(allowed_models=("another-model",)), "in-eu": Limits(allowed_regions=("EU",)),
           "us-only": Limits(allowed_regions=("USA",)), "routed": Limits(default_model="auto"),
           "kv-opted": Limits(kv_offload=True), "kv-gone": Limits(kv_offload=True),
           "budget": Limits(tokens_per_day=BUDGET)}
KV_TIERS = ("--kv-offload-ram", str(32 << 20), "--kv-offload-disk", str(64 << 20))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    db = tmp_path_factory.mktemp("gateway") / "gateway.db"
    store = TenantStore(db)
    keys = {}
    for name, limits in TENANTS.items():
        store.create_tenant(name, limits)
        keys[name] = store.create_key(name)[1]
    os.environ[MASTER_KEY_ENV] = "3c" * 32  # the KV disk tier's (for the server process)
    try:
        with serving(*SMALL, "--db", str(db), "--log-level", "debug", "--region", "ITA", "--api-key", OPERATOR,
                     *KV_TIERS, "--kv-offload-dir", str(db.parent / "kv")) as srv:
            yield Gateway(srv, store, db, keys)
    finally:
        os.environ.pop(MASTER_KEY_ENV, None)
        store.close()


def chat(client: openai.OpenAI, text: str, model: str = "smollm2-135m", **kwargs):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                          max_tokens=kwargs.pop("max_tokens", 4), temperature=0, **kwargs)


def test_keys_once_tenants_exist_and_revocation(gateway):
    with pytest.raises(openai.AuthenticationError) as exc:
        chat(gateway.client(None), "hello")
    assert exc.value.body["code"] == "invalid_api_key"
    no_header = httpx.post(f"{gateway.srv.base_url}/v1/completions", json={"model": "smollm2-135m", "prompt": "x"})
    assert no_header.status_code == 401 and no_header.json()["error"]["code"] == "invalid_api_key"
    key, text = gateway.store.create_key("acme")
    client = openai.OpenAI(base_url=f"{gateway.srv.base_url}/v1", api_key=text, max_retries=0)
    assert chat(client, "hello").choices[0].message.content
    gateway.store.revoke_key(key.key_id)
    with pytest.raises(openai.AuthenticationError):
        chat(client, "hello")
    assert httpx.get(f"{gateway.srv.base_url}/health").status_code == 200  # probes need no key


def test_each_tenant_sees_only_its_own_usage(gateway):
    mine = chat(gateway.client("acme"), "Say one word.")
    theirs = chat(gateway.client("globex"), "Say two words.")
    acme, globex = gateway.usage("acme"), gateway.usage("globex")
    assert acme["tenant"] == "acme" and globex["tenant"] == "globex"
    assert mine.id in {row["request_id"] for row in acme["data"]}
    assert theirs.id not in {row["request_id"] for row in acme["data"]}
    assert {row["tenant_id"] for row in acme["data"]} == {gateway.store.tenant("acme").id}
    row = next(r for r in acme["data"] if r["request_id"] == mine.id)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (mine.usage.prompt_tokens, mine.usage.completion_tokens)
    assert row["status"] == 200 and row["served_model"] == "smollm2-135m" and row["duration_s"] > 0
    assert acme["totals"]["requests"] >= 1 and acme["totals"]["prompt_tokens"] >= mine.usage.prompt_tokens


def test_energy_and_co2_per_request_in_headers_and_ledger(gateway):
    raw = gateway.client("acme").chat.completions.with_raw_response.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Name three rivers."}], max_tokens=16)
    answer = raw.parse()
    joules, grams = float(raw.headers["x-sobrio-energy-joules"]), float(raw.headers["x-sobrio-co2-grams"])
    assert joules > 0 and raw.headers["x-sobrio-energy-source"] in ("rapl", "cpu-model")
    assert grams == pytest.approx(joules / 3.6e6 * 330.7, rel=1e-2)  # Italy's grid, 2023
    row = next(r for r in gateway.usage("acme")["data"] if r["request_id"] == answer.id)
    assert row["energy_j"] == pytest.approx(joules, rel=1e-3) and row["co2_g"] == pytest.approx(grams, rel=1e-3)
    assert row["backend"] == "local:ITA" and row["energy_source"] == raw.headers["x-sobrio-energy-source"]


def test_no_tenant_reads_another_tenants_cached_prefix_whatever_salt_it_sends(gateway):
    """globex caches three documents; acme asks for each, sending globex's own salt, none, or another: none
    of globex's blocks. acme's salt is its tenant's whatever it sends, so its own repeats still hit its cache."""
    globex, acme = gateway.client("globex"), gateway.client("acme")
    documents = [f"Document {i}: a long report on the history of bread and of mills. " * 12 for i in range(3)]
    for document in documents:
        chat(globex, document)
        assert chat(globex, document).usage.prompt_tokens_details.cached_tokens > 0  # its own cache works
    # acme's own cache holds the chat template's first block (from a first request, here or in the tests
    # before): a document nobody sent shows how much of any document acme can get from it
    chat(acme, "Butter, a study. " * 30)
    own = chat(acme, "Cheese, a study. " * 30).usage.prompt_tokens_details.cached_tokens
    assert own < 32
    globex_salt = gateway.store.cache_salt(gateway.store.tenant("globex"))
    for document, extra in zip(documents, ({"cache_salt": globex_salt}, {}, {"cache_salt": "anything-else"})):
        assert chat(acme, document, extra_body=extra).usage.prompt_tokens_details.cached_tokens == own, extra
    again = chat(acme, documents[2], extra_body={"cache_salt": "yet-another"})
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_requests_per_minute_and_tokens_per_day_give_429_with_retry_after(gateway):
    client = gateway.client("minute")
    for _ in range(3):
        chat(client, "hi", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as exc:
        chat(client, "hi", max_tokens=1)
    assert 1 <= int(exc.value.response.headers["retry-after"]) <= 60
    assert "3 requests per minute" in exc.value.body["message"]
    frugal = gateway.client("frugal")
    chat(frugal, "Count to ten.", max_tokens=24)  # its worst case, 58 tokens with the chat template, fits
    with pytest.raises(openai.RateLimitError) as exc:
        chat(frugal, "hi", max_tokens=1)  # ~30 more do not
    assert 1 <= int(exc.value.response.headers["retry-after"]) <= 86400  # until midnight UTC
    assert "its 60 tokens for today" in exc.value.body["message"]


def test_concurrent_requests_limit_and_its_reset(gateway):
    client = gateway.client("single")
    stream = client.completions.create(model="smollm2-135m", prompt="Once upon a time", max_tokens=200,
                                       stream=True, temperature=0, extra_body={"ignore_eos": True})
    next(iter(stream))  # streaming: one request in flight
    with pytest.raises(openai.RateLimitError) as exc:
        chat(client, "hi", max_tokens=1)
    assert "1 request(s) in flight" in exc.value.body["message"]
    for _ in stream:
        pass
    assert chat(client, "hi", max_tokens=1).choices  # the slot came back


def test_a_model_the_tenant_may_not_use_is_403(gateway):
    with pytest.raises(openai.PermissionDeniedError) as exc:
        chat(gateway.client("restricted"), "hi")
    assert exc.value.body["code"] == "model_not_allowed" and exc.value.body["param"] == "model"


def test_a_tenant_restricted_to_other_regions_is_403_and_eu_passes(gateway):
    """The server runs in ITA: a tenant allowed only the USA gets 403; one allowed the EU is served."""
    with pytest.raises(openai.PermissionDeniedError) as exc:
        chat(gateway.client("us-only"), "hi")
    assert exc.value.body["code"] == "region_not_allowed" and "is served in ITA" in exc.value.body["message"]
    assert chat(gateway.client("in-eu"), "hi").choices


def test_admin_cli_makes_a_key_that_the_running_server_takes(gateway):
    out = subprocess.run([sys.executable, "-m", "sobrio.cli", "admin", "--db", str(gateway.db), "keys", "create",
                          "--tenant", "globex"], capture_output=True, text=True, timeout=120, check=True).stdout
    key = next(word for word in out.split() if word.startswith("sk-sobrio-"))
    client = openai.OpenAI(base_url=f"{gateway.srv.base_url}/v1", api_key=key, max_retries=0)
    assert chat(client, "hello").choices[0].message.content


def _every_path_with_the_canary(gateway) -> None:
    """Success, stream, completions, responses, embeddings-free 4xx, a stream the client drops, a 429."""
    acme = gateway.client("acme")
    forced = {"structured_outputs": {"regex": CANARY}}
    assert chat(acme, f"Repeat {CANARY}", max_tokens=12, extra_body=forced).choices[0].message.content == CANARY
    streamed = chat(acme, f"Repeat {CANARY}", max_tokens=12, stream=True, extra_body=forced)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == CANARY
    assert acme.completions.create(model="smollm2-135m", prompt=f"{CANARY} {CANARY}", max_tokens=12,
                                   extra_body=forced).choices[0].text == CANARY
    assert acme.responses.create(model="smollm2-135m", input=f"Say {CANARY}", max_output_tokens=12)
    with pytest.raises(openai.BadRequestError):
        chat(acme, f"Repeat {CANARY}", extra_body={"structured_outputs": {"regex": f"({CANARY}"}})
    dropped = acme.completions.create(model="smollm2-135m", prompt=f"{CANARY} story", max_tokens=300, stream=True,
                                      extra_body={"ignore_eos": True})
    next(iter(dropped))
    dropped.close()
    minute = gateway.client("minute")
    with pytest.raises(openai.RateLimitError):
        for _ in range(4):
            chat(minute, f"{CANARY}", max_tokens=1)
    _canaries_in_urls_headers_and_every_string_field(gateway)


def _canaries_in_urls_headers_and_every_string_field(gateway) -> None:
    """The canary in paths (known and unknown routes), query strings, headers (User-Agent, X-Request-Id, a
    custom one), every string field of a body, and the errors these make (404, 400, 401, 403)."""
    base, key = gateway.srv.base_url, gateway.keys["acme"]
    headers = {"Authorization": f"Bearer {key}", "User-Agent": CANARY, "X-Request-Id": CANARY, "X-Note": CANARY}
    for method, path in (("POST", f"/v1/my%20{CANARY}%20password"), ("POST", f"/v1/chat/{CANARY}"),
                         ("GET", f"/v1/models/{CANARY}"), ("POST", f"/{CANARY}"), ("GET", f"/v1/{CANARY}/x")):
        answer = httpx.request(method, base + path, headers=headers, json={})
        assert answer.status_code in (404, 405), (path, answer.status_code)
    assert httpx.post(f"{base}/v1/chat/{CANARY}", headers={"X-Note": CANARY}).status_code == 401
    fields = {"user": CANARY, "metadata": {CANARY: CANARY}, "stop": [CANARY], "cache_salt": CANARY,
              "prompt_cache_key": CANARY, "safety_identifier": CANARY, "seed": 7,
              "messages": [{"role": "system", "content": CANARY}, {"role": "user", "content": CANARY,
                                                                     "name": CANARY}],
              "tools": [{"type": "function", "function": {"name": CANARY, "description": CANARY,
                                                          "parameters": {"type": "object", "properties": {
                                                              CANARY: {"type": "string", "enum": [CANARY]}}}}}],
              "tool_choice": "required", "response_format": {"type": "text"}, "model": "smollm2-135m",
              "max_tokens": 24, "temperature": 0}
    answer = httpx.post(f"{base}/v1/chat/completions?{CANARY}={CANARY}", headers=headers, json=fields, timeout=120)
    assert answer.status_code == 200 and answer.headers["x-request-id"] == CANARY, answer.text  # echoed only
    for bad in ({"model": CANARY}, {"max_tokens": CANARY}, {CANARY: 1}, {"tool_choice": {
            "type": "function", "function": {"name": f"{CANARY}2"}}}, {"seed": CANARY}):
        answer = httpx.post(f"{base}/v1/chat/completions", headers=headers, json={**fields, **bad}, timeout=60)
        assert answer.status_code in (400, 404), (bad, answer.text)
    assert httpx.post(f"{base}/v1/completions", headers=headers,
                      content=f'{{"prompt": "{CANARY}", '.encode()).status_code == 400  # not JSON
    assert httpx.get(f"{base}/v1/usage?since={CANARY}", headers=headers).status_code == 400
    assert httpx.post(f"{base}/tokenize", headers=headers, json={"prompt": CANARY}).status_code == 200
    restricted = {**headers, "Authorization": f"Bearer {gateway.keys['restricted']}"}
    assert httpx.post(f"{base}/detokenize", headers=restricted, json={"tokens": [1]}).status_code in (200, 403)


def _files_written_since(start: float) -> list[Path]:
    """Files modified since `start` under the project, the temp directory and the home directory (less the
    toolchains there: rustup, pyenv, maven)."""
    skip = {PROJECT / ".git", *(Path.home() / d for d in (".rustup", ".pyenv", ".m2"))}
    found = []
    for root in (PROJECT, Path(os.environ.get("TMPDIR", "/tmp")), Path.home()):
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if Path(folder, d) not in skip]
            for name in files:
                path = Path(folder, name)
                try:
                    if path.is_file() and path.stat().st_mtime >= start:
                        found.append(path)
                except OSError:
                    continue
    return found


def test_zero_data_retention_canary_is_nowhere(gateway):
    start = time.time() - 1
    _every_path_with_the_canary(gateway)
    time.sleep(0.5)  # the dropped stream's row is written when the server sees the disconnect
    needle = CANARY.encode()
    written = _files_written_since(start)
    sqlite_files = [p for p in gateway.db.parent.iterdir() if p.name.startswith("gateway.db")]
    assert any(p.name == "gateway.db-wal" for p in sqlite_files)
    for path in {*written, *sqlite_files, Path(gateway.srv.log.name)}:
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # renamed or removed since the listing: another test worker's temporary file
            assert gateway.db.parent not in path.parents, f"the gateway's {path} vanished before it was read"
            continue
        assert needle not in data, f"the canary was written to {path}"
    for endpoint in ("/metrics", f"/dashboard?key={OPERATOR}"):
        page = httpx.get(gateway.srv.base_url + endpoint)
        assert page.status_code == 200 and CANARY not in page.text
    assert CANARY not in str(gateway.usage("acme")) and CANARY not in str(gateway.usage("minute"))
    assert "DEBUG" in gateway.srv.log_text()  # the log was at debug level


def test_the_ledger_and_access_log_name_route_templates_never_a_path_sent(gateway):
    base, headers = gateway.srv.base_url, {"Authorization": f"Bearer {gateway.keys['globex']}"}
    assert httpx.post(f"{base}/v1/hunter2-is-my-password", headers=headers, json={}).status_code == 404
    assert httpx.get(f"{base}/v1/models/hunter2", headers=headers).status_code == 404
    endpoints = {row["endpoint"] for row in gateway.usage("globex")["data"]}
    assert "unknown" in endpoints and not any("hunter2" in e for e in endpoints)
    assert wait_until(lambda: "GET /v1/models/{model_id:path} 404" in gateway.srv.log_text(), 5)
    assert "hunter2" not in gateway.srv.log_text()


def test_tokenize_detokenize_and_model_cards_are_behind_the_gate(gateway):
    base = gateway.srv.base_url
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
        assert httpx.post(base + path, json=body).status_code == 401
        answer = httpx.post(base + path, json=body, headers={"Authorization": f"Bearer {gateway.keys['restricted']}"})
        assert answer.status_code == 403 and answer.json()["error"]["code"] == "model_not_allowed"
        assert httpx.post(base + path, json=body, headers={"Authorization": f"Bearer {gateway.keys['acme']}"}
                          ).status_code == 200
    restricted = gateway.client("restricted")
    with pytest.raises(openai.PermissionDeniedError):
        restricted.models.retrieve("smollm2-135m")
    assert [m.id for m in restricted.models.list()] == []
    assert gateway.client("acme").models.retrieve("smollm2-135m").id == "smollm2-135m"
    for open_route in ("/health", "/version", "/metrics", "/ping"):
        assert httpx.get(base + open_route).status_code == 200, open_route


def test_eight_parallel_requests_stay_within_the_daily_token_budget(gateway):
    """Each request holds its worst case (prompt + max_tokens) from admission until it ends: eight sent at
    once never use more than the budget together; those that do not fit get 429 with an OpenAI body."""
    client = gateway.client("budget")

    def one(i: int):
        try:
            return chat(client, f"Say {i}.", max_tokens=16)
        except openai.RateLimitError as exc:
            assert exc.body["type"] == "rate_limit_error" and "max_tokens" in exc.body["message"]
            assert 1 <= int(exc.response.headers["retry-after"])
            return None

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(8)))
    served = [a for a in answers if a is not None]
    assert served and len(served) < 8
    assert sum(a.usage.total_tokens for a in served) <= BUDGET
    assert gateway.usage("budget")["totals"]["prompt_tokens"] + \
        gateway.usage("budget")["totals"]["completion_tokens"] <= BUDGET


def test_the_ledger_holds_only_the_allow_listed_columns_and_a_row_per_path(gateway):
    with sqlite3.connect(gateway.db) as db:
        columns = tuple(row[1] for row in db.execute("PRAGMA table_info(usage)"))
        statuses = {row[0] for row in db.execute("SELECT status FROM usage")}
    assert columns == COLUMNS == (
        "request_id", "tenant_id", "created_at", "endpoint", "requested_model", "served_model", "backend",
        "prompt_tokens", "completion_tokens", "cached_tokens", "ttft_s", "duration_s", "status", "energy_j",
        "co2_g", "energy_source", "router_score")
    assert {200, 400, 403, 429} <= statuses


def test_model_auto_without_both_router_models_is_a_400_and_a_tenants_default_model_applies(gateway):
    with pytest.raises(openai.BadRequestError) as exc:
        chat(gateway.client("acme"), "hi", model="auto")
    assert exc.value.body["param"] == "model" and "needs the router" in exc.value.body["message"]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}  # no model: the tenant's "auto"
    for tenant, status in (("routed", 400), ("acme", 200)):
        answer = httpx.post(f"{gateway.srv.base_url}/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {gateway.keys[tenant]}"})
        assert answer.status_code == status, answer.text


class _Page(HTMLParser):
    """The dashboard's tables (by id) as rows of cell texts, and its charts' ids."""

    def __init__(self):
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.svgs: list[str] = []
        self._table = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self._table = self.tables.setdefault(attrs.get("id"), [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag == "svg":
            self.svgs.append(attrs.get("id"))

    def handle_endtag(self, tag):
        if tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._table is not None and self._table and data.strip():
            self._table[-1].append(data.strip())


def test_dashboard_for_the_operator_only_with_tenants_models_and_charts(gateway):
    chat(gateway.client("acme"), "Name a colour.")
    url = f"{gateway.srv.base_url}/dashboard"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {gateway.keys['acme']}"}).status_code == 401
    page = httpx.get(url, headers={"Authorization": f"Bearer {OPERATOR}"})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    parsed = _Page()
    parsed.feed(page.text)
    tenants = {row[0]: row for row in parsed.tables["tenants"][1:]}
    assert {"acme", "globex"} <= set(tenants) and int(tenants["acme"][1]) >= 1
    assert "smollm2-135m" in {row[0] for row in parsed.tables["models"][1:]}
    assert {"requests-chart", "energy-chart", "hourly-chart"} <= set(parsed.svgs)


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="Debian's chromium is not installed (apt-get install chromium): no headless browser")
def test_dashboard_renders_in_headless_chromium(gateway, tmp_path):
    url = f"{gateway.srv.base_url}/dashboard?key={OPERATOR}"
    browser = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    parsed = _Page()
    parsed.feed(dom)
    assert "acme" in {row[0] for row in parsed.tables["tenants"][1:]} and "hourly-chart" in parsed.svgs
    shot = tmp_path / "dashboard.png"
    subprocess.run([*browser, f"--screenshot={shot}", "--window-size=1000,1500", url], capture_output=True,
                   timeout=120)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    if os.environ.get("SOBRIO_DASHBOARD_SHOT"):  # docs/dashboard.png is made this way
        shutil.copy(shot, os.environ["SOBRIO_DASHBOARD_SHOT"])


def kv_digest(gateway, tenant: str) -> bytes:
    return tenant_digest(gateway.store.cache_salt(gateway.store.tenant(tenant)))


def kv_files(gateway, digest: bytes) -> int:
    """A tenant's block files in the disk tier, by the digest each file's header names (a count of all files
    raced with the writer thread: it could be taken while a tenant's blocks were still being written)."""
    count = 0
    for path in (gateway.db.parent / "kv").glob("*.kvb"):
        try:
            count += HEADER.unpack(path.read_bytes()[:HEADER.size])[3] == digest
        except (OSError, struct.error):  # removed or replaced while we looked
            pass
    return count


def test_kv_offload_is_a_tenants_choice_and_deleting_it_shreds_its_blocks(gateway):
    """Zero Data Retention: a tenant that did not opt in leaves no KV block on disk; one that did finds its
    blocks written (encrypted under its key); deleting it removes them (the server notices within seconds),
    and only them."""
    acme, opted, gone = (kv_digest(gateway, name) for name in ("acme", "kv-opted", "kv-gone"))
    long = " ".join(f"word{i}" for i in range(120))
    chat(gateway.client("acme"), f"{long} acme")
    chat(gateway.client("kv-opted"), f"{long} opted")
    chat(gateway.client("kv-gone"), f"{long} gone")
    assert wait_until(lambda: kv_files(gateway, opted) > 0 and kv_files(gateway, gone) > 0, 10)
    time.sleep(1.0)  # the idle engine has queued every block by now; acme's would be among them
    assert kv_files(gateway, acme) == 0
    opted_files = kv_files(gateway, opted)
    gateway.store.delete_tenant("kv-gone")
    assert wait_until(lambda: kv_files(gateway, gone) == 0, 20), kv_files(gateway, gone)
    assert kv_files(gateway, opted) >= opted_files > 0
    assert "sobrio:kv_offload_stored" in httpx.get(f"{gateway.srv.base_url}/metrics").text
