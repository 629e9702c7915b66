"""What model "auto" saved, per tenant, from the ledger: the share of its routed requests each model served,
the energy and cost saved against sending all of them to the strong (large) model, and the quality the
router's evaluation expects at that share (the cross-validated PGR curve stored with its weights).

Energy saved: the tokens the weak model served, at the strong model's measured joules per token (the ledger's
average over all its requests), less what they cost. Cost saved: those tokens at the difference of the two
prices per million tokens of the `[router]` table (`small_usd_per_mtok`, `large_usd_per_mtok`), when given.
"""

from dataclasses import dataclass, field

import numpy as np

from sobrio.gateway.ledger import Ledger


@dataclass(frozen=True)
class RouterInfo:
    small: str
    large: str
    quality: dict = field(default_factory=dict)  # RouterWeights.quality
    small_usd_per_mtok: float | None = None
    large_usd_per_mtok: float | None = None

    def expected_pgr(self, strong_share: float) -> float | None:
        """The share of the quality gap recovered at this share of strong calls, by the stored curve."""
        points = self.quality.get("curve")
        if not points:
            return None
        shares, pgr = zip(*points)
        return float(np.interp(strong_share, shares, pgr))


@dataclass
class TenantRouting:
    tenant_id: str | None
    to_small: int = 0
    to_large: int = 0
    small_tokens: int = 0
    small_joules: float = 0.0
    saved_j: float | None = None
    saved_usd: float | None = None
    expected_pgr: float | None = None

    @property
    def large_share(self) -> float:
        return self.to_large / max(1, self.to_small + self.to_large)


def query(ledger: Ledger, sql: str, args: tuple = ()) -> list[tuple]:
    """One read of the ledger's database, under its lock (the dashboard's queries too)."""
    with ledger.lock:
        return ledger.db.execute(sql, args).fetchall()


def joules_per_token(ledger: Ledger) -> dict[str, float]:
    """Each served model's measured (or estimated) joules per prompt+completion token, over all its requests."""
    return dict(query(ledger, "SELECT served_model, SUM(energy_j) / SUM(prompt_tokens + completion_tokens) "
                               "FROM usage WHERE energy_j IS NOT NULL AND prompt_tokens + completion_tokens > 0 "
                               "GROUP BY served_model"))


def per_tenant(ledger: Ledger, info: RouterInfo) -> list[TenantRouting]:
    """One summary per tenant that sent model "auto" requests served by one of the router's two models."""
    rows = query(ledger, "SELECT tenant_id, served_model, COUNT(*), COALESCE(SUM(prompt_tokens + "
                          "completion_tokens), 0), COALESCE(SUM(energy_j), 0) FROM usage WHERE requested_model = "
                          "'auto' AND served_model IN (?, ?) GROUP BY tenant_id, served_model",
                  (info.small, info.large))
    tenants: dict[str | None, TenantRouting] = {}
    for tenant_id, model, count, tokens, joules in rows:
        t = tenants.setdefault(tenant_id, TenantRouting(tenant_id))
        if model == info.small:
            t.to_small, t.small_tokens, t.small_joules = count, tokens, joules
        else:
            t.to_large = count
    per_token = joules_per_token(ledger)
    for t in tenants.values():
        if info.large in per_token:
            t.saved_j = t.small_tokens * per_token[info.large] - t.small_joules
        if info.small_usd_per_mtok is not None and info.large_usd_per_mtok is not None:
            t.saved_usd = t.small_tokens * (info.large_usd_per_mtok - info.small_usd_per_mtok) / 1e6
        t.expected_pgr = info.expected_pgr(t.large_share)
    return sorted(tenants.values(), key=lambda t: str(t.tenant_id))
