"""The gateway's configuration file: `sobrio serve --config gateway.toml`.

One TOML file describes what `sobrio serve` offers: its top-level keys are the server's flags (as a YAML
`--config` file's are: `port = 8000`, `region = "ITA"`), and three tables describe the gateway:

    [models.smollm2-135m]            # a model name clients ask for
    local = true                     # served by an engine core here (the name is an alias, folder or .gguf)
    [[models.smollm2-135m.remote]]   # and/or by OpenAI-compatible servers elsewhere (replicas)
    url = "http://10.0.0.7:8000/v1"  # the base URL, /v1 included
    model = "smollm2-135m"           # its name there (default: this table's name)
    api_key_env = "REPLICA_KEY"      # the environment variable that holds its key (never the key itself)
    region = "FRA"                   # where it runs: region policy and the CO2 of its energy
    kind = "sobrio"                  # sobrio | vllm | llama.cpp | openai (what it accepts: cache_salt, /health)
    timeout_s = 120
    joules_per_output_token = 0.3    # its energy, estimated from tokens (no meter of ours there)
    joules_per_prompt_token = 0.03

    [router]                         # model "auto": which two models, its weights and threshold
    small = "smollm2-135m"
    large = "gemma3-270m"
    threshold = 0.5                  # or: strong_share = 0.3 (the share of the training prompts sent to large)
    small_usd_per_mtok = 0.6         # prices per million tokens (optional): the dashboard's cost saved
    large_usd_per_mtok = 10.0

    [tenant_defaults]                # limits of every tenant that sets none of its own
    allowed_regions = ["EU"]
    requests_per_minute = 600

Without a file, `sobrio serve` serves its local models as it always did.
"""

import tomllib
from dataclasses import dataclass, field, fields

from sobrio.errors import ConfigError
from sobrio.gateway.carbon import region_code
from sobrio.gateway.tenants import Limits, TenantError

GATEWAY_TABLES = ("models", "router", "tenant_defaults")
KINDS = ("sobrio", "vllm", "llama.cpp", "openai")
# Energy of a remote backend, per token, when its table gives none: an order of magnitude, not a measurement.
# sobrio measures gemma3-270m at 0.29 J per output token on one CPU core; published figures for 7B-70B models
# on data-center GPUs run from about 0.1 to 4 J per output token (Samsi et al., "From Words to Watts", 2023).
# A prompt token costs about a tenth of an output token (it is computed in batches, compute-bound).
DEFAULT_JOULES_PER_OUTPUT_TOKEN = 0.3
DEFAULT_JOULES_PER_PROMPT_TOKEN = 0.03


@dataclass(frozen=True)
class RemoteSpec:
    """One OpenAI-compatible server that serves a model."""

    url: str
    model: str
    api_key_env: str | None = None
    region: str = "WLD"
    kind: str = "sobrio"
    timeout_s: float = 120.0
    joules_per_output_token: float = DEFAULT_JOULES_PER_OUTPUT_TOKEN
    joules_per_prompt_token: float = DEFAULT_JOULES_PER_PROMPT_TOKEN

    @property
    def sends_cache_salt(self) -> bool:
        """sobrio and vLLM take `cache_salt`: a tenant's salt reaches their prefix caches too."""
        return self.kind in ("sobrio", "vllm")

    @property
    def health_url(self) -> str:
        """/health at the server's root where it has one; a hosted API's model list otherwise."""
        base = self.url.rstrip("/")
        if self.kind == "openai":
            return f"{base}/models"
        return (base[:-3] if base.endswith("/v1") else base) + "/health"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    local: bool = False
    remotes: tuple[RemoteSpec, ...] = ()


@dataclass(frozen=True)
class RouterSpec:
    small: str | None = None
    large: str | None = None
    threshold: float | None = None
    strong_share: float | None = None
    weights: str | None = None
    small_usd_per_mtok: float | None = None  # prices per million tokens: the dashboard's cost saved
    large_usd_per_mtok: float | None = None


@dataclass(frozen=True)
class GatewayConfig:
    models: dict[str, ModelSpec] = field(default_factory=dict)
    router: RouterSpec = RouterSpec()
    tenant_defaults: Limits = Limits()

    @property
    def local_models(self) -> list[str]:
        return [m.name for m in self.models.values() if m.local]


def load_gateway_config(path: str | None) -> GatewayConfig:
    """The gateway tables of a TOML `--config` file (a YAML one, or none, has none)."""
    if path is None or not path.endswith(".toml"):
        return GatewayConfig()
    data = read_toml(path)
    models = _table(data, "models", path)
    router = _table(data, "router", path)
    share = router.get("strong_share")
    if share is not None and not (isinstance(share, (int, float)) and 0 <= share <= 1):
        raise ConfigError(f"--config {path}: router: strong_share must be in [0, 1], not {share!r}", option="--config")
    return GatewayConfig(models={name: _model(name, spec, path) for name, spec in models.items()},
                         router=_build(RouterSpec, router, path, "router"),
                         tenant_defaults=_limits(_table(data, "tenant_defaults", path), path))


def read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror or exc}", option="--config") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML ({exc})", option="--config") from None


def _table(data: dict, name: str, path: str) -> dict:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"--config {path}: [{name}] must be a table", option="--config")
    return value


def _model(name: str, spec: dict, path: str) -> ModelSpec:
    if not isinstance(spec, dict):
        raise ConfigError(f"--config {path}: [models.{name}] must be a table", option="--config")
    unknown = set(spec) - {"local", "remote"}
    if unknown:
        raise ConfigError(f"--config {path}: [models.{name}]: unknown key(s) {', '.join(sorted(unknown))} "
                          "(local, remote)", option="--config")
    remotes = spec.get("remote", [])
    remotes = [remotes] if isinstance(remotes, dict) else remotes
    built = tuple(_remote(name, r, path) for r in remotes)
    if not spec.get("local", False) and not built:
        raise ConfigError(f"--config {path}: model {name!r} has no backend: set local = true or add a "
                          f"[[models.{name}.remote]]", option="--config")
    return ModelSpec(name, bool(spec.get("local", False)), built)


def _remote(model: str, spec: dict, path: str) -> RemoteSpec:
    where = f"[[models.{model}.remote]]"
    if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
        raise ConfigError(f"--config {path}: {where} needs url = \"http://host:port/v1\"", option="--config")
    if not spec["url"].startswith(("http://", "https://")):
        raise ConfigError(f"--config {path}: {where}: url must start with http:// or https://", option="--config")
    spec = {"model": model, **spec, "region": region_code(spec.get("region"))}
    remote = _build(RemoteSpec, spec, path, where)
    if remote.kind not in KINDS:
        raise ConfigError(f"--config {path}: {where}: kind must be one of {', '.join(KINDS)}", option="--config")
    if remote.timeout_s <= 0:
        raise ConfigError(f"--config {path}: {where}: timeout_s must be positive", option="--config")
    return remote


def _limits(spec: dict, path: str) -> Limits:
    spec = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()}
    try:
        return _build(Limits, spec, path, "[tenant_defaults]")
    except TenantError as exc:
        raise ConfigError(f"--config {path}: [tenant_defaults]: {exc}", option="--config") from None


def _build(cls, spec: dict, path: str, where: str):
    """`cls(**spec)`, naming an unknown key and the keys it takes."""
    known = {f.name for f in fields(cls)}
    unknown = set(spec) - known
    if unknown:
        raise ConfigError(f"--config {path}: {where}: unknown key(s) {', '.join(sorted(unknown))} "
                          f"({', '.join(sorted(known))})", option="--config")
    return cls(**spec)

