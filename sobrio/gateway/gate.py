"""Who is calling, whether they may, and what they used: the gateway's layer in front of the API (ASGI).

For each request to a route other than the open ones (`OPEN_ROUTES`: probes, the version, /metrics, the
API's own docs, and /dashboard, which checks the operator's key itself) and to any `/v1` path: the Bearer
key resolves to a tenant (`TenantStore`); once any tenant exists, a request without a valid key gets 401
(the server's own `--api-key`, where set, still passes, as the operator's key, with no tenant and no
limits). The tenant's limits are checked (`TenantLimiter`: 429 with Retry-After), its prefix-cache salt is
put in the request's state for the endpoint to use in place of any the client sent, and when the answer has
ended, one `LedgerEntry` is written (usage metadata only; the endpoint is the route's template).

Budgets hold under concurrency: once an endpoint knows a request's worst case (prompt tokens plus
max_tokens for each sequence, or the context when max_tokens is unset), `reserve_tokens` holds it against
the tenant's tokens per day beside what the ledger counted (429 when it does not fit); the reservation is
given back when the request ends, however it ends, after its ledger row holds what it really used.
"""

import hmac
import math
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass

from sobrio.errors import BudgetExceededError, send_error
from sobrio.gateway.carbon import grams_co2
from sobrio.gateway.ledger import Ledger, LedgerEntry, start_of_utc_day
from sobrio.gateway.tenants import Tenant, TenantStore
from sobrio.ids import new_id

# Routes any client may call: probes, the version, /metrics (unless --metrics-require-key), the API's
# documentation; /dashboard checks the operator's key itself (header or ?key=). Every other route, and any /v1
# path, is behind the gate.
OPEN_ROUTES = frozenset({"/health", "/ping", "/version", "/metrics", "/dashboard", "/docs", "/docs/oauth2-redirect",
                         "/redoc", "/openapi.json"})


@dataclass(frozen=True)
class Refusal:
    message: str
    retry_after: int  # seconds


class TenantLimiter:
    """For POST requests (generation, embeddings, tokenizing; not listing models or usage): requests per
    minute (a sliding 60 s window), requests in flight, and tokens per UTC day: the ledger's finished
    requests plus the worst cases reserved by those in flight (`reserve`)."""

    window_s = 60.0

    def __init__(self, ledger: Ledger | None, clock=time.monotonic):
        self.ledger = ledger
        self.clock = clock
        self.recent: dict[str, deque[float]] = defaultdict(deque)
        self.in_flight: Counter[str] = Counter()
        self.reserved: Counter[str] = Counter()  # tokens held by requests in flight, per tenant

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
            if self._tokens_used(tenant) + self.reserved[tenant.id] >= limits.tokens_per_day:
                return Refusal(f"tenant {tenant.name!r} has used its {limits.tokens_per_day} tokens for today "
                               "(UTC)", _until_midnight())
        recent.append(now)
        self.in_flight[tenant.id] += 1
        return None

    def _tokens_used(self, tenant: Tenant) -> int:
        return self.ledger.tokens_since(tenant.id, start_of_utc_day())

    def reserve(self, tenant: Tenant, tokens: int) -> Refusal | None:
        """Hold `tokens` (a request's worst case) against the tenant's tokens per day, or why not: the
        finished requests' tokens, the reservations of those in flight and this one must fit."""
        budget = tenant.limits.tokens_per_day
        if budget is None or self.ledger is None:
            return None
        used, held = self._tokens_used(tenant), self.reserved[tenant.id]
        if used + held + tokens > budget:
            alone = used + tokens > budget  # it would not fit even once those in flight have ended
            return Refusal(f"tenant {tenant.name!r}: this request may use up to {tokens} tokens (prompt + "
                           f"max_tokens), and {max(0, budget - used - held)} of its {budget} tokens for today "
                           "(UTC) are left" + ("" if alone else " while its other requests run"),
                           _until_midnight() if alone else 1)
        self.reserved[tenant.id] += tokens
        return None

    def release(self, tenant: Tenant, reserved_tokens: int = 0) -> None:
        """The request has ended (its ledger row is written): its slot and its reservation come back."""
        self.in_flight[tenant.id] -= 1
        self.reserved[tenant.id] -= reserved_tokens
        assert self.in_flight[tenant.id] >= 0 and self.reserved[tenant.id] >= 0


@dataclass
class TokenReservation:
    """What a metered request holds of its tenant's tokens per day (`reserve_tokens`)."""

    limiter: TenantLimiter
    tenant: Tenant
    tokens: int = 0


def reserve_tokens(state, tokens: int) -> None:
    """Hold a request's worst case against its tenant's daily token budget (BudgetExceededError, a 429, when
    it does not fit); given back when the request ends. No tenant, or no budget: nothing to hold."""
    reservation = getattr(state, "token_reservation", None)
    if reservation is None:
        return
    refusal = reservation.limiter.reserve(reservation.tenant, tokens)
    if refusal is not None:
        raise BudgetExceededError(refusal.message, refusal.retry_after)
    reservation.tokens += tokens


def _until_midnight() -> int:
    """Seconds until the tenants' daily budgets reset (midnight UTC)."""
    return math.ceil(start_of_utc_day() + 86400 - time.time())


class TenantGate:
    """The layer between the limits (body read) and FastAPI. Without a store it is `--api-key`'s check alone."""

    def __init__(self, app, api_key: str | None, store: TenantStore | None = None, ledger: Ledger | None = None,
                 region: str = "WLD", metrics_require_key: bool = False):
        self.app = app
        self.open_routes = OPEN_ROUTES - {"/metrics"} if metrics_require_key else OPEN_ROUTES
        self.region = region  # where the local engines run: their energy's grid carbon intensity
        self.operator = f"Bearer {api_key}".encode() if api_key else None
        self.store = store
        self.ledger = ledger
        self.limiter = TenantLimiter(ledger)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not self._gated(scope):
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

    def _gated(self, scope) -> bool:
        """Whether a request needs a key (once keys exist): every route but the open ones, any /v1 path."""
        route = scope.get("state", {}).get("route")
        if route is None or route == "unknown":
            return scope["path"].startswith("/v1")
        return route not in self.open_routes

    def _has_tenants(self) -> bool:
        return self.store is not None and self.store.has_tenants()

    async def _metered(self, scope, receive, send, tenant: Tenant | None) -> None:
        """Run the request within the tenant's limits; write its ledger row when its answer has ended."""
        state, started = scope["state"], time.monotonic()
        entry = LedgerEntry(request_id="", tenant_id=tenant.id if tenant else None, created_at=time.time(),
                            endpoint=state.get("route") or "unknown")  # a template, never the path sent
        state["ledger"] = entry
        metered = tenant is not None and scope["method"] == "POST"  # listing models or usage is free
        refusal = self.limiter.admit(tenant) if metered else None
        if metered and refusal is None:
            state["token_reservation"] = TokenReservation(self.limiter, tenant)
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
            try:
                self._record(entry, state, started, scope)  # first: its real tokens count before the hold goes
            finally:
                if metered:
                    self.limiter.release(tenant, state["token_reservation"].tokens)

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
