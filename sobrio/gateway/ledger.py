"""The usage ledger: one row per API request, usage metadata only (Zero Data Retention).

The table's columns are `COLUMNS`, and nothing else: ids, names of models, token counts, timings, the
status code. No column can hold a prompt, a completion, a tool argument or a client-chosen string other
than the model name the client asked for (checked against the served names before it is written, so an
unknown name is stored as NULL). `tests/server/test_gateway.py` reads the schema back and compares.

Rows are written by `TenantGate` when a request's answer has ended, whatever the path: success, stream,
client gone, 4xx, 5xx. `GET /v1/usage` gives a tenant its own rows and totals.
"""

import sqlite3
import threading
import time
import typing
from dataclasses import asdict, dataclass, fields


@dataclass
class LedgerEntry:
    """What one request used; the endpoints fill it in as they learn it (a stream, as it goes)."""

    request_id: str
    tenant_id: str | None
    created_at: float
    endpoint: str
    requested_model: str | None = None
    served_model: str | None = None
    backend: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    duration_s: float | None = None
    status: int | None = None
    energy_j: float | None = None
    co2_g: float | None = None
    energy_source: str | None = None
    router_score: float | None = None  # model "auto": the router's score for this request (served_model: its pick)


COLUMNS = tuple(f.name for f in fields(LedgerEntry))


def _sql_type(annotation) -> str:
    base = next(t for t in (typing.get_args(annotation) or (annotation,)) if t is not type(None))
    return {int: "INTEGER", float: "REAL", str: "TEXT"}[base]


SCHEMA = ("CREATE TABLE IF NOT EXISTS usage (" + ", ".join(f"{f.name} {_sql_type(f.type)}" for f in fields(LedgerEntry))
          + "); CREATE INDEX IF NOT EXISTS usage_by_tenant ON usage (tenant_id, created_at);")


class Ledger:
    """The `usage` table of the gateway's database (the tenants' file). Calls come from the event loop and
    from threads: one lock around the one connection."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db
        self.lock = threading.Lock()
        with self.lock:
            self.db.executescript(SCHEMA)
            have = {row[1] for row in self.db.execute("PRAGMA table_info(usage)")}
            for f in fields(LedgerEntry):  # a database written by an older sobrio: its new columns, empty
                if f.name not in have:
                    self.db.execute(f"ALTER TABLE usage ADD COLUMN {f.name} {_sql_type(f.type)}")

    def record(self, entry: LedgerEntry) -> None:
        row = asdict(entry)
        with self.lock:
            self.db.execute(f"INSERT INTO usage ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
                            [row[c] for c in COLUMNS])

    def tokens_since(self, tenant_id: str, since: float) -> int:
        """Prompt and completion tokens the tenant used since `since` (epoch seconds)."""
        with self.lock:
            row = self.db.execute("SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0) FROM usage "
                                  "WHERE tenant_id IS ? AND created_at >= ?", (tenant_id, since)).fetchone()
        return int(row[0])

    def rows(self, tenant_id: str | None, since: float = 0.0, limit: int = 100) -> list[dict]:
        """The tenant's newest rows first (tenant None: the requests made without a tenant)."""
        with self.lock:
            cursor = self.db.execute(f"SELECT {', '.join(COLUMNS)} FROM usage WHERE tenant_id IS ? AND "
                                     "created_at >= ? ORDER BY created_at DESC LIMIT ?", (tenant_id, since, limit))
            return [dict(zip(COLUMNS, row)) for row in cursor]

    def totals(self, tenant_id: str | None, since: float = 0.0) -> dict:
        with self.lock:
            row = self.db.execute(
                "SELECT COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0), "
                "COALESCE(SUM(cached_tokens), 0), COALESCE(SUM(energy_j), 0), COALESCE(SUM(co2_g), 0) "
                "FROM usage WHERE tenant_id IS ? AND created_at >= ?", (tenant_id, since)).fetchone()
        keys = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "energy_j", "co2_g")
        return dict(zip(keys, row))


def start_of_utc_day(now: float | None = None) -> float:
    """When the tenants' token-per-day budgets last reset (midnight UTC)."""
    now = time.time() if now is None else now
    return now - now % 86400
