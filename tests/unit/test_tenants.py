"""Tenants and API keys (gateway/tenants.py, `sobrio admin`): a key resolves to its tenant until revoked or
its tenant is deleted, nothing but a keyed hash of it reaches the database, and each tenant's prefix-cache
salt is its own and stable across restarts."""

import os
import stat

import pytest

from sobrio import cli
from sobrio.gateway.tenants import Limits, TenantError, TenantStore


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
    store = TenantStore(tmp_path / "admin.db")
    assert store.resolve(text) is None and store.tenant("acme").limits.allowed_models == ("a", "b")
    store.close()
