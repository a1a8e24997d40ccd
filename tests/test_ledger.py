"""The operator's ledger: every request once, misses under one reason each, tokens and engine-seconds saved by
layer and spent by purpose, the measured cost per token, money only with a price, a restart, and tenants apart."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from edgecache.bench.harness import serve_in_process
from edgecache.http.app import create_app
from edgecache.ledger import (
    ENGINE_ERROR,
    EVICTED,
    EXPIRED,
    FIRST_SEEN,
    FLUSHED,
    NOT_CACHEABLE,
    POLICY,
    CostFit,
    EngineMeter,
    KeyHistory,
    Ledger,
    MeteredCall,
)
from edgecache.settings import Settings
from tests.conftest import chat_body
from tests.fakes import FakeEngine
from tests.test_tenants import settle

ADMIN = {"Authorization": "Bearer sk-admin-ledger-01"}


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer sk-{tenant}-ledger-key-01"}


def tenants_file(path: Path, *, quota: str = "2GB") -> Path:
    path.write_text(f'[plans.basic]\nstore_bytes = "{quota}"\n\n[admin]\nkeys = ["sk-admin-ledger-01"]\n\n'
                    + "".join(f'[[tenants]]\nid = "{t}"\nplan = "basic"\nkeys = ["sk-{t}-ledger-key-01"]\n\n'
                              for t in ("acme", "globex")))
    return path


async def ask(c: httpx.AsyncClient, content: str, headers: dict[str, str] | None = None, **extra: Any) -> httpx.Response:
    resp = await c.post("/v1/chat/completions", json=chat_body(content, **extra), headers=headers or {})
    await settle(c)
    return resp


def ledger_of(c: httpx.AsyncClient) -> Ledger:
    return c.app.state.runtime.ledger  # type: ignore[attr-defined]


async def stats(c: httpx.AsyncClient, headers: dict[str, str] | None = None) -> dict[str, Any]:
    resp = await c.get("/stats", headers=headers or {})
    assert resp.status_code == 200, resp.text
    return resp.json()


# --- the meter and the fit, on a clock the test moves ----------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_concurrent_calls_are_charged_shares_of_the_busy_time_that_add_up_to_it() -> None:
    ended: list[MeteredCall] = []
    clock = Clock()
    meter = EngineMeter(lambda call, tokens: ended.append(call), clock=clock)
    a = meter.start("t", "s", "miss")
    clock.now = 1.0                      # a alone: 1 s of prefill
    b = meter.start("t", "s", "miss")
    clock.now = 3.0                      # a and b: 1 s each
    meter.first_output(a)
    clock.now = 4.0                      # a decoding, b prefilling: 0.5 s each
    meter.end(a, (10, 0, 5))
    clock.now = 6.0                      # idle
    meter.end(b, (10, 0, 5))
    clock.now = 9.0                      # nothing runs: not busy
    c = meter.start("t", "s", "judge")
    clock.now = 9.5
    meter.end(c, None)
    assert (a.prefill_s, a.decode_s) == (2.0, 0.5)
    assert (b.prefill_s, b.decode_s) == (1.5 + 2.0, 0.0)
    assert meter.busy_s == 6.5
    assert sum(call.prefill_s + call.decode_s for call in ended) == pytest.approx(meter.busy_s)
    meter.end(c, None)  # twice: ignored
    assert len(ended) == 3


def test_an_engine_that_runs_one_call_at_a_time_charges_only_the_running_call() -> None:
    clock = Clock()
    meter = EngineMeter(lambda call, tokens: None, parallel=1, clock=clock)
    a = meter.start("t", "s", "miss")
    b = meter.start("t", "s", "miss")  # waits for a (llama.cpp's lock)
    clock.now = 2.0
    meter.end(a, (1, 0, 1))
    clock.now = 3.0
    meter.end(b, (1, 0, 1))
    assert a.prefill_s == 2.0 and b.prefill_s == 1.0 and meter.busy_s == 3.0


def test_the_fit_has_no_rates_below_its_minimum_and_follows_a_slower_engine() -> None:
    fit = CostFit(min_calls=5, half_life_calls=20)

    def call(per_call: float, per_prompt_token: float, per_decode_token: float, prompt: int) -> None:
        fit.observe(per_call + per_prompt_token * prompt, prompt, per_decode_token * 8, 9)

    for prompt in (10, 50, 100, 200):
        call(0.02, 0.001, 0.01, prompt)
    assert fit.rates() is None and fit.cost(1, 10, 9) is None
    call(0.02, 0.001, 0.01, 400)
    assert fit.rates() == pytest.approx((0.02, 0.001, 0.01))
    # A hit saves a call, its prompt and its completion; a token the prefix cache held, one prompt token.
    assert fit.cost(1, 100, 9) == pytest.approx(0.02 + 0.1 + 0.08)
    assert fit.cost(0, 100, 0) == pytest.approx(0.1)
    for i in range(200):  # the engine got twice as slow
        call(0.04, 0.002, 0.02, (10, 50, 100, 200, 400)[i % 5])
    assert fit.rates() == pytest.approx((0.04, 0.002, 0.02), rel=0.01)


def test_the_key_history_tells_expired_evicted_flushed_and_first_seen_apart() -> None:
    history = KeyHistory(max_keys=3)
    history.stored("t", "s", "k-expired", expires_at=10.0, now=0.0)
    history.stored("t", "s", "k-live", expires_at=100.0, now=0.0)
    history.stored("t", "other", "k-flushed", expires_at=100.0, now=0.0)
    history.flushed("t", "other", now=5.0)
    assert history.why_gone("k-expired", now=20.0) == EXPIRED
    assert history.why_gone("k-live", now=20.0) == EVICTED
    assert history.why_gone("k-flushed", now=20.0) == FLUSHED
    assert history.why_gone("never", now=20.0) is None
    history.stored("t", "s", "k-new", expires_at=100.0, now=30.0)  # past max_keys: the oldest is forgotten
    assert history.why_gone("k-expired", now=40.0) is None


# --- through the server ----------------------------------------------------------------------------------------


async def test_every_request_lands_in_the_ledger_once_and_each_miss_under_one_reason(
        make_settings: Callable[..., Settings], tmp_path: Path) -> None:
    engine = FakeEngine()
    settings = make_settings(tenants_file=str(tenants_file(tmp_path / "tenants.toml")))
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        acme = auth("acme")
        sent: dict[str, str] = {}  # request -> expected outcome/reason

        async def send(name: str, expected: str, content: str, headers: dict[str, str] | None = None,
                       **extra: Any) -> None:
            resp = await ask(c, content, {**acme, **(headers or {})}, **extra)
            sent[name] = expected
            assert resp.status_code in (200, 502), resp.text

        await send("first", FIRST_SEEN, "What is a cache?")
        await send("repeat", "exact", "What is a cache?")
        await send("sampled", NOT_CACHEABLE, "Tell me a story", temperature=0.9)
        await send("bypass", POLICY, "What is a cache?", {"X-EdgeCache-Policy": "bypass"})
        await send("max-age", POLICY, "What is a cache?", {"Cache-Control": "max-age=0"})
        await send("short", FIRST_SEEN, "What is a queue?", edgecache={"ttl": 0.2})
        await asyncio.sleep(0.4)
        await send("expired", EXPIRED, "What is a queue?")
        await c.post("/admin/flush", json={"tenant": "acme"}, headers=ADMIN)
        await send("flushed", FLUSHED, "What is a cache?")
        engine.fail_after = 0
        await send("failed", ENGINE_ERROR, "What is a heap?")
        engine.fail_after = None

        # Two identical requests at once: one engine call, one shared answer.
        engine.gate = asyncio.Event()
        pending = [asyncio.create_task(c.post("/v1/chat/completions", json=chat_body("What is a stack?"),
                                              headers=acme)) for _ in range(2)]
        while engine.running < 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the second joins the flight (a later arrival would be an exact hit: counted too)
        engine.gate.set()
        served = sorted(r.headers["x-edgecache"] for r in await asyncio.gather(*pending))
        await settle(c)

        body = await stats(c, ADMIN)
        row = body["ledger"]["by_tenant_scenario"]["acme/default"]
        assert sum(row["requests"].values()) == len(sent) + 2, row["requests"]
        assert body["by_tenant"]["acme"]["default"] == row["requests"]  # the same requests the metrics count
        reasons = row["miss_reasons"]
        want: dict[str, int] = {}
        for expected in [*sent.values(), *(FIRST_SEEN for s in served if s == "miss")]:
            if expected not in ("exact", "shared"):
                want[expected] = want.get(expected, 0) + 1
        assert reasons == want
        assert row["misses"] == sum(reasons.values()) == row["requests"].get("miss", 0) + 1  # + the engine error
        assert served in (["miss", "shared"], ["exact", "miss"])
        metrics = (await c.get("/metrics", headers=ADMIN)).text
        assert f'edgecache_misses_total{{reason="{EXPIRED}",scenario="default",tenant="acme"}} 1.0' in metrics


async def test_tokens_saved_by_an_exact_hit_are_the_stored_answers_and_kv_savings_the_engines_cached_tokens(
        client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    fake_engine.cached_tokens = 2
    first = (await ask(client, "one two three four five")).json()
    await ask(client, "one two three four five")
    saved = ledger_of(client).report()["by_tenant_scenario"]["default/default"]["saved"]
    assert saved["exact"]["prompt_tokens"] == first["usage"]["prompt_tokens"]
    assert saved["exact"]["completion_tokens"] == first["usage"]["completion_tokens"]
    assert saved["kv_prefix"]["prompt_tokens"] == first["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
    assert saved["kv_prefix"]["completion_tokens"] == 0


async def test_engine_seconds_saved_wait_for_a_fit_with_a_basis_then_price_what_was_saved_meanwhile(
        make_settings: Callable[..., Settings]) -> None:
    engine = FakeEngine(delay_s=0.002)
    async with serve_in_process(create_app(make_settings(ledger__fit_min_calls=4), engine=engine)) as c:
        await ask(c, "the first question")
        await ask(c, "the first question")
        report = ledger_of(c).report()
        assert not report["fit"]["ready"] and "rests on 1 engine calls" in report["fit"]["why"]
        assert report["total"]["saved"]["exact"]["engine_s"] == 0.0
        assert report["total"]["unpriced_tokens"]["prompt"]["exact"] > 0
        for i in range(3):
            await ask(c, f"question number {i}")
        await ask(c, "the first question")  # a hit once the fit rests on 4 calls: both hits are priced
        report = ledger_of(c).report()
        fit = report["fit"]
        per_call, prefill, decode = fit["call_s"], fit["prefill_s_per_token"], fit["decode_s_per_token"]
        assert fit["ready"] and decode > 0 and per_call + prefill > 0
        exact = report["total"]["saved"]["exact"]
        assert "unpriced_tokens" not in report["total"]
        hits = report["total"]["requests"]["exact"]
        assert hits == 2
        assert exact["engine_s"] == pytest.approx(per_call * hits + prefill * exact["prompt_tokens"]
                                                  + decode * (exact["completion_tokens"] - hits))
        # What was spent is the engine's busy time, shared out: the ledger's spent adds up to it.
        assert report["total"]["spent_engine_s"] == pytest.approx(report["engine_busy_s"])
        assert report["total"]["effective_capacity"] > 1.0


async def test_spent_adds_up_to_the_busy_time_when_calls_run_at_once(make_settings: Callable[..., Settings]) -> None:
    engine = FakeEngine(delay_s=0.01)
    async with serve_in_process(create_app(make_settings(admission__max_concurrent_misses=4), engine=engine)) as c:
        await asyncio.gather(*(c.post("/v1/chat/completions", json=chat_body(f"question {i}")) for i in range(8)))
        await settle(c)
        assert engine.max_running > 1
        report = ledger_of(c).report()
        assert report["total"]["spent"]["miss"]["calls"] == 8
        assert report["total"]["spent_engine_s"] == pytest.approx(report["engine_busy_s"])


async def test_money_figures_appear_only_with_a_price(make_settings: Callable[..., Settings], tmp_path: Path) -> None:
    for price in (None, 1.23):
        overrides: dict[str, Any] = {"data_dir": str(tmp_path / f"data-{price}"), "ledger__fit_min_calls": 1}
        if price is not None:
            overrides.update(ledger__price_per_hour=price, ledger__currency="CNY")
        async with serve_in_process(create_app(make_settings(**overrides), engine=FakeEngine(delay_s=0.001))) as c:
            await ask(c, "What is a cache?")
            await ask(c, "What is a cache?")
            body = await stats(c)
            metrics = (await c.get("/metrics")).text
            total = body["ledger"]["total"]
            if price is None:
                assert "cost_saved" not in total and body["ledger"]["price"] is None
                assert "edgecache_saved_cost" not in metrics
            else:
                assert total["currency"] == "CNY"
                assert total["cost_saved"]["exact"] == pytest.approx(total["saved"]["exact"]["engine_s"] * 1.23 / 3600)
                assert 'edgecache_saved_cost_total{currency="CNY",layer="exact",scenario="default",tenant="default"}' \
                    in metrics


async def test_the_ledger_survives_a_restart(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings(ledger__fit_min_calls=1)
    async with serve_in_process(create_app(settings, engine=FakeEngine(delay_s=0.001))) as c:
        await ask(c, "What is a cache?")
        await ask(c, "What is a cache?")
        before = ledger_of(c).report()
    assert (settings.data_path / "ledger" / "ledger.json").is_file()
    async with serve_in_process(create_app(settings, engine=FakeEngine(delay_s=0.001))) as c:
        after = ledger_of(c).report()
        assert after["total"] == before["total"] and after["since"] == before["since"]
        assert after["fit"]["calls"] == before["fit"]["calls"]
        await c.post("/admin/flush", json={"all": True})
        # The key history came back too: a repeat after the flush is counted as flushed, not first seen.
        assert (await ask(c, "What is a cache?")).headers["x-edgecache"] == "miss"
        assert ledger_of(c).report()["total"]["miss_reasons"][FLUSHED] == 1


async def test_a_damaged_ledger_file_is_moved_aside_and_the_ledger_starts_again(
        make_settings: Callable[..., Settings]) -> None:
    settings = make_settings()
    path = settings.data_path / "ledger" / "ledger.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        assert (await ask(c, "What is a cache?")).status_code == 200
        assert ledger_of(c).report()["total"]["misses"] == 1
    assert [p.name for p in path.parent.glob("ledger.json.damaged-*")], "the damaged file was not kept"
    assert json.loads(path.read_text())["version"] == 1


_VALID = {"version": 1, "started_at": 1.0, "fit": {}, "rows": {}, "minutes": [], "history": {}, "busy_s": 0.0}


@pytest.mark.parametrize("shape", [
    {"rows": {"no-slash": {}}},
    {"minutes": [[1, {"no-slash": {}}]]},
    {"history": {"keys": ["a", "b"]}},
    {"history": {"keys": {"abc": 7}}},
    {"history": {"keys": {"abc": ["t", "s", 1.0]}}},
    {"history": {"flushes": [["t", "s"]]}},
    {"fit": {"calls": "many"}},
    {"version": 2},
])
async def test_a_ledger_file_of_another_shape_or_version_is_moved_aside_and_logged(
        make_settings: Callable[..., Settings], shape: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """Valid JSON that is not the ledger (or not this version of it) must not stop the server from starting."""
    settings = make_settings()
    path = settings.data_path / "ledger" / "ledger.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**_VALID, **shape}))
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        assert (await ask(c, "What is a cache?")).status_code == 200
        assert ledger_of(c).report()["total"]["misses"] == 1
        flushed = await c.post("/admin/flush", json={"all": True})
        assert flushed.status_code == 200
        assert (await ask(c, "What is a cache?")).headers["x-edgecache"] == "miss"
    assert [p.name for p in path.parent.glob("ledger.json.damaged-*")]
    assert "could not be read" in caplog.text


async def test_a_tenants_key_sees_only_its_own_figures_and_the_admin_key_sees_all(
        make_settings: Callable[..., Settings], tmp_path: Path) -> None:
    settings = make_settings(tenants_file=str(tenants_file(tmp_path / "tenants.toml")))
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        for tenant in ("acme", "globex"):
            await ask(c, f"a question of {tenant}", auth(tenant))
            await ask(c, f"a question of {tenant}", auth(tenant))
        mine = await stats(c, auth("acme"))
        assert mine["tenant"] == "acme"
        assert "globex" not in json.dumps(mine)
        assert set(mine["ledger"]["by_tenant_scenario"]) == {"acme/default"}
        assert mine["ledger"]["total"]["requests"] == {"miss": 1, "exact": 1}
        admin = await stats(c, ADMIN)
        assert set(admin["ledger"]["by_tenant_scenario"]) == {"acme/default", "globex/default"}
        assert admin["ledger"]["total"]["requests"] == {"miss": 2, "exact": 2}
        one = await c.get("/stats", params={"tenant": "globex"}, headers=ADMIN)
        assert set(one.json()["ledger"]["by_tenant_scenario"]) == {"globex/default"}
        assert (await c.get("/stats", headers={"Authorization": "Bearer sk-nobody-0000001"})).status_code == 401
        assert (await c.get("/metrics", headers=auth("acme"))).status_code == 401


async def test_a_refused_semantic_candidate_is_its_misses_reason_and_its_similarity_is_kept(
        make_settings: Callable[..., Settings]) -> None:
    async with serve_in_process(create_app(make_settings(semantic__enabled=True), engine=FakeEngine())) as c:
        await ask(c, "How do I reset my password?")
        resp = await ask(c, "How can I reset my password?")
        assert resp.headers["x-edgecache"] == "miss"  # an untaught learner serves no paraphrase
        reasons = ledger_of(c).report()["total"]["miss_reasons"]
        assert reasons.pop(FIRST_SEEN) == 1
        [(reason, n)] = reasons.items()
        assert reason.startswith("semantic:") and n == 1
        metrics = (await c.get("/metrics")).text
        assert 'edgecache_semantic_miss_similarity_count{scenario="default"} 1.0' in metrics


async def test_an_eviction_at_quota_is_counted_as_evicted(make_settings: Callable[..., Settings],
                                                          tmp_path: Path) -> None:
    settings = make_settings(tenants_file=str(tenants_file(tmp_path / "tenants.toml", quota="200KB")),
                             store__memory_bytes=1)
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        for i in range(60):  # ~10 KB answers: 600 KB into a 200 KB quota
            await ask(c, f"flood {i}: " + "x" * 10_000, auth("acme"))
        resp = await ask(c, "flood 0: " + "x" * 10_000, auth("acme"))
        assert resp.headers["x-edgecache"] == "miss"
        assert ledger_of(c).report()["total"]["miss_reasons"].get(EVICTED) == 1


def test_the_last_hour_is_now_less_the_oldest_minute_within_it_and_each_minute_keeps_only_what_changed() -> None:
    clock = [0.0]
    ledger = Ledger(clock=lambda: clock[0])

    def at_minute(minute: float, *requests: tuple[str, int]) -> None:
        clock[0] = minute * 60
        for tenant, n in requests:
            for _ in range(n):
                ledger.request(tenant, "default", "exact", prompt_tokens=10, completion_tokens=5)
        ledger.tick()

    at_minute(0, ("t1", 1))
    at_minute(5, ("t1", 2), ("t2", 1))
    at_minute(30, ("t2", 4))
    assert [len(rows) for _, rows in ledger._minutes] == [1, 2, 1]  # the first whole, then only rows changed
    at_minute(40, ("t1", 7))
    clock[0] = 66 * 60  # the hour starts at minute 6: the oldest kept minute within it is minute 30's
    hour = ledger.report()["last_hour"]["by_tenant_scenario"]
    assert hour["t1/default"]["requests"] == {"exact": 7} and hour["t2/default"]["requests"] == {"exact": 0}
    assert ledger.report("t1")["by_tenant_scenario"].keys() == {"t1/default"}
    assert hour["t1/default"]["requests"] == ledger.report()["last_hour"]["by_tenant"]["t1"]["requests"]
    clock[0] = 200 * 60  # nothing kept within the hour (no tick since): the last hour is everything
    assert ledger.report()["last_hour"]["total"]["requests"] == {"exact": 15}
    assert [minute for minute, _ in ledger._minutes] == [0, 5, 30, 40]  # kept for a day


def test_history_gives_what_each_minute_saved_and_spent_and_its_sum_is_the_window() -> None:
    clock = [0.0]
    ledger = Ledger(clock=lambda: clock[0], fit_min_calls=1)
    ledger.fit.observe(0.1, 10, 0.4, 5)  # a cost fit with a basis: hits are priced at once

    def at_minute(minute: float, tenant: str, outcome: str, n: int) -> None:
        clock[0] = minute * 60
        ledger.tick()
        for _ in range(n):
            ledger.request(tenant, "default", outcome, prompt_tokens=10, completion_tokens=5,
                           miss_reason=FIRST_SEEN if outcome == "miss" else None)

    at_minute(0, "t1", "exact", 2)
    at_minute(1, "t2", "miss", 3)
    at_minute(2, "t1", "exact", 1)
    at_minute(2.5, "t1", "miss", 1)  # the minute under way
    history = ledger.timeline(minutes=60)
    assert [(p["at"], p["minutes"]) for p in history["points"]] == [(0, 1.0), (60, 1.0), (120, 0.5)]
    assert [p["requests"] for p in history["points"]] == [{"exact": 2}, {"miss": 3}, {"exact": 1, "miss": 1}]
    assert history["points"][1]["misses"] == {FIRST_SEEN: 3}
    assert history["points"][0]["saved_prompt_tokens"] == {"exact": 20}
    assert history["points"][0]["saved_engine_s"]["exact"] > 0
    assert history["window"]["requests"] == ledger.report()["total"]["requests"]
    # A tenant's history holds its rows only; points of two minutes sum two.
    mine = ledger.timeline("t1", minutes=60, step=2)
    assert [(p["at"], p["requests"]) for p in mine["points"]] == [(0, {"exact": 2}), (120, {"exact": 1, "miss": 1})]
    assert mine["window"]["requests"] == {"exact": 3, "miss": 1}
    assert "t2" not in json.dumps(mine)
    # A window that starts later leaves the earlier minutes out, in its points and in its sum.
    late = ledger.timeline(minutes=1)
    assert [p["at"] for p in late["points"]] == [60, 120] and late["since"] == 60
    assert late["window"]["requests"] == {"miss": 4, "exact": 1}
    # Asked again within the minute (the walk up to the last kept minute is remembered): the minute under way moves
    # on, what came before does not, and the answer given before is left as it was.
    ledger.request("t2", "default", "exact", prompt_tokens=10, completion_tokens=5)
    again = ledger.timeline(minutes=60)
    assert [p["requests"] for p in again["points"]] == [{"exact": 2}, {"miss": 3}, {"exact": 2, "miss": 1}]
    assert history["points"][2]["requests"] == {"exact": 1, "miss": 1}
    ledger._timelines.clear()
    assert ledger.timeline(minutes=60) == again
    assert ledger.encoded() == ledger.encoded()  # the kept minutes' encodings are reused, to the same bytes


def test_the_kept_minutes_survive_a_restart_and_the_first_minute_after_it_holds_what_changed_before_it(
        tmp_path: Path) -> None:
    clock = [0.0]
    path = tmp_path / "ledger.json"
    ledger = Ledger(path=path, clock=lambda: clock[0])
    ledger.tick()
    clock[0] = 90.0
    ledger.request("t1", "default", "exact", prompt_tokens=10, completion_tokens=5)
    ledger.save()  # shutdown, with a request booked since the last kept minute
    clock[0] = 600.0
    again = Ledger(path=path, clock=lambda: clock[0])
    again.tick()
    assert [minute for minute, _ in again._minutes] == [0, 10]
    assert again._minutes[-1][1]["t1/default"].requests == {"exact": 1}
    points = again.timeline(minutes=60)["points"]
    assert [(p["at"], p["requests"]) for p in points] == [(0, {"exact": 1}), (600, {})]


def test_a_day_of_minutes_is_kept_one_by_one_for_three_hours_and_one_in_ten_before() -> None:
    from edgecache.ledger import COARSE_MINUTES, FINE_MINUTES, HISTORY_MINUTES

    clock = [0.0]
    ledger = Ledger(clock=lambda: clock[0])
    for minute in range(2 * HISTORY_MINUTES):
        clock[0] = minute * 60 + 1
        ledger.request("t1", "default", "exact", prompt_tokens=10, completion_tokens=5)
        ledger.tick()
    now = 2 * HISTORY_MINUTES - 1
    kept = [minute for minute, _ in ledger._minutes]
    assert now - HISTORY_MINUTES <= kept[0] < now - HISTORY_MINUTES + COARSE_MINUTES
    fine = [m for m in kept if m >= now - FINE_MINUTES]
    coarse = [m for m in kept if m < now - FINE_MINUTES]
    assert fine == list(range(now - FINE_MINUTES, now + 1))
    assert all(m % COARSE_MINUTES == 0 for m in coarse) and len(coarse) == (HISTORY_MINUTES - FINE_MINUTES) // 10
    assert len(kept) < 320  # not 1,440
    # Whatever was folded, the rows as they stood at each kept minute are right: one request a minute, from 0 on.
    for minute in (kept[0], coarse[5], kept[-1]):
        assert ledger._as_of(minute)[1]["t1/default"].requests == {"exact": minute + 1}
    # And the points of a day still add up to the day: one request a minute.
    day = ledger.timeline(minutes=HISTORY_MINUTES, step=60)
    assert sum(p["requests"].get("exact", 0) for p in day["points"]) == day["window"]["requests"]["exact"]
    assert sum(p["minutes"] for p in day["points"]) == pytest.approx(HISTORY_MINUTES, abs=1)


def test_one_tenants_traffic_never_pushes_another_tenants_key_history_out() -> None:
    history = KeyHistory(max_keys=50)
    for i in range(10):
        history.stored("acme", "default", f"acme{i:012d}", expires_at=10.0, now=1.0)
    for i in range(500):
        history.stored("beta", "default", f"beta{i:012d}", expires_at=10.0, now=1.0)
    assert all(history.why_gone(f"acme{i:012d}", now=2.0) == EVICTED for i in range(10))
    assert history.why_gone("beta000000000499", now=2.0) == EVICTED and history.why_gone("beta000000000000") is None
    again = KeyHistory(max_keys=50)
    again.restore(history.state())
    again.stored("beta", "default", "beta000000009999", expires_at=10.0, now=1.0)
    assert all(again.why_gone(f"acme{i:012d}", now=2.0) == EVICTED for i in range(10))
