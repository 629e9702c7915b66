"""`/dashboard`: one HTML page of what the ledger knows, for the operator (the server's `--api-key`, as a
Bearer header or `?key=`). Per tenant and per model: requests, tokens, cached tokens, energy and CO2; tokens
per hour over the last day; the router's split, and per tenant the share each model served, the energy and
cost saved against sending everything to the large model and the quality the router's evaluation expects.
Charts are SVG drawn here: no script, no build step, nothing fetched. Like the ledger, it holds no prompt or
completion text."""

import html
import time

from sobrio.gateway.ledger import Ledger
from sobrio.gateway.router_savings import RouterInfo, TenantRouting, per_tenant, query
from sobrio.gateway.tenants import TenantStore

_TOTALS = ("COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0), "
           "COALESCE(SUM(cached_tokens), 0), COALESCE(SUM(energy_j), 0), COALESCE(SUM(co2_g), 0)")
_COLUMNS = ("requests", "prompt tokens", "completion tokens", "cached tokens", "energy (J)", "CO2 (g)")


def dashboard_data(ledger: Ledger, store: TenantStore | None, router: RouterInfo | None) -> dict:
    names = {t.id: t.name for t in store.tenants()} if store is not None else {}
    tenants = [(_name(names, tid), *rest)
               for tid, *rest in query(ledger, f"SELECT tenant_id, {_TOTALS} FROM usage GROUP BY tenant_id")]
    models = query(ledger, f"SELECT COALESCE(served_model, '(none)'), {_TOTALS} FROM usage GROUP BY served_model")
    since = time.time() - 86400
    hourly = query(ledger, "SELECT CAST(created_at / 3600 AS INTEGER), COALESCE(served_model, '(none)'), "
                            "SUM(prompt_tokens + completion_tokens) FROM usage WHERE created_at >= ? "
                            "GROUP BY 1, 2 ORDER BY 1", (since,))
    routed = dict(query(ledger, "SELECT served_model, COUNT(*) FROM usage WHERE requested_model = 'auto' "
                                 "GROUP BY served_model"))
    routing = per_tenant(ledger, router) if router is not None else []
    saved = [t.saved_j for t in routing if t.saved_j is not None]
    return {"tenants": tenants, "models": models, "hourly": hourly, "routed": routed,
            "saved_j": sum(saved) if saved else None, "router": router,
            "routing": [(_name(names, t.tenant_id), t) for t in routing]}


def _name(names: dict, tenant_id: str | None) -> str:
    return names.get(tenant_id, "(no tenant)" if tenant_id is None else tenant_id)


def render(data: dict) -> str:
    routed = data["routed"]
    total_routed = sum(routed.values())
    split = ", ".join(f"{m}: {n} ({n / total_routed:.0%})" for m, n in sorted(routed.items())) or "no routed requests"
    saved = "n/a" if data["saved_j"] is None else f"{data['saved_j']:.1f} J"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>sobrio dashboard</title>
<style>body{{font-family:sans-serif;margin:2em;color:#222}}table{{border-collapse:collapse;margin-bottom:1.5em}}
td,th{{border:1px solid #ccc;padding:4px 10px;text-align:right}}th:first-child,td:first-child{{text-align:left}}
</style></head><body>
<h1>sobrio: usage, energy and CO2</h1>
<h2>Per tenant</h2>{_table("tenant", data["tenants"], "tenants")}
<h2>Per model</h2>{_table("model", data["models"], "models")}
{_bars("Requests per model", [(m, r[0]) for m, *r in data["models"]], "requests-chart")}
{_bars("Energy per model (J)", [(m, r[4]) for m, *r in data["models"]], "energy-chart")}
<h2>Tokens per hour, last 24 h</h2>{_hourly(data["hourly"])}
<h2>Router (model "auto")</h2>
<p id="router-split">{html.escape(split)}</p>
<p id="router-savings">Energy saved against always-large: {saved}</p>
{_routing(data["router"], data["routing"])}
</body></html>"""


def _table(first: str, rows: list[tuple], element_id: str) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in (first, *_COLUMNS))
    body = "".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f'<table id="{element_id}"><tr>{head}</tr>{body}</table>'


def _cell(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else html.escape(str(value))


def _bars(title: str, items: list[tuple[str, float]], element_id: str) -> str:
    """A horizontal bar chart in SVG."""
    top = max((v for _, v in items), default=0) or 1
    bars = "".join(
        f'<text x="0" y="{22 * i + 15}" font-size="12">{html.escape(name)}</text>'
        f'<rect x="160" y="{22 * i + 3}" width="{300 * value / top:.1f}" height="16" fill="#4a7"/>'
        f'<text x="{165 + 300 * value / top:.1f}" y="{22 * i + 15}" font-size="12">{_cell(value)}</text>'
        for i, (name, value) in enumerate(items))
    return (f'<h3>{html.escape(title)}</h3><svg id="{element_id}" width="560" height="{22 * len(items) + 6}" '
            f'role="img">{bars}</svg>')


def _hourly(rows: list[tuple]) -> str:
    """Tokens per hour per model as stacked columns over the last 24 hours."""
    now_hour = int(time.time() // 3600)
    models = sorted({m for _, m, _ in rows})
    colors = ["#4a7", "#47a", "#a74", "#a47", "#7a4"]
    per = {(h, m): t for h, m, t in rows}
    top = max((sum(per.get((h, m), 0) for m in models) for h in range(now_hour - 23, now_hour + 1)), default=0) or 1
    columns = []
    for i, hour in enumerate(range(now_hour - 23, now_hour + 1)):
        y = 150
        for j, model in enumerate(models):
            height = 140 * per.get((hour, model), 0) / top
            y -= height
            columns.append(f'<rect x="{20 * i + 4}" y="{y:.1f}" width="16" height="{height:.1f}" '
                           f'fill="{colors[j % len(colors)]}"><title>{html.escape(model)}</title></rect>')
    legend = " ".join(f'<span style="color:{colors[j % len(colors)]}">&#9632; {html.escape(m)}</span>'
                      for j, m in enumerate(models))
    return f'<svg id="hourly-chart" width="490" height="160" role="img">{"".join(columns)}</svg><p>{legend}</p>'


_ROUTING = ("tenant", "routed", "to small", "to large", "energy saved (J)", "cost saved (USD)",
            "expected gap recovered")


def _routing(router: RouterInfo | None, rows: list[tuple[str, TenantRouting]]) -> str:
    """Per tenant: model "auto"'s split, what it saved against always-large, the quality it expects."""
    if router is None:
        return '<p id="router-off">model "auto" is off: the router\'s two models are not both served</p>'
    quality = router.quality
    parts = [(name, q) for name, q in quality.items() if isinstance(q, dict)] + [("all", quality)]
    note = (f"cross-validated by subject on {quality.get('prompts')} labelled prompts: " + "; ".join(
        f"{name} APGR {q['apgr']:.3f}, CPT(50%) {100 * q['cpt50']:.1f}%" for name, q in parts)
        if "apgr" in quality else "no evaluation stored")
    head = "".join(f"<th>{html.escape(c)}</th>" for c in _ROUTING)
    body = "".join(
        "<tr>" + "".join(f"<td>{v}</td>" for v in (
            html.escape(name), t.to_small + t.to_large, f"{t.to_small} ({1 - t.large_share:.0%})",
            f"{t.to_large} ({t.large_share:.0%})", _maybe(t.saved_j, "{:.1f}"), _maybe(t.saved_usd, "{:.4f}"),
            _maybe(t.expected_pgr, "{:.0%}"))) + "</tr>" for name, t in rows)
    return (f"<h3>Per tenant: {html.escape(router.small)} (small) and {html.escape(router.large)} (large)</h3>"
            f'<table id="router-tenants"><tr>{head}</tr>{body}</table>'
            f'<p id="router-quality">Router quality ({html.escape(note)}); expected gap recovered: the share of the '
            "quality difference between the two models kept at that tenant's share of large calls.</p>")


def _maybe(value: float | None, form: str) -> str:
    return "n/a" if value is None else form.format(value)
