"""Which backend answers a request: a served model's replicas, their health, and the choice between them.

A model name maps to one or more replicas: the engine core loaded in this process (`LocalReplica`, in the
server's region) and OpenAI-compatible servers elsewhere (`RemoteReplica`: another sobrio, vLLM, llama.cpp's
server, a hosted API; `gateway/proxy.py` forwards to them). For each request `ModelBackends.choose` keeps
the replicas that are healthy and in a region the tenant allows (none in an allowed region: 403), then
prefers the one that has seen the longest prefix of this prompt (its prefix cache likely holds it), unless
that one has `balance_slack` more requests outstanding than the least loaded; otherwise the least loaded.

Prefix affinity works on text, as SGLang's cache-aware router does: the prompt is cut into blocks of
`PREFIX_BLOCK_CHARS` characters whose chained hashes each replica remembers (an LRU of hashes, in memory
only; never the text). Health: a remote replica that refuses a connection is out at once; a background
check (`Backends.watch`) probes every replica's /health and brings it back when it answers.
"""

import asyncio
import logging
import os
from collections.abc import Iterable

import httpx

from sobrio.distributed.balance import Balanced, chained_hashes, choose
from sobrio.engine.client import Served
from sobrio.errors import SobrioError
from sobrio.gateway.config import RemoteSpec
from sobrio.gateway.regions import region_allowed, region_refusal

logger = logging.getLogger("sobrio.gateway")

PREFIX_BLOCK_CHARS = 64  # about 16 tokens: one KV block of the engines' prefix caches
MAX_PREFIX_BLOCKS = 128  # 8 KB of prompt: past that, the first blocks decide
CLIENTS_PER_REPLICA = 8


class NoBackendAvailable(SobrioError):
    """Every replica of the model that the tenant may use is down (503)."""


def prefix_hashes(text: str) -> list[int]:
    """Chained hashes of the prompt's whole blocks: equal lists up to i mean equal text up to block i."""
    return chained_hashes(text, PREFIX_BLOCK_CHARS, MAX_PREFIX_BLOCKS)


class Replica(Balanced):
    """One backend of one model: its load, its health, the prompt prefixes it has seen."""

    is_remote = False

    def __init__(self, name: str, region: str):
        super().__init__()
        self.name = name  # in the ledger's `backend` column: "local:ITA", "remote:host:port"
        self.region = region

    @property
    def healthy(self) -> bool:
        return True


class LocalReplica(Replica):
    """The engine core of this process: its load is what its scheduler holds."""

    def __init__(self, engine: Served, region: str):
        super().__init__(f"local:{region}", region)
        self.engine = engine

    @property
    def healthy(self) -> bool:
        return self.engine.healthy

    @property
    def outstanding(self) -> int:
        stats = self.engine.stats()
        return stats.num_requests_running + stats.num_requests_waiting


class RemoteReplica(Replica):
    """An OpenAI-compatible server; its key is read from the environment variable the configuration names."""

    is_remote = True

    def __init__(self, spec: RemoteSpec):
        url = httpx.URL(spec.url)
        super().__init__(f"remote:{url.host}" + (f":{url.port}" if url.port else ""), spec.region)
        self.spec = spec
        key = os.environ.get(spec.api_key_env, "") if spec.api_key_env else ""
        if spec.api_key_env and not key:
            logger.warning("backend %s: environment variable %s is unset; calling it without a key", self.name,
                           spec.api_key_env)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.up = True
        self._clients: list[httpx.AsyncClient] = []
        self._turn = 0

    @property
    def healthy(self) -> bool:
        return self.up

    @property
    def client(self) -> httpx.AsyncClient:
        """One of `CLIENTS_PER_REPLICA` connection pools, in turn; made on first use, in the serving event
        loop. Several small pools, not one: httpcore scans its whole pool for each idle connection when a
        request starts or ends (quadratic), which cost the gateway 3 ms a request at 32 in flight."""
        if not self._clients:
            timeout = httpx.Timeout(self.spec.timeout_s, connect=min(5.0, self.spec.timeout_s))
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=16)
            self._clients = [httpx.AsyncClient(base_url=self.spec.url.rstrip("/") + "/", timeout=timeout,
                                               limits=limits) for _ in range(CLIENTS_PER_REPLICA)]
        self._turn = (self._turn + 1) % len(self._clients)
        return self._clients[self._turn]

    def mark(self, up: bool, why: str = "") -> None:
        """Take the replica out (a refused connection, a failed check) or bring it back; logged when it changes."""
        if up != self.up:
            if up:
                logger.info("backend %s is back", self.name)
            else:
                logger.warning("backend %s is out: %s", self.name, why)
        self.up = up

    async def check(self) -> None:
        try:
            response = await self.client.get(self.spec.health_url, headers=self.headers, timeout=5.0)
            self.mark(response.status_code == 200, f"health check answered {response.status_code}")
        except httpx.HTTPError as exc:
            self.mark(False, f"health check failed ({type(exc).__name__})")

    async def close(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self._clients))


class ModelBackends:
    """A served model's replicas and the rule that picks one per request."""

    def __init__(self, model: str, replicas: list[Replica], balance_slack: int = 4):
        assert replicas, f"model {model!r} needs at least one replica"
        self.model = model
        self.replicas = replicas
        self.balance_slack = balance_slack

    @property
    def local(self) -> LocalReplica | None:
        return next((r for r in self.replicas if isinstance(r, LocalReplica)), None)

    def choose(self, hashes: list[int], tenant=None, exclude: Iterable[Replica] = ()) -> Replica:
        """The replica for a request whose prompt has these prefix hashes; 403 when no replica is in a region
        the tenant allows, NoBackendAvailable when those that are are all down (or excluded)."""
        candidates = self._allowed(tenant)
        candidates = [r for r in candidates if r.healthy and r not in set(exclude)]
        if not candidates:
            raise NoBackendAvailable(f"no backend of model {self.model!r} is available; try again shortly")
        return choose(candidates, hashes, self.balance_slack)

    def _allowed(self, tenant) -> list[Replica]:
        allowed = tenant.limits.allowed_regions if tenant is not None else None
        replicas = [r for r in self.replicas if region_allowed(r.region, allowed)]
        if not replicas:
            raise region_refusal(tenant, self.model, [r.region for r in self.replicas])
        return replicas


class Backends:
    """Every served model's replicas, and the health checks of the remote ones."""

    def __init__(self, models: dict[str, ModelBackends], check_interval_s: float = 5.0):
        self.models = models
        self.check_interval_s = check_interval_s

    def remote_replicas(self) -> list[RemoteReplica]:
        return [r for m in self.models.values() for r in m.replicas if isinstance(r, RemoteReplica)]

    async def watch(self) -> None:
        """Probe every remote replica each `check_interval_s` (run as a task while the server runs)."""
        while True:
            await asyncio.gather(*(r.check() for r in self.remote_replicas()))
            await asyncio.sleep(self.check_interval_s)

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.remote_replicas()))
