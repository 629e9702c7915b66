"""Model "auto"'s savings per tenant (gateway/router_savings.py) on the dashboard, from ledger rows written
here: the split, the energy and cost saved against always-large, the expected quality; a headless Chromium
screenshot where Debian's chromium is installed; and an older ledger gaining the router's column."""

import shutil
import sqlite3
import subprocess
import time
from html.parser import HTMLParser

import pytest

from sobrio.gateway.dashboard import dashboard_data, render
from sobrio.gateway.ledger import COLUMNS, Ledger, LedgerEntry
from sobrio.gateway.router_savings import RouterInfo
from sobrio.gateway.tenants import TenantStore

INFO = RouterInfo("small-m", "large-m", {"apgr": 0.6, "cpt50": 0.3, "prompts": 8544, "curve": [[0, 0], [1, 1]]},
                  small_usd_per_mtok=1.0, large_usd_per_mtok=11.0)


class _Cells(HTMLParser):
    """The router-tenants table's rows as cell texts."""

    def __init__(self):
        super().__init__()
        self.rows, self._in = [], False

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._in = dict(attrs).get("id") == "router-tenants"
        elif tag == "tr" and self._in:
            self.rows.append([])

    def handle_endtag(self, tag):
        if tag == "table":
            self._in = False

    def handle_data(self, data):
        if self._in and self.rows and data.strip():
            self.rows[-1].append(data.strip())


@pytest.fixture
def ledger(tmp_path):
    store = TenantStore(tmp_path / "gateway.db")
    acme, globex = store.create_tenant("acme"), store.create_tenant("globex")
    ledger = Ledger(store.db)
    now = time.time()

    def row(tenant, model, tokens, joules, requested="auto"):
        ledger.record(LedgerEntry("r", tenant.id, now, "/v1/chat/completions", requested, model, "local:ITA",
                                  tokens, 0, 0, None, 0.1, 200, joules, 0.0, "estimate", 0.5))

    for _ in range(3):
        row(acme, "small-m", 100, 10.0)  # 0.1 J per token on the small model
    row(acme, "large-m", 100, 50.0)
    row(globex, "large-m", 100, 50.0, requested="large-m")  # not routed: counts for joules per token only
    yield store, ledger
    store.close()


def test_each_tenants_split_and_savings_against_always_large(ledger):
    store, ledger = ledger
    data = dashboard_data(ledger, store, INFO)
    cells = _Cells()
    cells.feed(render(data))
    rows = {r[0]: r for r in cells.rows[1:]}
    assert set(rows) == {"acme"}  # globex sent no "auto" request
    # 300 tokens on the small model would have cost 0.5 J each on the large one: 150 - 30 J saved
    assert rows["acme"][1:] == ["4", "3 (75%)", "1 (25%)", "120.0", "0.0030", "25%"]
    assert data["saved_j"] == pytest.approx(120.0)
    assert "APGR 0.600" in render(data) and "router-off" in render(dashboard_data(ledger, store, None))


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="Debian's chromium is not installed (apt-get install chromium): no headless browser")
def test_a_tenants_router_savings_render_in_headless_chromium(ledger, tmp_path):
    store, ledger = ledger
    page = tmp_path / "dashboard.html"
    page.write_text(render(dashboard_data(ledger, store, INFO)))
    shot = tmp_path / "dashboard.png"
    browser = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*browser, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    cells = _Cells()
    cells.feed(dom)
    assert cells.rows[1][:4] == ["acme", "4", "3 (75%)", "1 (25%)"]
    subprocess.run([*browser, f"--screenshot={shot}", "--window-size=1000,1400", page.as_uri()],
                   capture_output=True, timeout=120)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def test_an_older_ledger_gains_the_router_column(tmp_path):
    db = sqlite3.connect(tmp_path / "old.db")
    db.execute("CREATE TABLE usage (" + ", ".join(c for c in COLUMNS if c != "router_score") + ")")
    ledger = Ledger(db)
    ledger.record(LedgerEntry("r", None, 1.0, "/v1/completions", router_score=0.25))
    assert ledger.rows(None)[0]["router_score"] == 0.25
