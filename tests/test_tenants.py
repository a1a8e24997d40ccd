"""Tenants, plans and cache policy: isolation on every layer, quotas, policies, TTL tiers, model versions, flush."""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path
from typing import Any

import httpx
import pytest

from edgecache.http.app import create_app
from edgecache.engines.base import GenerationRequest
from edgecache.errors import Unauthorized
from edgecache.settings import SettingsError
from edgecache.tenants import TenantDirectory
from tests.conftest import chat_body, serve_in_process
from tests.fakes import FakeEngine

TENANTS = [f"t{i:02d}" for i in range(10)]


class TenantMarkingEngine(FakeEngine):
    """Every answer names the tenant it was computed for (the request's salt), so a leak is visible."""

    def answer_for(self, request: GenerationRequest) -> str:
        return f"<{request.salt}> " + super().answer_for(request)


def key_of(tenant: str) -> str:
    return f"sk-{tenant}-secret-0001"


def write_tenants_file(path: Path, *, small_quota: str = "2GB") -> Path:
    lines = ['[plans.basic]\nstore_bytes = "2GB"\n',
             f'[plans.small]\nstore_bytes = "{small_quota}"\n',
             '[plans.locked]\nstore_bytes = "1GB"\npolicies = ["default", "no-store"]\nmax_request_tokens = 64\n',
             '[admin]\nkeys = ["sk-admin-secret-01"]\n']
    for tenant in TENANTS:
        plan = {"t00": "small", "t09": "locked"}.get(tenant, "basic")
        lines.append(f'[[tenants]]\nid = "{tenant}"\nplan = "{plan}"\nkeys = ["{key_of(tenant)}"]\n')
    path.write_text("\n".join(lines))
    return path


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key_of(tenant)}"}


ADMIN = {"Authorization": "Bearer sk-admin-secret-01"}


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    return write_tenants_file(tmp_path / "tenants.toml")


async def ask(c: httpx.AsyncClient, tenant: str, content: str, *, headers: dict[str, str] | None = None,
              **extra: Any) -> httpx.Response:
    resp = await c.post("/v1/chat/completions", json=chat_body(content, **extra),
                        headers={**auth(tenant), **(headers or {})})
    assert resp.status_code == 200, resp.text
    return resp


def content(resp: httpx.Response) -> str:
    return str(resp.json()["choices"][0]["message"]["content"])


async def settle(c: httpx.AsyncClient) -> None:
    rt = c.app.state.runtime  # type: ignore[attr-defined]
    for _ in range(500):
        if not len(rt.inflight):
            return
        await asyncio.sleep(0.01)


# --- isolation -------------------------------------------------------------------------------------------------

PROMPTS = ["How do I reset my password?", "How can I reset my password?", "How do I reset my password",
           "What is the refund policy?", "What's your refund policy?", "How do I close my account?",
           "How can I close my account?", "Where is my card?", "Where's my card?", "Can I change my PIN?"]


async def test_no_tenant_ever_sees_another_tenants_answer(make_settings: Any, tenants_file: Path) -> None:
    """Ten tenants, colliding prompts (identical and paraphrased), random interleavings, every layer on."""
    engine = TenantMarkingEngine()
    # The threshold rule (opt-in) serves paraphrases at first sight, so every layer is exercised within the run.
    settings = make_settings(tenants_file=str(tenants_file), semantic__enabled=True, semantic__decision="threshold")
    rng = random.Random(7)
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        served: dict[str, int] = {}
        for _round in range(40):
            batch = [(rng.choice(TENANTS), rng.choice(PROMPTS), rng.random() < 0.3) for _ in range(50)]
            responses = await asyncio.gather(*(
                c.post("/v1/chat/completions", json=chat_body(p, stream=stream),
                       headers={**auth(t), "X-EdgeCache-Scenario": "support"})
                for t, p, stream in batch))
            for (tenant, _, stream), resp in zip(batch, responses):
                assert resp.status_code == 200, resp.text
                text = resp.text if stream else content(resp)
                assert f"<{tenant}>" in text, (tenant, text)
                assert all(f"<{other}>" not in text for other in TENANTS if other != tenant)
                served[resp.headers["x-edgecache"]] = served.get(resp.headers["x-edgecache"], 0) + 1
    assert sum(served.values()) == 2000
    # The run exercised every layer, or it proves little.
    assert served.get("exact", 0) > 500 and served.get("semantic", 0) > 0 and served.get("miss", 0) > 0, served
    # Every engine call was for one tenant, with that tenant as the prefix-cache salt.
    assert {r.salt for r in engine.requests} <= set(TENANTS)


async def test_a_tenant_filling_its_quota_evicts_only_its_own_entries(make_settings: Any, tmp_path: Path) -> None:
    tenants_file = write_tenants_file(tmp_path / "tenants.toml", small_quota="300KB")
    async with serve_in_process(create_app(make_settings(tenants_file=str(tenants_file),
                                                         store__memory_bytes=1), engine=FakeEngine())) as c:
        for i in range(20):
            await ask(c, "t01", f"keep {i}: " + "k" * 2000)
        for i in range(200):  # ~10 KB answers: 2 MB into a 300 KB quota
            await ask(c, "t00", f"flood {i}: " + "x" * 10_000)
        await settle(c)
        stats = (await c.get("/stats", headers=ADMIN)).json()
        assert stats["stores"]["t00"]["bytes"] <= 400_000
        assert stats["stores"]["t00"]["budget_bytes"] == 300_000
        assert stats["stores"]["t01"]["entries"] == 20
        for i in range(20):
            resp = await ask(c, "t01", f"keep {i}: " + "k" * 2000)
            assert resp.headers["x-edgecache"] == "exact"
        assert (await ask(c, "t00", "flood 0: " + "x" * 10_000)).headers["x-edgecache"] == "miss"


# --- authentication --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("header", [None, "Bearer sk-nobody-at-all-1", "Basic abc", "Bearer ", "sk-t01-secret-0001"])
async def test_unknown_or_missing_keys_get_401(make_settings: Any, tenants_file: Path, header: str | None) -> None:
    async with serve_in_process(create_app(make_settings(tenants_file=str(tenants_file)),
                                           engine=FakeEngine())) as c:
        headers = {"Authorization": header} if header is not None else {}
        resp = await c.post("/v1/chat/completions", json=chat_body("hi"), headers=headers)
        assert resp.status_code == 401
        assert resp.json()["error"]["type"] == "authentication_error"
        assert (await c.post("/admin/flush", json={"all": True}, headers=auth("t01"))).status_code == 401
        assert (await c.get("/stats", headers=headers)).status_code == 401
        own = await c.get("/stats", headers=auth("t01"))  # a tenant's key: its own figures, nobody else's
        assert own.status_code == 200 and own.json()["tenant"] == "t01"
        # The cost fit rests on every tenant's engine calls: a tenant sees whether it is ready, not its basis.
        assert own.json()["ledger"]["fit"] == {"ready": False}
        assert "calls" in (await c.get("/stats", headers=ADMIN)).json()["ledger"]["fit"]


async def test_keys_never_appear_in_logs_or_metrics(make_settings: Any, tenants_file: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with serve_in_process(create_app(make_settings(tenants_file=str(tenants_file)),
                                           engine=FakeEngine())) as c:
        await ask(c, "t01", "hello")
        await c.post("/v1/chat/completions", json=chat_body("hi"), headers={"Authorization": "Bearer sk-wrong-123456"})
        await c.post("/admin/flush", json={"tenant": "t01"}, headers=ADMIN)
        exposed = (caplog.text + (await c.get("/metrics", headers=ADMIN)).text
                   + (await c.get("/stats", headers=ADMIN)).text)
    for secret in [key_of(t) for t in TENANTS] + ["sk-wrong-123456", "sk-admin-secret-01"]:
        assert secret not in exposed


def test_tenants_file_errors_are_clear(tmp_path: Path) -> None:
    bad_plan = tmp_path / "a.toml"
    bad_plan.write_text('[[tenants]]\nid = "x"\nplan = "gold"\nkeys = ["sk-x-123456789"]\n')
    with pytest.raises(SettingsError, match="unknown plan 'gold'"):
        TenantDirectory.from_file(bad_plan)
    shared_key = tmp_path / "b.toml"
    shared_key.write_text('[plans.p]\n[[tenants]]\nid = "a"\nplan = "p"\nkeys = ["sk-same-12345"]\n'
                          '[[tenants]]\nid = "b"\nplan = "p"\nkeys = ["sk-same-12345"]\n')
    with pytest.raises(SettingsError, match="also a key of") as info:
        TenantDirectory.from_file(shared_key)
    assert "sk-same-12345" not in str(info.value)
    with pytest.raises(SettingsError, match="not found"):
        TenantDirectory.from_file(tmp_path / "missing.toml")
    directory = TenantDirectory.from_file(write_tenants_file(tmp_path / "ok.toml"))
    assert directory.authenticate(f"Bearer {key_of('t03')}").id == "t03"
    with pytest.raises(Unauthorized):
        directory.authenticate("Bearer sk-t03-secret-0002")


# --- policies --------------------------------------------------------------------------------------------------


async def test_each_policy_does_what_it_says(make_settings: Any, tenants_file: Path) -> None:
    engine = FakeEngine()
    async with serve_in_process(create_app(make_settings(tenants_file=str(tenants_file), semantic__enabled=True),
                                           engine=engine)) as c:
        rt = c.app.state.runtime  # type: ignore[attr-defined]

        async def entries() -> int:
            await settle(c)
            return int((await rt.stores("t01").stats())["entries"])

        async def vectors() -> int:
            await settle(c)
            return sum((await rt.semantic.sizes()).values())

        # no-store: computes, writes nothing (no entry, no vector)
        r = await ask(c, "t01", "How do I reset my password?", headers={"X-EdgeCache-Policy": "no-store"})
        assert r.headers["x-edgecache"] == "miss" and "x-edgecache-ttl" not in r.headers
        assert await entries() == 0 and await vectors() == 0
        # default: computes and writes
        await ask(c, "t01", "How do I reset my password?")
        assert await entries() == 1 and await vectors() == 1
        # no-store still reads
        r = await ask(c, "t01", "How do I reset my password?", edgecache={"policy": "no-store"})
        assert r.headers["x-edgecache"] == "exact"
        # bypass: neither reads nor writes
        calls = engine.calls
        r = await ask(c, "t01", "How do I reset my password?", headers={"X-EdgeCache-Policy": "bypass"})
        assert r.headers["x-edgecache"] == "miss" and engine.calls == calls + 1
        r = await ask(c, "t01", "Something new entirely", headers={"X-EdgeCache-Policy": "bypass"})
        assert await entries() == 1 and await vectors() == 1
        # no-cache: skips the read, computes, writes the refreshed answer
        engine.marker = "v2 "
        r = await ask(c, "t01", "How do I reset my password?", headers={"X-EdgeCache-Policy": "no-cache"})
        assert r.headers["x-edgecache"] == "miss" and content(r).startswith("v2 ")
        r = await ask(c, "t01", "How do I reset my password?")
        assert r.headers["x-edgecache"] == "exact" and content(r).startswith("v2 ")
        # exact-only: no semantic read for a paraphrase, and no vector written
        before = await vectors()
        r = await ask(c, "t01", "How can I reset my password?", headers={"X-EdgeCache-Policy": "exact-only"})
        assert r.headers["x-edgecache"] == "miss"
        assert await vectors() == before
        # sampling without a seed: not cached, unless the caller asks for reuse
        for _ in range(2):
            assert (await ask(c, "t01", "a poem", temperature=0.9)).headers["x-edgecache"] == "miss"
        first = await ask(c, "t01", "a poem", temperature=0.9, edgecache={"policy": "reuse"})
        again = await ask(c, "t01", "a poem", temperature=0.9, edgecache={"policy": "reuse"})
        assert (first.headers["x-edgecache"], again.headers["x-edgecache"]) == ("miss", "exact")


async def test_a_plan_limits_the_policies(make_settings: Any, tenants_file: Path) -> None:
    async with serve_in_process(create_app(make_settings(tenants_file=str(tenants_file)),
                                           engine=FakeEngine())) as c:
        resp = await c.post("/v1/chat/completions", json=chat_body("x"),
                            headers={**auth("t09"), "X-EdgeCache-Policy": "bypass"})
        assert resp.status_code == 403 and resp.json()["error"]["param"] == "edgecache.policy"
        assert (await ask(c, "t09", "x", headers={"X-EdgeCache-Policy": "no-store"})).status_code == 200
        bad = await c.post("/v1/chat/completions", json=chat_body("x"),
                           headers={**auth("t01"), "X-EdgeCache-Policy": "sometimes"})
        assert bad.status_code == 400


# --- TTL tiers -------------------------------------------------------------------------------------------------


async def test_a_realtime_answer_expires_after_its_ttl(make_settings: Any) -> None:
    engine = FakeEngine()
    settings = make_settings(ttl_tiers__realtime_s=0.3, ttl_tiers__near_realtime_s=120)
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        live = await c.post("/v1/chat/completions", json=chat_body("What is the AAPL stock price right now?"))
        static = await c.post("/v1/chat/completions", json=chat_body("Explain how quicksort works"))
        news = await c.post("/v1/chat/completions", json=chat_body("What happened in tech this week?"))
        assert live.headers["x-edgecache-ttl"] == "0"
        assert static.headers["x-edgecache-ttl"] == "86400"
        assert news.headers["x-edgecache-ttl"] == "120"
        explicit = await c.post("/v1/chat/completions", json=chat_body("Explain heaps", edgecache={"ttl": 42}))
        assert explicit.headers["x-edgecache-ttl"] == "42"
        tier = await c.post("/v1/chat/completions",
                            json=chat_body("Explain tries", edgecache={"ttl_tier": "near-realtime"}))
        assert tier.headers["x-edgecache-ttl"] == "120"
        await settle(c)
        hit = await c.post("/v1/chat/completions", json=chat_body("Explain how quicksort works"))
        assert hit.headers["x-edgecache"] == "exact" and 86000 < int(hit.headers["x-edgecache-ttl"]) <= 86400
        await asyncio.sleep(0.4)
        again = await c.post("/v1/chat/completions", json=chat_body("What is the AAPL stock price right now?"))
        assert again.headers["x-edgecache"] == "miss"
        assert (await c.post("/v1/chat/completions",
                             json=chat_body("Explain how quicksort works"))).headers["x-edgecache"] == "exact"


# --- model versions and flush ----------------------------------------------------------------------------------


async def test_a_different_model_never_answers_from_old_entries(make_settings: Any) -> None:
    settings = make_settings(semantic__enabled=True)
    async with serve_in_process(create_app(settings, engine=FakeEngine(version="model-a@1"))) as c:
        await c.post("/v1/chat/completions", json=chat_body("How do I reset my password?"))
    engine_b = FakeEngine(version="model-b@1", marker="B: ")
    async with serve_in_process(create_app(settings, engine=engine_b)) as c:
        same = await c.post("/v1/chat/completions", json=chat_body("How do I reset my password?"))
        para = await c.post("/v1/chat/completions", json=chat_body("How can I reset my password?"))
        assert same.headers["x-edgecache"] == "miss" and content(same).startswith("B: ")
        assert para.headers["x-edgecache"] in ("miss", "semantic")
        assert content(para).startswith("B: ")
    engine_a = FakeEngine(version="model-a@1")
    async with serve_in_process(create_app(settings, engine=engine_a)) as c:
        back = await c.post("/v1/chat/completions", json=chat_body("How do I reset my password?"))
        assert back.headers["x-edgecache"] == "exact" and engine_a.calls == 0


async def test_flush_by_tenant_by_scenario_and_all(make_settings: Any, tenants_file: Path) -> None:
    engine = FakeEngine()
    settings = make_settings(tenants_file=str(tenants_file), semantic__enabled=True,
                             semantic__decision="threshold")  # a paraphrase hits at first sight
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        for tenant in ("t01", "t02"):
            await ask(c, tenant, "How do I reset my password?")
            await ask(c, tenant, "How do I close my account?", headers={"X-EdgeCache-Scenario": "support"})
        await settle(c)
        flushed = await c.post("/admin/flush", json={"tenant": "t01"}, headers=ADMIN)
        assert flushed.status_code == 200 and flushed.json()["result_entries"] == 2
        assert (await ask(c, "t01", "How do I reset my password?")).headers["x-edgecache"] == "miss"
        assert (await ask(c, "t01", "How can I reset my password?")).headers["x-edgecache"] == "semantic"
        assert (await ask(c, "t02", "How do I reset my password?")).headers["x-edgecache"] == "exact"
        assert (await ask(c, "t02", "How can I close my account?",
                          headers={"X-EdgeCache-Scenario": "support"})).headers["x-edgecache"] == "semantic"
        await settle(c)
        # By scenario: t02's support entries go, its default-scenario entries stay.
        resp = await c.post("/admin/flush", json={"scenario": "support"}, headers=ADMIN)
        assert resp.status_code == 200
        assert (await ask(c, "t02", "How do I close my account?",
                          headers={"X-EdgeCache-Scenario": "support"})).headers["x-edgecache"] == "miss"
        assert (await ask(c, "t02", "How do I reset my password?")).headers["x-edgecache"] == "exact"
        # Everything, the engine's prefix cache included.
        assert (await c.post("/admin/flush", json={"all": True}, headers=ADMIN)).status_code == 200
        assert engine.flushed == 1
        assert (await ask(c, "t02", "How do I reset my password?")).headers["x-edgecache"] == "miss"
        bad = await c.post("/admin/flush", json={}, headers=ADMIN)
        assert bad.status_code == 400
        assert (await c.post("/admin/flush", json={"tenant": "nobody"}, headers=ADMIN)).status_code == 404


async def test_stats_report_per_tenant_figures(make_settings: Any, tenants_file: Path) -> None:
    async with serve_in_process(create_app(make_settings(tenants_file=str(tenants_file)),
                                           engine=FakeEngine())) as c:
        await ask(c, "t01", "a")
        await ask(c, "t01", "a")
        await ask(c, "t02", "b")
        await settle(c)
        stats = (await c.get("/stats", headers=ADMIN)).json()
        assert stats["by_tenant"]["t01"]["default"] == {"miss": 1, "exact": 1}
        assert stats["by_tenant"]["t02"]["default"] == {"miss": 1}
        assert stats["stores"]["t01"]["entries"] == 1 and stats["stores"]["t01"]["budget_bytes"] == 2 * 10**9
        metrics = (await c.get("/metrics", headers=ADMIN)).text
        assert 'edgecache_requests_total{outcome="exact",scenario="default",tenant="t01"} 1.0' in metrics


async def test_a_plan_caps_its_tenants_semantic_indexes(make_settings: Any, tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text('[plans.tiny]\nsemantic_max_vectors = 2\n[plans.roomy]\n'
                    '[[tenants]]\nid = "small"\nplan = "tiny"\nkeys = ["sk-small-000001"]\n'
                    '[[tenants]]\nid = "big"\nplan = "roomy"\nkeys = ["sk-big-00000001"]\n')
    async with serve_in_process(create_app(make_settings(tenants_file=str(path), semantic__enabled=True),
                                           engine=FakeEngine())) as c:
        for who, key in (("small", "sk-small-000001"), ("big", "sk-big-00000001")):
            for question in ("How do I reset my password?", "Where is my card?", "What is the refund policy?"):
                resp = await c.post("/v1/chat/completions", json=chat_body(question),
                                    headers={"Authorization": f"Bearer {key}"})
                assert resp.status_code == 200
        await settle(c)
        sizes = await c.app.state.runtime.semantic.sizes()  # type: ignore[attr-defined]
        assert sizes == {("small", "default"): 2, ("big", "default"): 3}


async def test_a_plans_cap_on_tokens_a_request_refuses_more_with_a_400(make_settings: Any, tenants_file: Path) -> None:
    engine = FakeEngine()
    async with serve_in_process(create_app(make_settings(tenants_file=str(tenants_file)), engine=engine)) as c:
        over = await c.post("/v1/chat/completions", json=chat_body("long", max_tokens=40, n=2), headers=auth("t09"))
        assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
        assert "80 tokens" in over.json()["error"]["message"] and engine.calls == 0
        await ask(c, "t09", "short", max_tokens=64)  # within it
        await ask(c, "t01", "long", max_tokens=400)  # another plan, no cap
        messages = await c.post("/v1/messages", headers=auth("t09"), json={
            "model": "fake-model", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]})
        assert messages.status_code == 400 and messages.json()["type"] == "error"


async def test_a_plan_bounds_its_tenants_semantic_indexes_and_vectors_and_stats_show_each(
        make_settings: Any, tmp_path: Path) -> None:
    """Every distinct system prompt makes a semantic index (in memory and a file). A tenant sending many holds at
    most its plan's number of indexes and of vectors across them, its least recently used giving way; the other
    tenant keeps all of its own; each tenant's /stats shows its own use beside each bound, and nothing of the
    other's."""
    path = tmp_path / "tenants.toml"
    path.write_text('[plans.tiny]\nsemantic_max_indexes = 2\nsemantic_max_tenant_vectors = 3\n'
                    'max_request_engine_s = 30\nweight = 2\n[plans.roomy]\n'
                    '[[tenants]]\nid = "acme"\nplan = "tiny"\nkeys = ["sk-acme-00000001"]\n'
                    '[[tenants]]\nid = "beta"\nplan = "roomy"\nkeys = ["sk-beta-00000001"]\n')
    settings = make_settings(tenants_file=str(path), semantic__enabled=True)
    acme, beta = {"Authorization": "Bearer sk-acme-00000001"}, {"Authorization": "Bearer sk-beta-00000001"}
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        for who in (beta, acme):
            for system in range(4):
                for question in ("How do I reset my password?", "Where is my card?"):
                    resp = await c.post("/v1/chat/completions", headers=who, json=chat_body(
                        question, messages=[{"role": "system", "content": f"You are assistant number {system}."},
                                            {"role": "user", "content": question}]))
                    assert resp.status_code == 200, resp.text
            await settle(c)
        sizes = await rt.semantic.sizes()
        assert sizes == {("acme", "default"): 3, ("beta", "default"): 8}
        assert len(list((Path(settings.data_dir)).rglob("acme/*.usearch"))) <= 2
        mine = (await c.get("/stats", headers=acme)).json()
        assert mine["bounds"]["semantic_indexes"] == {"used": 2, "bound": 2}
        assert mine["bounds"]["semantic_vectors"] == {"used": 3, "bound": 3}
        assert mine["bounds"]["semantic_vectors_per_index"]["used"] == 2
        assert mine["bounds"]["request_engine_s"] == {"bound": 30.0}
        assert mine["bounds"]["engine_running"]["weight"] == 2.0
        assert mine["bounds"]["feedback_responses"]["used"] == 8
        assert mine["bounds"]["key_history"]["used"] == 8 and "beta" not in str(mine)
        theirs = (await c.get("/stats", headers=beta)).json()
        assert theirs["bounds"]["semantic_indexes"] == {"used": 4, "bound": 1000}
        assert theirs["bounds"]["semantic_vectors"]["used"] == 8
