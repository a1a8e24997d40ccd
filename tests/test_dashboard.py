"""The operator's page as the server gives it (in process; tests/test_dashboard_browser.py runs it in Chromium): the
page and its files come from the package with a policy that keeps the browser on this origin, hold no figure and
name nothing outside the box; /stats/history and /stats' semantic figures are scoped by the key as /stats is."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from edgecache.bench.harness import serve_in_process
from edgecache.http.app import create_app
from edgecache.http.dashboard import ASSETS, PAGE, load_assets
from edgecache.metrics import NEAR_CUT_EDGES
from edgecache.settings import Settings
from tests.fakes import FakeEngine
from tests.test_ledger import ADMIN, ask, auth, tenants_file

SVG_NAMESPACE = "http://www.w3.org/2000/svg"


async def test_the_page_and_its_files_come_from_the_box_with_a_policy_that_keeps_the_browser_here(
        make_settings: Callable[..., Settings], tmp_path: Path) -> None:
    settings = make_settings(tenants_file=str(tenants_file(tmp_path / "tenants.toml")))
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        page = await c.get("/dashboard")  # no key: the page holds no figure, its script asks /stats with one
        assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
        policy = page.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "script-src 'self'" in policy
        assert page.headers["referrer-policy"] == "no-referrer"
        named = set(re.findall(r'(?:src|href)="([^"]+)"', page.text))
        assert named == {f"/dashboard/{name}" for name in ASSETS}
        for name, content_type in ASSETS.items():
            asset = await c.get(f"/dashboard/{name}")
            assert asset.status_code == 200 and asset.headers["content-type"] == content_type.decode()
            assert asset.headers["content-security-policy"] == policy
        missing = await c.get("/dashboard/other.js")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
        assert (await c.get("/dashboard/../stats")).status_code in (401, 404)  # never a file outside static/


def test_nothing_in_the_pages_files_points_outside_the_box() -> None:
    for name, body in load_assets().items():
        text = body.decode()
        outside = [url for url in re.findall(r"(?:https?:)?//[\w.-]+[^\s\"'`)]*", text) if url != SVG_NAMESPACE]
        assert outside == [], name
        assert "@import" not in text and "url(" not in text.replace("url(#", ""), name
    assert "innerHTML" not in load_assets()["dashboard.js"].decode()  # text is set as text, never parsed
    assert PAGE == "dashboard.html"


async def test_stats_history_is_scoped_by_the_key_as_stats_is(make_settings: Callable[..., Settings],
                                                              tmp_path: Path) -> None:
    settings = make_settings(tenants_file=str(tenants_file(tmp_path / "tenants.toml")),
                             ledger__price_per_hour=2.5)
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        for tenant in ("acme", "globex"):
            await ask(c, f"a question only {tenant} asks", auth(tenant))
            await ask(c, f"a question only {tenant} asks", auth(tenant))
        await ask(c, "globex asks once more", auth("globex"))
        c.app.state.runtime.ledger.tick()  # type: ignore[attr-defined]  # the housekeeping's minute

        mine = await c.get("/stats/history", params={"tenant": "globex"}, headers=auth("acme"))
        assert mine.status_code == 200
        body = mine.json()
        assert body["tenant"] == "acme" and "globex" not in mine.text
        assert body["window"]["requests"] == {"miss": 1, "exact": 1}
        assert sum(p["requests"].get("exact", 0) for p in body["points"]) == 1
        assert body["price"] == {"per_hour": 2.5, "currency": "USD"}

        admin = (await c.get("/stats/history", headers=ADMIN)).json()
        assert "tenant" not in admin and admin["window"]["requests"] == {"miss": 3, "exact": 2}
        stats = (await c.get("/stats", headers=ADMIN)).json()
        assert admin["window"]["requests"] == stats["ledger"]["total"]["requests"]
        assert set(stats["ledger"]["by_tenant"]) == {"acme", "globex"}
        assert stats["ledger"]["by_tenant"]["globex"] == stats["ledger"]["by_tenant_scenario"]["globex/default"]
        one = (await c.get("/stats/history", params={"tenant": "globex", "minutes": 1440, "step": 10},
                           headers=ADMIN)).json()
        assert one["window"]["requests"] == {"miss": 2, "exact": 1} and one["step_minutes"] == 10
        assert "acme" not in json.dumps(one)

        assert (await c.get("/stats/history")).status_code == 401
        assert (await c.get("/stats/history", headers={"Authorization": "Bearer sk-nobody-000001"})).status_code == 401
        for bad in ({"minutes": 0}, {"minutes": 100_000}, {"step": "x"}):
            refused = await c.get("/stats/history", params=bad, headers=ADMIN)
            assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error", bad


async def test_the_semantic_layer_near_its_cut_counts_each_tenants_lookups_by_similarity_and_only_its_own(
        make_settings: Callable[..., Settings], tmp_path: Path) -> None:
    settings = make_settings(tenants_file=str(tenants_file(tmp_path / "tenants.toml")), semantic__enabled=True)
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        await ask(c, "How do I reset my password?", auth("acme"))
        refused = await ask(c, "How can I reset my password?", auth("acme"))
        assert refused.headers["x-edgecache"] == "miss"  # an untaught learner serves no paraphrase
        await ask(c, "Where is the nearest branch office?", auth("globex"))

        mine = (await c.get("/stats", headers=auth("acme"))).json()["semantic"]["near_cut"]
        assert mine["edges"] == list(NEAR_CUT_EDGES) and mine["decision"] == "learner"
        assert set(mine["by_tenant_scenario"]) == {"acme/default"}
        row = mine["by_tenant_scenario"]["acme/default"]
        assert sum(row["served"]) == 0 and sum(row["refused"]) == 1
        assert row["target_false_hit_rate"] == settings.scenarios["default"].target_false_hit_rate
        assert row["learner"] is not None and row["learner"]["lookups"] >= 1

        admin = (await c.get("/stats", headers=ADMIN)).json()["semantic"]["near_cut"]
        assert admin["by_tenant_scenario"]["acme/default"] == row
        theirs = (await c.get("/stats", headers=auth("globex"))).json()
        assert "acme" not in json.dumps(theirs)

