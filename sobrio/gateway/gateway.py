"""The gateway of one server: tenants and their keys, routing (model "auto"), backends (local engines and
remote replicas), the usage ledger and the operator's dashboard, as one object the HTTP routes call.

It knows requests by what the edge (gateway/gate.py) put on their state: `tenant`, `ledger` (the request's
row), `response_headers`. It never builds an engine: the local ones come in as clients.
"""

import asyncio
import dataclasses
import hmac
import logging
from collections.abc import Awaitable, Callable

from sobrio.config import ServerConfig
from sobrio.engine.client import Served
from sobrio.errors import InvalidRequestError, PermissionDeniedError, SobrioError
from sobrio.gateway.backends import Backends, LocalReplica, ModelBackends, NoBackendAvailable, RemoteReplica
from sobrio.gateway.config import GatewayConfig
from sobrio.gateway.dashboard import dashboard_data, render
from sobrio.gateway.gate import bearer
from sobrio.gateway.ledger import Ledger
from sobrio.gateway.proxy import BackendFailed, forward, payload_for
from sobrio.gateway.regions import region_allowed, region_refusal
from sobrio.gateway.router import Router, RouterWeights
from sobrio.gateway.router_savings import RouterInfo
from sobrio.gateway.tenants import Tenant, TenantStore, check_model_allowed
from sobrio.timing import log_step

logger = logging.getLogger("sobrio.server")


class Gateway:
    """Owns the tenant store, the ledger, the router and the backends; started and stopped with the server."""

    def __init__(self, engines: dict[str, Served], region: str = "WLD"):
        self.region = region  # where the local engines run (--region)
        self.backends = Backends({name: ModelBackends(name, [LocalReplica(e, region)]) for name, e in engines.items()})
        self.store: TenantStore | None = None  # open_tenants': tenants (the dashboard names them)
        self.ledger: Ledger | None = None  # open_tenants': the usage ledger
        self.router: Router | None = None  # start_router's, when both of its models are served: model "auto"
        self.router_info: RouterInfo | None = None  # its models, evaluation and prices, for the dashboard
        self.operator_key: str | None = None  # --api-key: opens /dashboard
        self._tasks: list[asyncio.Task] = []

    def add_remotes(self, config: GatewayConfig) -> None:
        """The configuration file's remote replicas, beside (or instead of) each model's local engine."""
        for spec in config.models.values():
            remotes = [RemoteReplica(r) for r in spec.remotes]
            pool = self.backends.models.get(spec.name)
            if pool is None:
                self.backends.models[spec.name] = ModelBackends(spec.name, remotes)
            else:
                pool.replicas.extend(remotes)

    def open_tenants(self, db: str | None, config: GatewayConfig, operator_key: str | None) -> None:
        """The tenant store and its usage ledger (one SQLite file), with the configuration's tenant defaults."""
        self.store = TenantStore(db)
        self.store.defaults = config.tenant_defaults
        self.ledger = Ledger(self.store.db)
        self.operator_key = operator_key
        logger.info("tenants, keys and usage ledger: %s (%d tenant(s))", self.store.path, len(self.store.tenants()))

    def start_router(self, flags: ServerConfig, config: GatewayConfig, served: list[str]) -> Router | None:
        """Model "auto", when the served models include both of the router's (see `start_router`)."""
        self.router = start_router(flags, config, served)
        if self.router is not None:
            w = self.router.weights
            self.router_info = RouterInfo(w.small, w.large, w.quality, config.router.small_usd_per_mtok,
                                          config.router.large_usd_per_mtok)
        return self.router

    @staticmethod
    def admit(state, name: str, main: str) -> Tenant | None:
        """The request's tenant must be allowed the model under either name (403); its ledger row names the
        model asked for and the one serving. Returns the tenant (None without one)."""
        tenant, entry = getattr(state, "tenant", None), getattr(state, "ledger", None)
        if tenant is not None:
            check_model_allowed(tenant, name, main)
        if entry is not None:
            entry.requested_model = entry.requested_model or name
            entry.served_model = main
        return tenant

    def admit_local(self, state, name: str, main: str) -> None:
        """`admit`, and the local engines' region must be one the tenant allows (403)."""
        tenant = self.admit(state, name, main)
        if tenant is not None and not region_allowed(self.region, tenant.limits.allowed_regions):
            raise region_refusal(tenant, name, [self.region])

    def route(self, model: str | None, text: str, state, endpoint: str,
              can_answer: Callable[[str], bool]) -> str | None:
        """Model "auto": the router's choice for this text among the models that `can_answer` `endpoint`, said in
        response headers; any other name as it is; none: the tenant's default model, if it has one."""
        tenant = getattr(state, "tenant", None)
        if not model and tenant is not None:
            model = tenant.limits.default_model
        if model != "auto":
            return model
        if self.router is None:
            raise InvalidRequestError('model "auto" needs the router, which needs both of its models served: '
                                      "sobrio serve smollm2-135m --model gemma3-270m", param="model")
        chosen, score = self.router.choose(text)
        if not can_answer(chosen):
            weights = self.router.weights
            other = weights.small if chosen == weights.large else weights.large
            if not can_answer(other):
                raise InvalidRequestError(f'model "auto": neither {chosen} nor {other} can answer {endpoint} '
                                          "requests (no chat template)", param="model")
            chosen = other
        state.response_headers = [(b"x-sobrio-routed-to", chosen.encode()),
                                  (b"x-sobrio-router-score", f"{score:.3f}".encode())]
        if getattr(state, "ledger", None) is not None:
            state.ledger.requested_model = "auto"
            state.ledger.router_score = score
        return chosen

    def remote_pool(self, model: str | None) -> ModelBackends | None:
        """The model's backends when some are remote (None: the local engine takes the request)."""
        pool = self.backends.models.get(model) if model else None
        return pool if pool is not None and any(r.is_remote for r in pool.replicas) else None

    async def forward(self, pool: ModelBackends, model: str, endpoint: str, request: "RemoteCall"):
        """The answer of a chosen replica (a failure before its first byte retried once on another); None when
        the local replica is chosen. `request.guard` wraps the call (a client that leaves: None)."""
        tried, failure = [], None
        for _ in range(2):
            try:
                replica = pool.choose(request.hashes, request.tenant, exclude=tried)
            except NoBackendAvailable:
                raise failure or NoBackendAvailable(f"no backend of model {model!r} is available") from None
            if not replica.is_remote:
                return None
            payload = payload_for(replica, request.fields, request.salt, request.stream)
            try:
                return await request.guard(forward(replica, endpoint, payload, model, request.entry,
                                                   request.wants_usage))
            except BackendFailed as exc:
                tried.append(replica)
                failure = exc
        raise failure

    def usage(self, tenant: Tenant | None, since: float, limit: int) -> dict:
        """The caller's own ledger rows (newest first) and totals since `since` (epoch seconds)."""
        if self.ledger is None:
            raise InvalidRequestError("this server keeps no usage ledger")
        if not 1 <= limit <= 1000:
            raise InvalidRequestError("limit must be in [1, 1000]", param="limit")
        tenant_id = tenant.id if tenant is not None else None
        return {"object": "list", "tenant": tenant.name if tenant is not None else None,
                "data": self.ledger.rows(tenant_id, since, limit), "totals": self.ledger.totals(tenant_id, since)}

    def dashboard(self, key: str | None, authorization: str) -> str:
        """The operator's page, for the server's --api-key as `key` or a Bearer header."""
        if self.operator_key is None or self.ledger is None:
            raise PermissionDeniedError("the dashboard opens with the server's --api-key; start it with one",
                                        code=None)
        given = key or bearer(authorization.encode("latin-1"))
        if not hmac.compare_digest(given.encode(), self.operator_key.encode()):
            raise InvalidApiKey("invalid or missing API key")
        return render(dashboard_data(self.ledger, self.store, self.router_info))

    def start(self, purge: Callable[[str], None]) -> None:
        """Background work while serving (in the event loop): remote health checks, and `purge(salt)` for each
        tenant another process deleted."""
        if self.backends.remote_replicas():
            self._tasks.append(asyncio.create_task(self.backends.watch()))
        if self.store is not None:
            self._tasks.append(asyncio.create_task(self.store.watch_deletions(purge)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.backends.close()
        if self.store is not None:
            self.store.close()


class InvalidApiKey(SobrioError):
    """A key that opens nothing (401)."""

    status, error_type, code = 401, "invalid_request_error", "invalid_api_key"


@dataclasses.dataclass
class RemoteCall:
    """What a remote replica needs of one request."""

    fields: dict  # the request body as the client sent it
    salt: str | None
    stream: bool
    wants_usage: bool
    hashes: list[int]  # prefix affinity
    tenant: Tenant | None
    entry: object  # the request's ledger row, or None
    guard: Callable[[Awaitable], Awaitable]


def start_router(flags: ServerConfig, config: GatewayConfig, served: list[str]) -> Router | None:
    """Model "auto", when the served models (local or remote) include both of the router's: the weights'
    own two, or the configuration's [router] small and large. Its threshold: --router-threshold, else
    --router-strong-share, else [router] threshold or strong_share, else the weights' own."""
    spec = config.router
    weights = RouterWeights.load(flags.router_weights or spec.weights)
    weights = dataclasses.replace(weights, small=spec.small or weights.small, large=spec.large or weights.large)
    if not {weights.small, weights.large} <= set(served):
        logger.info('model "auto" is off: the router needs %s and %s served', weights.small, weights.large)
        return None
    threshold = next((t for t in (flags.router_threshold, _share_threshold(weights, flags.router_strong_share),
                                  spec.threshold, _share_threshold(weights, spec.strong_share)) if t is not None),
                     None)
    with log_step(logger, 'starting the router for model "auto" (%s and %s)', weights.small, weights.large):
        return Router(weights, threshold=threshold)


def _share_threshold(weights: RouterWeights, share: float | None) -> float | None:
    return None if share is None else weights.threshold_for_share(share)
