"""Tenants and API keys (gateway/tenants.py, `sobrio admin`): a key resolves to its tenant until revoked or
its tenant is deleted, nothing but a keyed hash of it reaches the database, and each tenant's prefix-cache
salt is its own and stable across restarts."""

import os
import sqlite3
import stat
import time

import pytest

from sobrio import cli
from sobrio.gateway.gate import TenantLimiter
from sobrio.gateway.ledger import Ledger, LedgerEntry, start_of_utc_day
from sobrio.gateway.tenants import Limits, Tenant, TenantError, TenantStore


@pytest.fixture
def store(tmp_path):
    s = TenantStore(tmp_path / "gateway.db")
    yield s
    s.close()


def _files_bytes(folder) -> bytes:
    return b"".join(p.read_bytes() for p in folder.iterdir() if p.is_file())


def test_a_key_resolves_to_its_tenant_until_revoked(store, tmp_path):
    acme = store.create_tenant("acme", Limits(requests_per_minute=60, allowed_regions=("eu-it", "eu-fr")))
    store.create_tenant("globex")
    key, text = store.create_key("acme")
    assert text.startswith("sk-sobrio-") and key.key_id in text
    assert store.resolve(text) == acme and store.resolve(text).limits.allowed_regions == ("eu-it", "eu-fr")
    for wrong in ("", "Bearer " + text, text[:-1] + ("A" if text[-1] != "A" else "B"), text + "x",
                  text.replace(key.key_id, "0" * 12)):
        assert store.resolve(wrong) is None
    secret_part = text[len("sk-sobrio-") + len(key.key_id) + 1:]
    assert text.encode() not in _files_bytes(tmp_path) and secret_part.encode() not in _files_bytes(tmp_path)
    store.revoke_key(key.key_id)
    assert store.resolve(text) is None
    assert [k.revoked_at is not None for k in store.keys("acme")] == [True]
    with pytest.raises(TenantError, match="no active key"):
        store.revoke_key(key.key_id)


def test_deleting_a_tenant_deletes_its_keys(store):
    store.create_tenant("acme")
    _, text = store.create_key("acme")
    store.delete_tenant("acme")
    assert store.resolve(text) is None and store.keys() == [] and not store.has_tenants()
    with pytest.raises(TenantError, match="no tenant named 'acme'"):
        store.create_key("acme")


def test_names_and_limits_are_checked(store):
    store.create_tenant("acme")
    with pytest.raises(TenantError, match="exists already"):
        store.create_tenant("acme")
    for bad in ("", "-x", "a b", "x" * 65, "é"):
        with pytest.raises(TenantError, match="a tenant name is"):
            store.create_tenant(bad)
    with pytest.raises(TenantError, match="requests_per_minute must be a positive integer"):
        Limits(requests_per_minute=0)


def test_cache_salts_differ_by_tenant_and_survive_a_restart(tmp_path):
    first = TenantStore(tmp_path / "g.db")
    a, b = first.create_tenant("a"), first.create_tenant("b")
    _, text = first.create_key("a")
    salts = first.cache_salt(a), first.cache_salt(b)
    first.close()
    secret = tmp_path / "g.db.secret"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    again = TenantStore(tmp_path / "g.db")
    assert salts[0] != salts[1] and (again.cache_salt(a), again.cache_salt(b)) == salts
    assert again.resolve(text) == a  # the same secret: the stored hash still matches
    again.close()


def test_admin_commands_print_the_key_once(tmp_path, capsys):
    db = ["admin", "--db", str(tmp_path / "admin.db")]
    assert cli.main(db + ["tenants", "create", "acme", "--tokens-per-day", "1000", "--models", "a, b"]) == 0
    assert cli.main(db + ["keys", "create", "--tenant", "acme"]) == 0
    text = capsys.readouterr().out.splitlines()[1]
    assert text.startswith("sk-sobrio-")
    assert cli.main(db + ["tenants", "list"]) == 0
    assert cli.main(db + ["keys", "list"]) == 0
    listing = capsys.readouterr().out
    assert "tokens/day=1000" in listing and "models=a,b" in listing and "active" in listing
    assert text not in listing
    key_id = text.split("-")[2]
    assert cli.main(db + ["keys", "revoke", key_id]) == 0
    assert cli.main(db + ["keys", "create", "--tenant", "nobody"]) == 1
    assert "no tenant named 'nobody'" in capsys.readouterr().err
    assert cli.main(db + ["tenants", "set-limits", "acme", "--requests-per-minute", "5"]) == 0
    store = TenantStore(tmp_path / "admin.db")
    assert store.resolve(text) is None
    assert store.tenant("acme").limits == Limits(requests_per_minute=5, tokens_per_day=1000, allowed_models=("a", "b"))
    store.close()


def test_set_limits_changes_only_what_it_is_given_and_clears_on_request(tmp_path, capsys):
    """Tightening one limit once silently removed the tenant's token cap, concurrency cap and models."""
    db = ["admin", "--db", str(tmp_path / "admin.db")]
    assert cli.main(db + ["tenants", "create", "acme", "--tokens-per-day", "1000", "--max-concurrent", "4",
                          "--models", "a", "--kv-offload"]) == 0
    assert cli.main(db + ["tenants", "set-limits", "acme", "--requests-per-minute", "30"]) == 0
    assert cli.main(db + ["tenants", "set-limits", "acme", "--clear", "max-concurrent", "kv-offload"]) == 0
    assert cli.main(db + ["tenants", "set-limits", "acme", "--models", "b", "--clear", "models"]) == 1
    assert "both set and cleared: allowed_models" in capsys.readouterr().err
    store = TenantStore(tmp_path / "admin.db")
    try:
        assert store.tenant("acme").limits == Limits(requests_per_minute=30, tokens_per_day=1000,
                                                     allowed_models=("a",))
    finally:
        store.close()


def test_limiter_window_concurrency_and_daily_tokens_reset():
    """The sliding minute frees a slot when its oldest request is 60 s old; a finished request frees its
    concurrency slot; the day's tokens come from the ledger and count from midnight UTC."""
    now = [1000.0]
    ledger = Ledger(sqlite3.connect(":memory:"))
    limiter = TenantLimiter(ledger, clock=lambda: now[0])
    minute = Tenant("t1", "minute", 0.0, Limits(requests_per_minute=2))
    assert limiter.admit(minute) is None and limiter.admit(minute) is None
    now[0] += 20
    refusal = limiter.admit(minute)
    assert refusal is not None and refusal.retry_after == 40 and "2 requests per minute" in refusal.message
    now[0] += 40
    assert limiter.admit(minute) is None  # the first left the window
    single = Tenant("t2", "single", 0.0, Limits(max_concurrent=1))
    assert limiter.admit(single) is None and limiter.admit(single) is not None
    limiter.release(single)
    assert limiter.admit(single) is None
    frugal = Tenant("t3", "frugal", 0.0, Limits(tokens_per_day=100))
    yesterday = start_of_utc_day() - 10
    ledger.record(LedgerEntry("old", "t3", yesterday, "/v1/chat/completions", prompt_tokens=500, status=200))
    assert limiter.admit(frugal) is None  # yesterday's tokens do not count today
    ledger.record(LedgerEntry("new", "t3", time.time(), "/v1/chat/completions", prompt_tokens=60,
                              completion_tokens=40, status=200))
    refusal = limiter.admit(frugal)
    assert refusal is not None and 0 < refusal.retry_after <= 86400


def test_reservations_hold_the_worst_case_until_settled():
    """In-flight reservations count beside the ledger; one that does not fit is refused (Retry-After 1 s
    while others hold the rest, until midnight when it could never fit today); release gives it back."""
    ledger = Ledger(sqlite3.connect(":memory:"))
    limiter = TenantLimiter(ledger)
    tenant = Tenant("t4", "budget", 0.0, Limits(tokens_per_day=100))
    assert limiter.reserve(tenant, 60) is None
    refusal = limiter.reserve(tenant, 50)
    assert refusal is not None and refusal.retry_after == 1 and "40 of its 100 tokens" in refusal.message
    assert limiter.reserve(tenant, 40) is None and limiter.admit(tenant) is not None  # all 100 are held
    ledger.record(LedgerEntry("a", "t4", time.time(), "/v1/completions", prompt_tokens=10, completion_tokens=5))
    limiter.in_flight[tenant.id] += 1  # as admit() had counted it
    limiter.release(tenant, 60)  # it used 15 of its 60
    assert limiter.reserved[tenant.id] == 40 and limiter.reserve(tenant, 45) is None
    assert limiter.reserve(tenant, 1).retry_after == 1
    assert limiter.reserve(tenant, 200).retry_after > 1  # more than the whole budget: not today
    assert limiter.reserve(Tenant("t5", "free", 0.0, Limits()), 10**9) is None


@pytest.mark.parametrize("ending", ["error", "client gone", "over budget"])
def test_a_reservation_is_given_back_however_the_request_ends(store, ending):
    import asyncio

    from starlette.datastructures import State

    from sobrio.errors import BudgetExceededError
    from sobrio.gateway.gate import TenantGate, reserve_tokens

    store.create_tenant("b", Limits(tokens_per_day=100))
    key = store.create_key("b")[1]
    refused = []

    async def app(scope, receive, send):
        reserve_tokens(State(scope["state"]), 60)
        if ending == "over budget":
            try:
                reserve_tokens(State(scope["state"]), 41)
            except BudgetExceededError as exc:
                refused.append(exc.retry_after)
        if ending == "error":
            raise RuntimeError("the engine failed")

    gate = TenantGate(app, None, store, Ledger(store.db))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "state": {"route": "/v1/completions"},
             "headers": [(b"authorization", f"Bearer {key}".encode())]}

    async def call():
        try:
            await gate(scope, None, None)
        except RuntimeError:
            pass

    asyncio.run(call())
    tenant = store.tenant("b")
    assert gate.limiter.reserved[tenant.id] == 0 and gate.limiter.in_flight[tenant.id] == 0
    assert gate.ledger.rows(tenant.id)[0]["status"] == 499 and gate.ledger.rows(tenant.id)[0]["endpoint"] == \
        "/v1/completions"
    assert refused == ([1] if ending == "over budget" else [])


def test_worst_case_tokens_count_prompts_and_every_sequence():
    from sobrio.server.budgets import worst_case_tokens
    from sobrio.types.params import SamplingParams

    two = SamplingParams(n=2, max_tokens=10)
    assert worst_case_tokens([[1] * 5, [2] * 7], [two, two], 100) == 5 + 20 + 7 + 20
    assert worst_case_tokens([[1] * 5], [SamplingParams(max_tokens=None)], 100) == 100  # unset: the context
    assert worst_case_tokens([[1] * 95], [SamplingParams(max_tokens=50)], 100) == 100  # capped at the context


def test_default_model_and_a_database_from_before_it(tmp_path):
    old = sqlite3.connect(tmp_path / "old.db")
    old.executescript("""CREATE TABLE tenants (id TEXT PRIMARY KEY, name TEXT UNIQUE NOT NULL, created_at REAL
        NOT NULL, requests_per_minute INTEGER, tokens_per_day INTEGER, max_concurrent INTEGER,
        allowed_models TEXT, allowed_regions TEXT);
        INSERT INTO tenants VALUES ('t0', 'old', 0, NULL, NULL, NULL, NULL, NULL);""")
    old.close()
    store = TenantStore(tmp_path / "old.db")
    assert store.tenant("old").limits == Limits()
    store.create_tenant("new", Limits(default_model="auto"))
    store.set_limits("old", Limits(default_model="gemma3-270m"))
    assert store.tenant("new").limits.default_model == "auto"
    assert store.tenant("old").limits.default_model == "gemma3-270m"
    store.close()
