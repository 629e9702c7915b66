"""Region policy: a tenant limited to some regions (`sobrio admin tenants create --regions EU`) is served
only by backends that run in one of them (a local engine runs in the server's `--region`, a remote one where
the configuration says); when none does, it gets 403. A region is an ISO 3166 alpha-3 code (the
`--region` a server runs in), and `EU` names the 27 member states. A server without `--region` is in no
known region, so it serves no restricted tenant."""

from sobrio.errors import PermissionDeniedError

EU_MEMBERS = frozenset({"AUT", "BEL", "BGR", "HRV", "CYP", "CZE", "DNK", "EST", "FIN", "FRA", "DEU", "GRC", "HUN",
                        "IRL", "ITA", "LVA", "LTU", "LUX", "MLT", "NLD", "POL", "PRT", "ROU", "SVK", "SVN", "ESP",
                        "SWE"})


def region_allowed(region: str, allowed: tuple[str, ...] | None) -> bool:
    """Whether a backend in `region` may serve a tenant allowed `allowed` (None: anywhere)."""
    if allowed is None:
        return True
    names = {a.strip().upper() for a in allowed}
    return region.upper() in names or ("EU" in names and region.upper() in EU_MEMBERS)


def region_refusal(tenant, model: str, regions: list[str]) -> PermissionDeniedError:
    """The 403 of a tenant whose allowed regions hold none of the model's backends."""
    return PermissionDeniedError(f"tenant {tenant.name!r} may be served only in "
                                 f"{', '.join(tenant.limits.allowed_regions)}; model {model!r} is served in "
                                 f"{', '.join(sorted(set(regions)))}", param="model", code="region_not_allowed")
