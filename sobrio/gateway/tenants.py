"""Tenants and their API keys, in an embedded SQLite database (WAL mode: nothing to install or start).

A key is shown once, when it is created: `sk-sobrio-<key id>-<secret>`. The database keeps the key id (to
find the row, and to name the key in `keys list` and `keys revoke`) and HMAC-SHA256 of the whole key under
a server secret, never the key itself: a copy of the database gives no working key, and without the secret
its hashes cannot even be tested against guesses. The secret is `SOBRIO_SECRET` where set, else 32 random
bytes in a file beside the database that only its owner may read, made on first use.

The same secret derives each tenant's prefix-cache salt (`cache_salt`), which the gateway puts in place of
any salt a client sends, so no tenant can share, or time, another's cached prefixes. Per-tenant limits
(requests per minute, tokens per day, concurrent requests, allowed models and regions) are stored here for
the gateway to enforce. The server and `sobrio admin` find the same file by default (`default_db_path`).
"""

import hashlib
import hmac
import json
import os
import re
import secrets
import sqlite3
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

from sobrio.errors import PermissionDeniedError, SobrioError

KEY_PREFIX = "sk-sobrio-"
_KEY = re.compile(r"sk-sobrio-([0-9a-f]{12})-([A-Za-z0-9_-]{43})")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    id TEXT PRIMARY KEY, name TEXT UNIQUE NOT NULL, created_at REAL NOT NULL,
    requests_per_minute INTEGER, tokens_per_day INTEGER, max_concurrent INTEGER,
    allowed_models TEXT, allowed_regions TEXT, default_model TEXT, kv_offload INTEGER);
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY, tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
    key_hash BLOB NOT NULL, created_at REAL NOT NULL, revoked_at REAL);
"""


class TenantError(SobrioError):
    """An admin operation names a tenant or key that is not there, or one that exists already."""


@dataclass(frozen=True)
class Limits:
    """A tenant's limits; None is no limit (all models, all regions)."""

    requests_per_minute: int | None = None
    tokens_per_day: int | None = None
    max_concurrent: int | None = None
    allowed_models: tuple[str, ...] | None = None
    allowed_regions: tuple[str, ...] | None = None
    default_model: str | None = None  # what a request naming no model gets ("auto": the router's choice)
    kv_offload: bool | None = None  # its KV blocks may go to the offload tiers, disk included (None: no)

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_day", "max_concurrent"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise TenantError(f"{name} must be a positive integer (or unset), got {value!r}")

    def or_defaults(self, defaults: "Limits") -> "Limits":
        """These limits, each unset one taken from `defaults` (the configuration's [tenant_defaults])."""
        return Limits(*(getattr(self, f.name) if getattr(self, f.name) is not None else getattr(defaults, f.name)
                        for f in fields(Limits)))


@dataclass(frozen=True)
class Tenant:
    id: str
    name: str
    created_at: float
    limits: Limits


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    tenant: str  # the tenant's name
    created_at: float
    revoked_at: float | None


def default_db_path() -> Path:
    """`SOBRIO_DB`, else gateway.db under the user's data directory (XDG_DATA_HOME or ~/.local/share)."""
    if os.environ.get("SOBRIO_DB"):
        return Path(os.environ["SOBRIO_DB"])
    data = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return data / "sobrio" / "gateway.db"


def load_secret(db_path: Path) -> bytes:
    """The server secret: `SOBRIO_SECRET`, or the file `<db>.secret` (mode 0600), made once if absent."""
    if os.environ.get("SOBRIO_SECRET"):
        return os.environ["SOBRIO_SECRET"].encode()
    path = db_path.with_name(db_path.name + ".secret")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_bytes()
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    return path.read_bytes()


class TenantStore:
    """The tenants and keys of one database file; each call is its own transaction."""

    def __init__(self, path: Path | str | None = None):
        self.path = Path(path) if path is not None else default_db_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.secret = load_secret(self.path)
        self.defaults = Limits()  # the configuration's [tenant_defaults], for the limits a tenant leaves unset
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: a commit is not fsynced (a power cut may lose the last ledger rows, never corrupt the
        # file); FULL cost 0.3 ms per request, most of the gate's time
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(tenants)")}
        for column, kind in (("default_model", "TEXT"), ("kv_offload", "INTEGER")):
            if column not in columns:  # a database from before the column
                self.db.execute(f"ALTER TABLE tenants ADD COLUMN {column} {kind}")

    def close(self) -> None:
        self.db.close()

    def create_tenant(self, name: str, limits: Limits = Limits()) -> Tenant:
        if not _NAME.fullmatch(name):
            raise TenantError(f"a tenant name is 1-64 letters, digits, '.', '_' or '-' (starting with a letter or "
                              f"digit), got {name!r}")
        tenant = Tenant(secrets.token_hex(8), name, time.time(), limits)
        try:
            self.db.execute("INSERT INTO tenants VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", _tenant_row(tenant))
        except sqlite3.IntegrityError:
            raise TenantError(f"tenant {name!r} exists already") from None
        return tenant

    def tenants(self) -> list[Tenant]:
        return [_tenant(row) for row in self.db.execute("SELECT * FROM tenants ORDER BY name")]

    def tenant(self, name: str) -> Tenant:
        row = self.db.execute("SELECT * FROM tenants WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise TenantError(f"no tenant named {name!r}")
        return _tenant(row)

    def has_tenants(self) -> bool:
        """Once one exists, every request needs a valid key."""
        return self.db.execute("SELECT 1 FROM tenants LIMIT 1").fetchone() is not None

    def set_limits(self, name: str, limits: Limits) -> None:
        tenant = Tenant(self.tenant(name).id, name, 0.0, limits)
        self.db.execute("UPDATE tenants SET requests_per_minute = ?, tokens_per_day = ?, max_concurrent = ?, "
                        "allowed_models = ?, allowed_regions = ?, default_model = ?, kv_offload = ? WHERE id = ?",
                        (*_tenant_row(tenant)[3:], tenant.id))

    def delete_tenant(self, name: str) -> None:
        """The tenant and its keys."""
        if self.db.execute("DELETE FROM tenants WHERE name = ?", (name,)).rowcount == 0:
            raise TenantError(f"no tenant named {name!r}")

    def create_key(self, tenant_name: str) -> tuple[ApiKey, str]:
        """A new key of the tenant and its text, which is not stored and cannot be shown again."""
        tenant = self.tenant(tenant_name)
        key_id = secrets.token_hex(6)
        text = f"{KEY_PREFIX}{key_id}-{secrets.token_urlsafe(32)}"
        key = ApiKey(key_id, tenant.name, time.time(), None)
        self.db.execute("INSERT INTO api_keys VALUES (?, ?, ?, ?, NULL)",
                        (key_id, tenant.id, self._hash(text), key.created_at))
        return key, text

    def keys(self, tenant_name: str | None = None) -> list[ApiKey]:
        query = ("SELECT k.key_id, t.name, k.created_at, k.revoked_at FROM api_keys k JOIN tenants t "
                 "ON k.tenant_id = t.id")
        rows = (self.db.execute(query + " ORDER BY t.name, k.created_at") if tenant_name is None else
                self.db.execute(query + " WHERE t.name = ? ORDER BY k.created_at", (self.tenant(tenant_name).name,)))
        return [ApiKey(*row) for row in rows]

    def revoke_key(self, key_id: str) -> None:
        """From now on the key resolves to no tenant (a 401); its row stays, for the record."""
        done = self.db.execute("UPDATE api_keys SET revoked_at = ? WHERE key_id = ? AND revoked_at IS NULL",
                               (time.time(), key_id)).rowcount
        if not done:
            raise TenantError(f"no active key with id {key_id!r}")

    def resolve(self, text: str) -> Tenant | None:
        """The tenant of a valid, unrevoked key; None for anything else (in constant time per key)."""
        match = _KEY.fullmatch(text or "")
        if match is None:
            return None
        row = self.db.execute("SELECT k.key_hash, t.* FROM api_keys k JOIN tenants t ON k.tenant_id = t.id "
                              "WHERE k.key_id = ? AND k.revoked_at IS NULL", (match.group(1),)).fetchone()
        if row is None or not hmac.compare_digest(row[0], self._hash(text)):
            return None
        tenant = _tenant(row[1:])
        return replace(tenant, limits=tenant.limits.or_defaults(self.defaults))

    def cache_salt(self, tenant: Tenant | str) -> str:
        """The prefix-cache salt of the tenant's requests: HMAC of the server secret and the tenant id."""
        tenant_id = tenant if isinstance(tenant, str) else tenant.id
        return hmac.new(self.secret, b"prefix-cache:" + tenant_id.encode(), hashlib.sha256).hexdigest()

    async def watch_deletions(self, on_deleted, interval_s: float = 5.0) -> None:
        """Call `on_deleted(salt)` for each tenant deleted since the last look (`sobrio admin tenants delete`
        from another process): the engines forget its cached blocks and shred its offloaded ones."""
        import asyncio

        known = {t.id for t in self.tenants()}
        while True:
            await asyncio.sleep(interval_s)
            now = {t.id for t in self.tenants()}
            for tenant_id in known - now:
                on_deleted(self.cache_salt(tenant_id))
            known = now

    def _hash(self, text: str) -> bytes:
        return hmac.new(self.secret, text.encode(), hashlib.sha256).digest()


def check_model_allowed(tenant: Tenant, *names: str) -> None:
    """A tenant limited to some models may use a model under any of its served names (403 otherwise)."""
    allowed = tenant.limits.allowed_models
    if allowed is not None and not set(names) & set(allowed):
        raise PermissionDeniedError(f"tenant {tenant.name!r} may not use model {names[0]!r}", param="model")


def _tenant_row(tenant: Tenant) -> tuple:
    lim = tenant.limits
    lists = [None if v is None else json.dumps(list(v)) for v in (lim.allowed_models, lim.allowed_regions)]
    return (tenant.id, tenant.name, tenant.created_at, lim.requests_per_minute, lim.tokens_per_day,
            lim.max_concurrent, *lists, lim.default_model, None if lim.kv_offload is None else int(lim.kv_offload))


def _tenant(row: tuple) -> Tenant:
    models, regions = (None if v is None else tuple(json.loads(v)) for v in row[6:8])
    kv_offload = None if row[9] is None else bool(row[9])
    return Tenant(row[0], row[1], row[2], Limits(row[3], row[4], row[5], models, regions, row[8], kv_offload))
