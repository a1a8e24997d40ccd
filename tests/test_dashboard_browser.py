"""The operator's page in a real browser: Debian's Chromium, headless, driven by Playwright, against a real
`edgecache serve` with tenants. The page renders; every figure it shows is /stats' (it marks each with its place in
/stats' JSON, held here to the very response it rendered); a tenant's key shows no other tenant, in the page or in
anything the page fetched; no request leaves the box; with no key there is a form and no figure; it refreshes
without a reload."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import SERVICES_REQUIRED, require_binary
from tests.real_server import MODEL, Server

pytestmark = pytest.mark.e2e

CHROMIUM_INSTALL = "Debian/Ubuntu: apt-get install chromium"
#: Chromium as the tests run it: headless, no sandbox (CI runs as root), and nothing of its own on the network.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

TENANTS = """
[plans.team]

[[tenants]]
id = "acme"
plan = "team"
keys = ["sk-acme-dash-0001"]

[[tenants]]
id = "umbrella"
plan = "team"
keys = ["sk-umbrella-dash-0001"]

[admin]
keys = ["sk-admin-dash-0001"]
"""
ADMIN_KEY, ACME_KEY, OTHER_KEY = "sk-admin-dash-0001", "sk-acme-dash-0001", "sk-umbrella-dash-0001"
OTHER = "umbrella"
OTHER_PROMPT = "Which zeppelin hangar stores the quartermaster's marmalade?"


def playwright_api() -> Any:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        message = "playwright is not installed here (pip install -e '.[dev]')"
        if SERVICES_REQUIRED:
            pytest.fail(message + "; TESTS_REQUIRE_SERVICES=1 makes that a failure")
        pytest.skip(message)
    return sync_playwright


def chat(server: Server, key: str, question: str) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                   messages=[{"role": "user", "content": question}])


def stats(server: Server, key: str = ADMIN_KEY) -> dict[str, Any]:
    return httpx.get(server.url + "/stats", headers={"Authorization": f"Bearer {key}"}, timeout=10).json()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real server with two tenants, a box price and the semantic layer, and some traffic: misses, exact hits, a
    refused semantic candidate, and the other tenant's own question."""
    root = tmp_path_factory.mktemp("dashboard")
    (root / "tenants.toml").write_text(TENANTS)
    srv = Server(root / "data", "--tenants", str(root / "tenants.toml"),
                 env={"EDGECACHE_LEDGER__PRICE_PER_HOUR": "1.23", "EDGECACHE_LEDGER__CURRENCY": "EUR",
                      "EDGECACHE_LEDGER__FIT_MIN_CALLS": "2"}).start()
    try:
        for question in ("How do I reset my password?", "What is the capital of France?", "Name three colours."):
            chat(srv, ACME_KEY, question)
            chat(srv, ACME_KEY, question)
        chat(srv, ACME_KEY, "How can I reset my password?")  # a paraphrase: the untaught learner refuses it
        chat(srv, OTHER_KEY, OTHER_PROMPT)
        chat(srv, OTHER_KEY, OTHER_PROMPT)
        for _ in range(600):  # until the engine's disk writes are done, so the figures hold still
            now = stats(srv)
            if now["engine_state"].get("prefix_cache_disk_writes_pending", 0) == 0 and not now["inflight"]:
                break
            time.sleep(0.05)
        yield srv
    finally:
        srv.stop()


class Browser:
    """One Chromium for the module (a fresh profile), a fresh page per test, and every request any page made."""

    def __init__(self, server: Server) -> None:
        require_binary("chromium", CHROMIUM_INSTALL)
        self.server = server
        self.profile = tempfile.mkdtemp(prefix="chromium-profile-")
        self._driver = playwright_api()().start()
        self.context = self._driver.chromium.launch_persistent_context(
            self.profile, executable_path=shutil.which("chromium"), headless=True, args=CHROMIUM_ARGS)
        self.requests: list[Any] = []
        self.responses: list[Any] = []
        self.context.on("request", lambda request: self.requests.append(request))
        self.context.on("response", lambda response: self.responses.append(response))

    def page(self) -> Any:
        self.requests.clear()
        self.responses.clear()
        self.complaints: list[str] = []
        page = self.context.new_page()
        page.set_default_timeout(30_000)
        # A script error, or anything the page's policy blocked (a load from elsewhere, an inline style), is a
        # complaint: a blocked request is never sent, so the network log alone would not show it.
        page.on("pageerror", lambda error: self.complaints.append(f"error: {error}"))
        page.on("console", lambda message: self.complaints.append(message.text)
                if message.type == "error" and "401" not in message.text else None)
        return page

    def stats_answer(self, fetch: int) -> dict[str, Any]:
        """The answer to the page's ``fetch``-th request to /stats (requests are seen in the order it sent them)."""
        asked = [r for r in self.requests if r.url.split("?")[0] == self.server.url + "/stats"]
        response = asked[fetch - 1].response()
        assert response is not None and response.status == 200
        return response.json()  # type: ignore[no-any-return]

    def assert_nothing_left_the_box(self) -> None:
        assert self.requests, "the page made no request at all"
        outside = [r.url for r in self.requests if not r.url.startswith(self.server.url + "/")]
        assert outside == []
        assert self.complaints == []

    def close(self) -> None:
        self.context.close()
        self._driver.stop()
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture(scope="module")
def browser(server: Server) -> Iterator[Browser]:
    b = Browser(server)
    yield b
    b.close()


def until(page: Any, expression: str, what: str, patience_s: float = 60.0) -> None:
    """Until ``expression`` (a JavaScript function of no arguments) holds in the page: polled from here, since the
    page's policy forbids the string evaluation Playwright's own wait_for_function does."""
    deadline = time.monotonic() + patience_s
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} never held in {patience_s:g} s")
        time.sleep(0.05)


def rendered(page: Any, at_least: int = 1) -> dict[str, Any]:
    """Once the page rendered its ``at_least``-th /stats answer: the answer's number and the page's figures, read
    in one step (a refresh cannot land in between)."""
    until(page, f"() => Number(document.body.dataset.statsSeq || 0) >= {at_least}", f"/stats answer {at_least}")
    return page.evaluate("""() => ({
        seq: Number(document.body.dataset.statsSeq),
        fetch: Number(document.body.dataset.statsFetch),
        figures: Array.from(document.querySelectorAll('[data-figure]'), e =>
            ({path: JSON.parse(e.dataset.figure), value: JSON.parse(e.dataset.value), text: e.textContent})),
        derived: Object.fromEntries(Array.from(document.querySelectorAll('[data-derived]'), e =>
            [e.dataset.derived, JSON.parse(e.dataset.value)])),
        text: document.body.innerText,
        url: location.href,
    })""")


def at(body: Any, path: list[Any]) -> Any:
    for part in path:
        if not isinstance(body, dict) or part not in body:
            return None
        body = body[part]
    return body


def hit_rate(requests: dict[str, int]) -> float | None:
    served = sum(requests.values()) - requests.get("error", 0) - requests.get("rejected", 0)
    return (requests.get("exact", 0) + requests.get("shared", 0) + requests.get("semantic", 0)) / served \
        if served else None


def assert_figures_are_stats(shown: dict[str, Any], body: dict[str, Any]) -> None:
    assert len(shown["figures"]) > 20
    for figure in shown["figures"]:
        assert figure["value"] == at(body, figure["path"]), figure
        if isinstance(figure["value"], int) and not isinstance(figure["value"], bool) and \
                figure["path"][-1] in ("prompt_tokens", "completion_tokens", "calls", "misses", "count"):
            assert figure["text"] == f"{figure['value']:,}", figure
    total = body["ledger"]["last_hour"]["total"]  # the page opens on the last hour
    assert shown["derived"]["requests"] == sum(total["requests"].values())
    assert shown["derived"]["hit_rate"] == pytest.approx(hit_rate(total["requests"]))
    assert shown["derived"]["saved_tokens"] == sum(v["prompt_tokens"] + v["completion_tokens"]
                                                   for v in total["saved"].values())


def test_without_a_key_the_page_shows_a_form_and_no_figure(server: Server, browser: Browser) -> None:
    page = browser.page()
    page.goto(server.url + "/dashboard")
    page.wait_for_selector("#key-form")
    assert page.is_visible("#login") and not page.is_visible("#board")
    assert page.locator("[data-figure], [data-derived], svg rect").count() == 0
    assert not [r for r in browser.requests if "/stats" in r.url]  # nothing was asked without a key
    # A wrong key: refused by the server, and the page stays a form.
    page.fill("#key", "sk-nobody-at-all-0001")
    with page.expect_response(lambda r: r.url.split("?")[0] == server.url + "/stats") as answer:
        page.click("#key-form button")
    assert answer.value.status == 401
    page.wait_for_selector("#login-error:not([hidden])")
    assert "refused" in page.inner_text("#login-error")
    assert page.locator("[data-figure], [data-derived]").count() == 0 and not page.is_visible("#board")
    browser.assert_nothing_left_the_box()
    page.close()


def test_the_admins_page_shows_every_tenant_with_the_figures_of_stats(server: Server, browser: Browser) -> None:
    page = browser.page()
    page.goto(server.url + f"/dashboard#key={ADMIN_KEY}")
    shown = rendered(page)
    assert "#key=" not in shown["url"] and ADMIN_KEY not in shown["url"]  # the key leaves the address bar
    body = browser.stats_answer(shown["fetch"])
    assert "tenant" not in body  # the admin's view
    assert_figures_are_stats(shown, body)
    paths = {json.dumps(f["path"]) for f in shown["figures"]}
    for expected in (["ledger", "last_hour", "by_tenant", "acme", "saved_engine_s"],
                     ["ledger", "last_hour", "by_tenant", OTHER, "spent_engine_s"],
                     ["ledger", "last_hour", "total", "cost_saved_total"],
                     ["ledger", "last_hour", "total", "effective_capacity"],
                     ["ledger", "last_hour", "total", "cache_share"],
                     ["ledger", "last_hour", "total", "kv_prefix", "by_tier", "ram", "prompt_tokens"],
                     ["ttft", "miss", "p99_s"], ["admission", "queued"],
                     ["semantic", "near_cut", "by_tenant_scenario", "acme/default", "target_false_hit_rate"]):
        assert json.dumps(expected) in paths, expected
    assert body["ledger"]["last_hour"]["total"]["saved_engine_s"] > 0 and "EUR" in shown["text"]
    # The charts: what each minute saved (bars) and spent, the hit rate by layer, the misses by reason.
    until(page, "() => Number(document.body.dataset.historySeq || 0) >= 1", "a /stats/history answer")
    for chart in ("#chart-saved", "#chart-hits", "#chart-misses", "#chart-busy"):
        assert page.locator(f"{chart} svg path, {chart} svg rect").count() > 0, chart
    assert page.locator("#near-cut .cut-card svg rect").count() > 0  # the refused paraphrase
    # The admin picks one tenant: the page asks /stats for that tenant's view, and shows nothing of the other's.
    with page.expect_response(lambda r: r.url == server.url + f"/stats?tenant={OTHER}"):
        page.select_option("#view", OTHER)
    one = rendered(page, shown["seq"] + 1)
    theirs = browser.stats_answer(one["fetch"])
    assert theirs["tenant"] == OTHER
    assert_figures_are_stats(one, theirs)
    assert "acme" not in one["text"].replace("tenant acme", "")  # (the picker names it, as an option)
    browser.assert_nothing_left_the_box()
    page.close()


def test_a_tenants_key_shows_its_own_tenant_and_nothing_of_another(server: Server, browser: Browser) -> None:
    page = browser.page()
    page.goto(server.url + "/dashboard")
    page.fill("#key", ACME_KEY)
    page.click("#key-form button")
    shown = rendered(page)
    until(page, "() => Number(document.body.dataset.historySeq || 0) >= 1", "a /stats/history answer")
    body = browser.stats_answer(shown["fetch"])
    assert body["tenant"] == "acme"
    assert_figures_are_stats(shown, body)
    mine = stats(server, ACME_KEY)["ledger"]["last_hour"]["total"]["requests"]
    box = stats(server)["ledger"]["last_hour"]["total"]["requests"]
    assert shown["derived"]["requests"] == sum(mine.values()) < sum(box.values())
    text = page.evaluate("document.documentElement.outerHTML") + shown["text"]
    for secret in (OTHER, OTHER_PROMPT, "zeppelin", OTHER_KEY):
        assert secret not in text
        for response in browser.responses:
            assert secret not in response.body().decode(errors="replace"), response.url
    assert not page.is_visible("#view-label") and not page.is_visible("#tenants-section")
    browser.assert_nothing_left_the_box()
    page.close()


def test_the_page_refreshes_itself_without_a_reload(server: Server, browser: Browser) -> None:
    page = browser.page()
    page.goto(server.url + f"/dashboard#key={ACME_KEY}")
    before = rendered(page)["derived"]["requests"]
    chat(server, ACME_KEY, "What is the capital of France?")  # an exact hit, booked at the next read
    until(page, f"() => Number(document.querySelector('[data-derived=requests]').dataset.value) > {before}",
          "the new request on the page")
    assert page.evaluate("performance.getEntriesByType('navigation').length") == 1
    assert len([r for r in browser.requests if "/stats?" in r.url or r.url.endswith("/stats")]) >= 2
    browser.assert_nothing_left_the_box()
    page.close()


def test_serve_prints_the_pages_address(server: Server) -> None:
    log = Path(server.log.name).read_text()  # type: ignore[union-attr]
    assert f"{server.url}/dashboard" in log
