"""The ``Cache-Control`` request header over HTTP (the fake engine, the real stores): each directive, how it combines
with ``X-EdgeCache-Policy`` and the plan, malformed values, and ``Age`` on hits."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from litestar import Litestar

from edgecache.call import CACHE_CONTROL, POLICIES
from edgecache.http.app import create_app
from edgecache.http.calls import RequestCacheControl, parse_cache_control
from edgecache.errors import BadRequest
from edgecache.keys import request_key
from edgecache.runtime import Runtime
from tests.conftest import chat_body, serve_in_process
from tests.fakes import FakeEngine
from tests.test_app import assert_openai_error, sse_events

CHAT = "/v1/chat/completions"


@pytest.fixture
async def app_client(make_settings: Any, fake_engine: FakeEngine) -> AsyncIterator[tuple[Litestar, httpx.AsyncClient]]:
    app = create_app(make_settings(), engine=fake_engine)
    async with serve_in_process(app) as c:
        yield app, c


async def ask(c: httpx.AsyncClient, content: str, control: str | None = None, **extra: Any) -> httpx.Response:
    headers = {"Cache-Control": control} if control is not None else {}
    resp = await c.post(CHAT, json=chat_body(content, **extra), headers=headers)
    return resp


async def age_the_answer(app: Litestar, engine: FakeEngine, seconds: float) -> None:
    """Make the stored answer to the engine's last request ``seconds`` older, as time would."""
    rt: Runtime = app.state.runtime
    key = request_key(engine.requests[-1], model_version=engine.version, tenant="default", scenario="default")
    store = rt.stores("default")
    answer = await store.get(key)
    assert answer is not None
    older = msgspec.structs.replace(answer, created_at=answer.created_at - seconds)
    assert await store.put(key, older, tag="default")


async def test_no_cache_skips_the_read_and_still_writes(app_client: tuple[Litestar, httpx.AsyncClient],
                                                        fake_engine: FakeEngine) -> None:
    _, c = app_client
    assert (await ask(c, "stored")).headers["x-edgecache"] == "miss"
    refreshed = await ask(c, "stored", "no-cache")
    assert refreshed.headers["x-edgecache"] == "miss" and fake_engine.calls == 2
    assert (await ask(c, "fresh", "no-cache")).headers["x-edgecache"] == "miss"
    assert (await ask(c, "fresh")).headers["x-edgecache"] == "exact"  # the no-cache answer was written
    assert fake_engine.calls == 3


async def test_no_store_neither_reads_nor_writes(app_client: tuple[Litestar, httpx.AsyncClient],
                                                 fake_engine: FakeEngine) -> None:
    _, c = app_client
    assert (await ask(c, "stored")).headers["x-edgecache"] == "miss"
    assert (await ask(c, "stored", "no-store")).headers["x-edgecache"] == "miss"  # not read
    assert (await ask(c, "private", "no-store")).headers["x-edgecache"] == "miss"
    assert (await ask(c, "private")).headers["x-edgecache"] == "miss"  # not written either
    assert fake_engine.calls == 4


async def test_max_age_serves_only_younger_answers_and_keeps_the_ttl(app_client: tuple[Litestar, httpx.AsyncClient],
                                                                     fake_engine: FakeEngine) -> None:
    app, c = app_client
    first = await ask(c, "aging")
    ttl = int(first.headers["x-edgecache-ttl"])
    await age_the_answer(app, fake_engine, 1000)
    young_enough = await ask(c, "aging", "max-age=3600")
    assert young_enough.headers["x-edgecache"] == "exact" and int(young_enough.headers["age"]) >= 1000
    too_old = await ask(c, "aging", "max-age=500")
    assert too_old.headers["x-edgecache"] == "miss" and fake_engine.calls == 2
    assert "age" not in too_old.headers
    # The fresh answer replaced the old one, with the TTL it would have had anyway (not 500 s).
    assert int(too_old.headers["x-edgecache-ttl"]) == ttl
    again = await ask(c, "aging", "max-age=500")
    assert again.headers["x-edgecache"] == "exact" and int(again.headers["age"]) < 500
    assert int(again.headers["x-edgecache-ttl"]) > 500


async def test_only_if_cached_is_a_hit_or_a_504_and_never_engine_work(
        app_client: tuple[Litestar, httpx.AsyncClient], fake_engine: FakeEngine) -> None:
    _, c = app_client
    error = assert_openai_error(await ask(c, "never asked", "only-if-cached"), 504)
    assert "only-if-cached" in error["message"] and error["code"] == "only_if_cached"
    assert fake_engine.calls == 0
    streamed = await ask(c, "never asked", "only-if-cached", stream=True)
    assert streamed.status_code == 504 and fake_engine.calls == 0
    assert (await ask(c, "never asked")).headers["x-edgecache"] == "miss"
    hit = await ask(c, "never asked", "only-if-cached")
    assert hit.status_code == 200 and hit.headers["x-edgecache"] == "exact"
    # Sampling without a seed is never cached, so it can never be answered so.
    error = assert_openai_error(await ask(c, "never asked", "only-if-cached", temperature=0.7), 504)
    assert "seed" in error["message"]
    # The same as a named policy.
    named = await c.post(CHAT, json=chat_body("other"), headers={"X-EdgeCache-Policy": "only-if-cached"})
    assert_openai_error(named, 504)
    assert fake_engine.calls == 1


async def test_directives_narrow_the_named_policy(app_client: tuple[Litestar, httpx.AsyncClient],
                                                  fake_engine: FakeEngine) -> None:
    _, c = app_client
    assert (await ask(c, "combined")).headers["x-edgecache"] == "miss"
    # exact-only (no semantic layer) and no-cache (no reads): a miss, written.
    resp = await c.post(CHAT, json=chat_body("combined"),
                        headers={"X-EdgeCache-Policy": "exact-only", "Cache-Control": "no-cache"})
    assert resp.headers["x-edgecache"] == "miss"
    # no-store (a named policy that reads) and only-if-cached: a hit from the store, and nothing computed.
    resp = await c.post(CHAT, json=chat_body("combined"),
                        headers={"X-EdgeCache-Policy": "no-store", "Cache-Control": "only-if-cached"})
    assert resp.headers["x-edgecache"] == "exact"
    # no-cache and only-if-cached together can never be answered.
    assert_openai_error(await ask(c, "combined", "no-cache, only-if-cached"), 504)
    assert fake_engine.calls == 2


@pytest.mark.parametrize("control", ["max-age=abc", "max-age=-1", "max-age=1.5", "max-age", "max-age=", 'max-age="x"',
                                     "no-cache, max-age=ten"])
async def test_a_bad_max_age_is_a_400(app_client: tuple[Litestar, httpx.AsyncClient], fake_engine: FakeEngine,
                                      control: str) -> None:
    _, c = app_client
    error = assert_openai_error(await ask(c, "bad", control), 400)
    assert error["param"] == "Cache-Control" and "max-age" in error["message"]
    assert fake_engine.calls == 0


async def test_unknown_directives_are_ignored_and_lines_are_joined(app_client: tuple[Litestar, httpx.AsyncClient],
                                                                   fake_engine: FakeEngine) -> None:
    _, c = app_client
    assert (await ask(c, "lenient")).headers["x-edgecache"] == "miss"
    for control in ("max-stale=5, min-fresh=1, no-transform", 'private, community="no-store, no-cache"',
                    'MAX-AGE="3600"', "stale-if-error"):
        resp = await ask(c, "lenient", control)
        assert resp.status_code == 200 and resp.headers["x-edgecache"] == "exact", control
    # Two Cache-Control lines are one list: the second one's no-cache counts.
    resp = await c.post(CHAT, json=chat_body("lenient"),
                        headers=[("Cache-Control", "max-age=3600"), ("Cache-Control", "no-cache")])
    assert resp.headers["x-edgecache"] == "miss"
    assert fake_engine.calls == 2


def test_parse_cache_control() -> None:
    assert parse_cache_control("No-Cache, max-age=60, max-age=30") == RequestCacheControl(("no-cache",), 30.0)
    assert parse_cache_control("only-if-cached, no-store") == RequestCacheControl(("bypass", "only-if-cached"), None)
    assert parse_cache_control("max-age=99999999999999").max_age_s == 2.0**31
    assert parse_cache_control("") == RequestCacheControl()
    with pytest.raises(BadRequest):
        parse_cache_control("max-age=٣")  # a digit to Python, not to HTTP
    assert set(CACHE_CONTROL.values()) <= set(POLICIES)


async def test_a_plan_must_allow_what_a_directive_asks_for(make_settings: Any, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[plans.locked]\npolicies = ["default", "only-if-cached"]\n'
                       '[[tenants]]\nid = "t1"\nplan = "locked"\nkeys = ["sk-t1-secret-1"]\n')
    engine = FakeEngine()
    async with serve_in_process(create_app(make_settings(tenants_file=str(tenants)), engine=engine)) as c:
        auth = {"Authorization": "Bearer sk-t1-secret-1"}
        for control, policy in (("no-cache", "no-cache"), ("no-store", "bypass")):
            resp = await c.post(CHAT, json=chat_body("x"), headers={**auth, "Cache-Control": control})
            error = assert_openai_error(resp, 403)
            assert error["param"] == "Cache-Control" and policy in error["message"] and control in error["message"]
        resp = await c.post(CHAT, json=chat_body("x"), headers={**auth, "Cache-Control": "max-age=60"})
        assert resp.status_code == 200  # max-age narrows freshness, not the policy: any plan may ask it
        assert_openai_error(await c.post(CHAT, json=chat_body("y"), headers={
            **auth, "Cache-Control": "only-if-cached"}), 504)
    assert engine.calls == 1


async def test_hits_carry_age_json_and_streamed_and_misses_do_not(app_client: tuple[Litestar, httpx.AsyncClient],
                                                                  fake_engine: FakeEngine) -> None:
    app, c = app_client
    miss = await ask(c, "how old")
    assert "age" not in miss.headers
    await age_the_answer(app, fake_engine, 120)
    hit = await ask(c, "how old")
    assert hit.headers["x-edgecache"] == "exact" and 120 <= int(hit.headers["age"]) < 3600
    streamed = await ask(c, "how old", stream=True)
    assert streamed.headers["x-edgecache"] == "exact" and 120 <= int(streamed.headers["age"]) < 3600
    assert sse_events(streamed.text)[-1]["choices"][0]["finish_reason"] == "stop"
    completion = await c.post("/v1/completions", json={"model": "fake-model", "prompt": "p", "temperature": 0})
    assert "age" not in completion.headers
    again = await c.post("/v1/completions", json={"model": "fake-model", "prompt": "p", "temperature": 0})
    assert again.headers["x-edgecache"] == "exact" and int(again.headers["age"]) >= 0


async def test_every_api_reads_cache_control_messages_too(app_client: tuple[Litestar, httpx.AsyncClient],
                                                          fake_engine: FakeEngine) -> None:
    _, c = app_client
    body = {"model": "fake-model", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "via messages"}]}
    refused = await c.post("/v1/messages", json=body, headers={"Cache-Control": "only-if-cached"})
    assert refused.status_code == 504 and refused.json()["type"] == "error"  # Anthropic's error shape
    assert "only-if-cached" in refused.json()["error"]["message"] and fake_engine.calls == 0
    assert (await c.post("/v1/messages", json=body)).headers["x-edgecache"] == "miss"
    hit = await c.post("/v1/messages", json=body, headers={"Cache-Control": "only-if-cached"})
    assert hit.headers["x-edgecache"] == "exact" and int(hit.headers["age"]) >= 0
    fresh = await c.post("/v1/messages", json=body, headers={"Cache-Control": "no-cache"})
    assert fresh.headers["x-edgecache"] == "miss" and "age" not in fresh.headers
    assert fake_engine.calls == 2


async def test_every_api_reads_cache_control_responses_too(app_client: tuple[Litestar, httpx.AsyncClient],
                                                           fake_engine: FakeEngine) -> None:
    _, c = app_client
    body = {"model": "fake-model", "input": "via responses", "temperature": 0, "max_output_tokens": 16}
    refused = await c.post("/v1/responses", json=body, headers={"Cache-Control": "only-if-cached"})
    error = assert_openai_error(refused, 504)
    assert "only-if-cached" in error["message"] and fake_engine.calls == 0
    assert (await c.post("/v1/responses", json=body)).headers["x-edgecache"] == "miss"
    hit = await c.post("/v1/responses", json=body, headers={"Cache-Control": "only-if-cached"})
    assert hit.headers["x-edgecache"] == "exact" and int(hit.headers["age"]) >= 0
    streamed = await c.post("/v1/responses", json={**body, "stream": True}, headers={"Cache-Control": "max-age=60"})
    assert streamed.headers["x-edgecache"] == "exact" and int(streamed.headers["age"]) >= 0
    assert fake_engine.calls == 1
