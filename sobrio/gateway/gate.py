"""Who is calling, whether they may, and what they used: the gateway's layer in front of the API (ASGI).

For each `/v1` request: the Bearer key resolves to a tenant (`TenantStore`); once any tenant exists, a
request without a valid key gets 401 (the server's own `--api-key`, where set, still passes, as the
operator's key, with no tenant and no limits). The tenant's limits are checked (`TenantLimiter`: 429 with
Retry-After), its prefix-cache salt is put in the request's state for the endpoint to use in place of any
the client sent, and when the answer has ended, one `LedgerEntry` is written (usage metadata only).
"""

import hmac
import math
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass

from sobrio.gateway.energy import grams_co2
from sobrio.gateway.ledger import Ledger, LedgerEntry, start_of_utc_day
from sobrio.gateway.tenants import Tenant, TenantStore
from sobrio.server.errors import send_error
from sobrio.server.protocol import new_id


@dataclass(frozen=True)
class Refusal:
    message: str
    retry_after: int  # seconds


class TenantLimiter:
    """For POST requests (generation, embeddings; not listing models or usage): requests per minute (a
    sliding 60 s window), requests in flight, and tokens per UTC day (the ledger's finished requests; one in
    flight is counted when it ends)."""

    window_s = 60.0

    def __init__(self, ledger: Ledger | None, clock=time.monotonic):
        self.ledger = ledger
        self.clock = clock
        self.recent: dict[str, deque[float]] = defaultdict(deque)
        self.in_flight: Counter[str] = Counter()

    def admit(self, tenant: Tenant) -> Refusal | None:
        """None, and the request counts from now on (call `release` when it ends); or why not."""
        limits, now = tenant.limits, self.clock()
        if limits.max_concurrent is not None and self.in_flight[tenant.id] >= limits.max_concurrent:
            return Refusal(f"tenant {tenant.name!r} has {limits.max_concurrent} request(s) in flight, its limit", 1)
        recent = self.recent[tenant.id]
        while recent and recent[0] <= now - self.window_s:
            recent.popleft()
        if limits.requests_per_minute is not None and len(recent) >= limits.requests_per_minute:
            wait = math.ceil(recent[0] + self.window_s - now)
            return Refusal(f"tenant {tenant.name!r} is over {limits.requests_per_minute} requests per minute", wait)
        if limits.tokens_per_day is not None and self.ledger is not None:
            day = start_of_utc_day()
            if self.ledger.tokens_since(tenant.id, day) >= limits.tokens_per_day:
                wait = math.ceil(day + 86400 - time.time())
                return Refusal(f"tenant {tenant.name!r} has used its {limits.tokens_per_day} tokens for today "
                               "(UTC)", wait)
        recent.append(now)
        self.in_flight[tenant.id] += 1
        return None

    def release(self, tenant: Tenant) -> None:
        self.in_flight[tenant.id] -= 1
        assert self.in_flight[tenant.id] >= 0


class TenantGate:
    """The layer between the limits (body read) and FastAPI. Without a store it is `--api-key`'s check alone."""

    def __init__(self, app, api_key: str | None, store: TenantStore | None = None, ledger: Ledger | None = None,
                 region: str = "WLD"):
        self.app = app
        self.region = region  # where the local engines run: their energy's grid carbon intensity
        self.operator = f"Bearer {api_key}".encode() if api_key else None
        self.store = store
        self.ledger = ledger
        self.limiter = TenantLimiter(ledger)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)  # CORS preflights carry no credentials
            return
        authorization = header(scope, b"authorization") or b""
        operator = self.operator is not None and hmac.compare_digest(authorization, self.operator)
        tenant = None if operator or self.store is None else self.store.resolve(bearer(authorization))
        if tenant is None and not operator and (self.operator is not None or self._has_tenants()):
            await send_error(send, 401, "invalid or missing API key", "invalid_request_error", "invalid_api_key")
            return
        state = scope.setdefault("state", {})
        state["tenant"] = tenant
        if tenant is not None:
            state["tenant_salt"] = self.store.cache_salt(tenant)
        await self._metered(scope, receive, send, tenant)

    def _has_tenants(self) -> bool:
        return self.store is not None and self.store.has_tenants()

    async def _metered(self, scope, receive, send, tenant: Tenant | None) -> None:
        """Run the request within the tenant's limits; write its ledger row when its answer has ended."""
        state, started = scope["state"], time.monotonic()
        entry = LedgerEntry(request_id="", tenant_id=tenant.id if tenant else None, created_at=time.time(),
                            endpoint=scope["path"][:64])
        state["ledger"] = entry
        metered = tenant is not None and scope["method"] == "POST"  # listing models or usage is free
        refusal = self.limiter.admit(tenant) if metered else None
        if refusal is not None:
            entry.status = 429
            await send_error(send, 429, refusal.message, "rate_limit_error", "rate_limit_exceeded",
                             {"Retry-After": str(max(1, refusal.retry_after))})
            self._record(entry, state, started, scope)
            return

        async def send_noting_status(message) -> None:
            if message["type"] == "http.response.start":
                entry.status = entry.status or message["status"]
                extra = state.get("response_headers", [])  # the router's choice
                if entry.energy_j is not None:  # known before the answer starts unless it streams
                    self._note_co2(entry)
                    extra = [*extra, *_energy_headers(entry)]
                if extra:
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            if metered:
                self.limiter.release(tenant)
            self._record(entry, state, started, scope)

    def _note_co2(self, entry: LedgerEntry) -> None:
        """The CO2 of a local engine's energy, by this server's region (a remote backend's is the proxy's)."""
        if entry.co2_g is None:
            entry.co2_g = grams_co2(entry.energy_j, self.region)
        entry.backend = entry.backend or f"local:{self.region}"

    def _record(self, entry: LedgerEntry, state: dict, started: float, scope) -> None:
        if self.ledger is None or scope["method"] != "POST":
            return
        entry.request_id = str(state.get("request_id") or new_id("req"))
        if entry.energy_j is not None and entry.co2_g is None:
            self._note_co2(entry)  # a stream's: its energy came after its headers
        entry.duration_s = time.monotonic() - started
        entry.status = entry.status or 499  # no answer began: the client went away first
        self.ledger.record(entry)


def cache_salt(state, requested: str | None) -> str | None:
    """A request's prefix-cache salt: its tenant's (set by the gate) in place of any the client sent."""
    return getattr(state, "tenant_salt", None) or requested


def kv_offload_policy(state) -> bool | None:
    """Whether a request's KV may go to the offload tiers: its tenant's choice (off unless it opted in:
    Zero Data Retention), or None, the server's default, for a request without a tenant."""
    tenant = getattr(state, "tenant", None)
    return None if tenant is None else bool(tenant.limits.kv_offload)


def header(scope, name: bytes) -> bytes | None:
    """An ASGI request header's first value."""
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _energy_headers(entry: LedgerEntry) -> list[tuple[bytes, bytes]]:
    return [(b"x-sobrio-energy-joules", f"{entry.energy_j:.4g}".encode()),
            (b"x-sobrio-co2-grams", f"{entry.co2_g:.4g}".encode()),
            (b"x-sobrio-energy-source", (entry.energy_source or "none").encode())]


def bearer(authorization: bytes) -> str:
    """The token of an `Authorization: Bearer <token>` value ("" for any other scheme)."""
    scheme, _, token = authorization.decode("latin-1").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""
