"""`sobrio serve`'s own settings: what the HTTP process listens on, how it bounds clients, and CORS.

They stay in the API process: the engine cores never see them. `LimitsConfig` and `CorsConfig` are
nested in `ServerConfig`; `server/limits.py` and `server/edge.py` enforce them.
"""

import argparse
import json
import os
from dataclasses import dataclass, field

from sobrio.config.fields import Checked, flag

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def str_list(value: str) -> list[str]:
    """vLLM takes JSON lists (`'["*"]'`); a comma-separated list is accepted too."""
    value = value.strip()
    if value.startswith("["):
        items = json.loads(value)
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return items
    return [v.strip() for v in value.split(",") if v.strip()]


@dataclass(frozen=True)
class LimitsConfig(Checked):
    """Bounds on what one client can make the server hold. Roomy for any real request to these models, small
    enough that one client cannot pin the server (docs/server.md, "Limits")."""

    # a 128k-token context as text (non-ASCII escaped as \uXXXX too) fits
    max_body_bytes: int = flag(4 << 20, "largest request body, counted while it is read, chunked or not (413)")
    max_prompts_per_request: int = flag(256, "most prompts in one completions request (400)")
    # 1/16 of the default waiting queue (4096)
    max_seqs_per_request: int = flag(256, "most sequences (prompts x n) in one request (400); a request whose "
                                          "sequences do not fit in the waiting queue now gets 429 before it is "
                                          "tokenized")
    # e.g. a full 8k context with n=16
    max_request_tokens: int = flag(128 << 10, "most prompt tokens x n one request may queue (400)")
    header_timeout: float = flag(10.0, "seconds a client has to send a request's line and headers (408, then close)")
    # whole body; at the size limit that is >= 140 kB/s
    body_timeout: float = flag(30.0, "seconds a client has to send a whole request body (408, then close)")
    limit_concurrency: int = flag(1024, "most open connections or requests in flight; past it 429 with Retry-After")

    def __post_init__(self) -> None:
        self._at_least(1, "max_body_bytes", "max_prompts_per_request", "max_seqs_per_request", "max_request_tokens",
                       "limit_concurrency")
        for name in ("header_timeout", "body_timeout"):
            self._require(name, getattr(self, name) > 0, "> 0 seconds")


@dataclass(frozen=True)
class CorsConfig(Checked):
    """vLLM's CORS flags. Unlike vLLM (`*`), the default admits only loopback origins (a UI on this machine):
    a server on 127.0.0.1 without a key should not answer any web page a user happens to visit."""

    allowed_origins: list[str] = flag([], 'CORS origins, a JSON list or comma-separated (\'["*"]\' for any); '
                                          "default: loopback origins only (http://localhost:*, http://127.0.0.1:*)",
                                      type=str_list)
    allowed_methods: list[str] = flag(["*"], "CORS methods", type=str_list)
    allowed_headers: list[str] = flag(["*"], "CORS headers", type=str_list)
    allow_credentials: bool = flag(False, "CORS: allow credentials")


@dataclass(frozen=True)
class ServerConfig(Checked):
    """The HTTP process: which models, where it listens, how it logs, drains and restarts engine cores."""

    model_tag: str | None = flag(None, "the model to serve, as in `vllm serve MODEL`: alias, HF folder or .gguf "
                                       "(default: every installed alias)", positional=True)
    model: list[str] | None = flag(None, "alias, HF folder or .gguf (repeatable; served after MODEL if both are "
                                         "given)", action="append")
    served_model_name: list[str] | None = flag(None, "names the models are served under, one per model in order; "
                                                     "one model takes every name given, the first its main one "
                                                     "(repeatable)", nargs="+")
    config: str | None = flag(None, "YAML file of flags: keys are the flag names without -- (`max-model-len: 512`, "
                                    "`model: smollm2-135m`); the command line wins over the file. A .toml file "
                                    "takes the same keys and the gateway's tables: [models.NAME] with local "
                                    "engines and remote replicas, [router], [tenant_defaults] "
                                    "(sobrio/gateway/config.py)")
    host: str = flag("127.0.0.1", "address to listen on")
    port: int = flag(8000, "port to listen on (checked before any model loads)")
    root_path: str | None = flag(None, "path prefix behind a path-routing proxy (`/api`): every route answers "
                                       "under it as well as without it")
    ssl_keyfile: str | None = flag(None, "TLS private key file (PEM): serve HTTPS, with --ssl-certfile")
    ssl_certfile: str | None = flag(None, "TLS certificate file (PEM): serve HTTPS, with --ssl-keyfile")
    ssl_ca_certs: str | None = flag(None, "CA certificates file to check client certificates against")
    ssl_cert_reqs: int = flag(0, "client certificate: 0 not asked, 1 optional, 2 required (Python's ssl.CERT_*)")
    api_key: str | None = flag(None, "Bearer key every request must carry but those to the open routes (/health, "
                                     "/ping, /version, /metrics, /docs, /dashboard) (none: no key); with "
                                     "tenants, the operator's key (no tenant, no limits)")
    region: str | None = flag(None, "where this server runs, for the CO2 of its energy: an ISO 3166 alpha-3 code "
                                     "(ITA, FRA, DEU, SWE, ...) or a country's name (default: the world average)")
    router_weights: str | None = flag(None, 'model "auto"\'s difficulty classifier (`sobrio router train --out`); '
                                            "default: sobrio's own, for smollm2-135m and gemma3-270m. The "
                                            "router runs when both of its models are served")
    router_threshold: float | None = flag(None, 'score from which model "auto" goes to the large model, in [0, 1]: '
                                                "lower, more quality and more large calls (`sobrio router eval`); "
                                                "default: the weights' own")
    router_strong_share: float | None = flag(None, 'model "auto"\'s threshold as the share of prompts sent to the '
                                                   "strong (large) model, in [0, 1]: the threshold that sent that "
                                                   "share of the router's training prompts there (RouteLLM's "
                                                   "calibration); default: --router-threshold, else the weights' own")
    agent_skills: str | None = flag(None, "the skills source (a folder, or REPO@COMMIT:PATH) that teams sent to "
                                          "POST /v1/agents/runs may use (unset: none)")
    db: str | None = flag(None, "the gateway's SQLite file: tenants, their keys (`sobrio admin`) and the usage ledger "
                                "(default: $SOBRIO_DB, else gateway.db under ~/.local/share/sobrio); once a tenant "
                                "exists, every request but those to the open routes needs a tenant's key")
    log_level: str = flag("info", "trace adds uvicorn's per-connection lines (never ASGI scopes: they hold query "
                                  "strings)", choices=LOG_LEVELS)
    uvicorn_log_level: str | None = flag(None, "uvicorn's own log level (default: --log-level's)", choices=LOG_LEVELS)
    disable_log_requests: bool = flag(False, "no log line per finished request (its id, model, token counts and "
                                             "timings; never its text)")
    enable_log_requests: bool = flag(False, "accepted (vLLM's newer spelling); requests are logged unless "
                                            "--disable-log-requests")
    enable_auto_tool_choice: bool = flag(False, "accepted (vLLM's): a request with `tools` always gets its calls "
                                                "parsed, `tool_choice` auto included")
    tool_call_parser: str | None = flag(None, "accepted as hermes, vLLM's name for the <tool_call> format sobrio "
                                              "prompts for, enforces and parses (server/tool_calls.py)",
                                        choices=("hermes",))
    metrics_require_key: bool = flag(False, "/metrics needs a key as the API does (--api-key, or a tenant's once "
                                             "tenants exist); off: /metrics is open to scrapers, as vLLM's")
    disable_log_stats: bool = flag(False, "no periodic line per model (every 10 s while busy): throughput, running "
                                          "and waiting requests, KV-cache use, prefix-cache hits")
    default_max_tokens: int = flag(1024, "max_tokens of a request that gives none (chat), capped at what the "
                                         "context leaves; 0: up to the end of the context (vLLM's default)")
    shutdown_timeout: float = flag(30.0, "seconds in-flight requests get to finish after SIGTERM; those still "
                                         "running then end with an OpenAI error (streams: an error event, then "
                                         "[DONE])")
    engine_process: bool = flag(True, "run each model's engine core in a process of its own, so the HTTP event "
                                      "loop and the model do not share one interpreter; --no-engine-process keeps "
                                      "it in a thread of the server process")
    engine_restarts: int = flag(3, "times a dead engine core is restarted (its requests in flight fail at once) "
                                   "before the server exits with status 1 for its supervisor")
    metrics_prefix: str = flag("sobrio", "prefix of the /metrics names; vllm publishes vLLM's names "
                                         "(vllm:num_requests_running, ...) for existing vLLM dashboards",
                               choices=("sobrio", "vllm"))
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    cors: CorsConfig = field(default_factory=CorsConfig)

    def __post_init__(self) -> None:
        self._require("port", 1 <= self.port <= 65535, "in [1, 65535]")
        self._require("host", bool(self.host), "an address")
        self._require("api_key", self.api_key is None or bool(self.api_key), "a non-empty key (or unset)")
        self._require("log_level", self.log_level in LOG_LEVELS, f"one of {', '.join(LOG_LEVELS)}")
        self._require("uvicorn_log_level", self.uvicorn_log_level in (None, *LOG_LEVELS),
                      f"one of {', '.join(LOG_LEVELS)}")
        self._require("root_path", self.root_path is None or (self.root_path.startswith("/")
                                                             and not self.root_path.endswith("/")),
                      "a path that starts with / and does not end with / (`/api`)")
        self._require("ssl_certfile", (self.ssl_keyfile is None) == (self.ssl_certfile is None),
                      "given together with --ssl-keyfile")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "config"):
            path = getattr(self, name)
            self._require(name, path is None or os.path.isfile(path), "a readable file")
        self._require("ssl_cert_reqs", self.ssl_cert_reqs in (0, 1, 2), "0, 1 or 2")
        self._at_least(0, "default_max_tokens", "engine_restarts")
        self._require("shutdown_timeout", self.shutdown_timeout > 0, "> 0 seconds")
        self._require("router_threshold", self.router_threshold is None or 0 <= self.router_threshold <= 1,
                      "in [0, 1]")
        self._require("router_strong_share", self.router_strong_share is None or 0 <= self.router_strong_share <= 1,
                      "in [0, 1]")
