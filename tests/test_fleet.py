"""Three nodes in one process sharing one real Redis (fake engines, so engine calls can be counted): results,
flushes, tenants and Redis outages across the fleet. tests/test_fleet_e2e.py covers real processes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from edgecache.app import create_app
from edgecache.settings import Settings
from tests.conftest import chat_body, serve_in_process
from tests.fakes import FakeEngine
from tests.redis_server import RedisServer
from tests.test_tenants import ADMIN, TenantMarkingEngine, auth, write_tenants_file


@asynccontextmanager
async def fleet(make_settings: Callable[..., Settings], tmp_path: Path, redis_url: str, engines: list[FakeEngine],
                **overrides: Any) -> AsyncIterator[list[httpx.AsyncClient]]:
    """One in-process node per engine, each with its own data dir, all on ``redis_url``."""
    async with AsyncExitStack() as stack:
        nodes = []
        for i, engine in enumerate(engines):
            settings = make_settings(data_dir=str(tmp_path / f"node{i}"), store__backend="redis",
                                     store__redis_url=redis_url, **overrides)
            nodes.append(await stack.enter_async_context(serve_in_process(create_app(settings, engine=engine))))
        yield nodes


async def ask(node: httpx.AsyncClient, text: str, headers: dict[str, str] | None = None,
              **extra: Any) -> httpx.Response:
    """One request, and (for a miss) until the node has stored its answer: the client gets the answer as soon
    as it is complete, a moment before the store write ends."""
    resp = await node.post("/v1/chat/completions", json=chat_body(text, **extra), headers=headers or {})
    assert resp.status_code == 200, resp.text
    rt = node.app.state.runtime  # type: ignore[attr-defined]
    for _ in range(500):
        if not len(rt.inflight):
            break
        await asyncio.sleep(0.01)
    return resp


def served(resp: httpx.Response) -> str:
    return resp.headers["x-edgecache"]


def text(resp: httpx.Response) -> str:
    return str(resp.json()["choices"][0]["message"]["content"])


async def test_a_miss_on_one_node_is_exact_on_the_others(make_settings: Any, tmp_path: Path, redis_url: str) -> None:
    engines = [FakeEngine(), FakeEngine(), FakeEngine()]
    async with fleet(make_settings, tmp_path, redis_url, engines) as (a, b, c):
        first = await ask(a, "What is the capital of France?")
        assert served(first) == "miss"
        for node in (b, c):
            again = await ask(node, "What is the capital of France?")
            assert served(again) == "exact" and text(again) == text(first)
        assert [e.calls for e in engines] == [1, 0, 0]
        health = (await b.get("/health")).json()
        assert health["redis"]["up"] is True


async def test_a_flush_on_one_node_is_seen_by_the_others(make_settings: Any, tmp_path: Path, redis_url: str) -> None:
    engines = [FakeEngine(), FakeEngine(), FakeEngine()]
    async with fleet(make_settings, tmp_path, redis_url, engines) as (a, b, c):
        await ask(a, "Hello there")
        await ask(a, "Goodbye")
        assert served(await ask(c, "Hello there")) == "exact"  # now also in C's memory tier
        resp = await b.post("/admin/flush", json={"all": True})
        assert resp.status_code == 200, resp.text
        assert resp.json()["result_entries"] == 2
        for node in (a, c):
            rt = node.app.state.runtime  # type: ignore[attr-defined]
            for _ in range(300):  # the event reaches the node's follower (no timing asserted, only the outcome)
                if rt.fleet.events.applied:
                    break
                await asyncio.sleep(0.01)
        # C held "Hello there" in its memory tier: the flush event dropped it, and Redis no longer has it.
        assert served(await ask(c, "Hello there")) == "miss"
        assert served(await ask(a, "Hello there")) == "exact"  # C's fresh answer, through Redis
        assert served(await ask(a, "Goodbye")) == "miss"
        assert sum(e.calls for e in engines) == 4


async def test_tenants_stay_apart_across_nodes(make_settings: Any, tmp_path: Path, redis_url: str) -> None:
    tenants = write_tenants_file(tmp_path / "tenants.toml")
    engines = [TenantMarkingEngine(), TenantMarkingEngine(), TenantMarkingEngine()]
    async with fleet(make_settings, tmp_path, redis_url, engines, tenants_file=str(tenants)) as (a, b, c):
        first = await ask(a, "Same question", headers=auth("t01"))
        other = await ask(b, "Same question", headers=auth("t02"))
        assert served(other) == "miss" and "<t02>" in text(other)
        assert served(await ask(c, "Same question", headers=auth("t01"))) == "exact"
        assert "<t01>" in text(first)
        # A flush of t02 on C leaves t01's answers everywhere.
        assert (await c.post("/admin/flush", json={"tenant": "t02"}, headers=ADMIN)).status_code == 200
        again = await ask(b, "Same question", headers=auth("t01"))
        assert served(again) == "exact" and "<t01>" in text(again)


async def test_redis_killed_and_restarted_mid_run(make_settings: Any, tmp_path: Path, redis_server: RedisServer,
                                                  redis_url: str) -> None:
    engines = [FakeEngine(), FakeEngine()]
    async with fleet(make_settings, tmp_path, redis_url, engines, store__redis_timeout_s=0.3) as (a, b):
        await ask(a, "hot question")
        assert served(await ask(b, "hot question")) == "exact"
        redis_server.kill()
        for _ in range(20):  # hits from the memory tier never fail while Redis is away
            assert served(await ask(b, "hot question")) == "exact"
        fresh = await ask(b, "a new question")   # a miss: the engine answers, no 5xx
        assert served(fresh) == "miss"
        rt = b.app.state.runtime  # type: ignore[attr-defined]
        health = await b.get("/health")
        assert health.status_code == 200 and health.json()["redis"]["up"] is False
        assert "edgecache_redis_up 0.0" in (await b.get("/metrics")).text
        assert (await b.post("/admin/flush", json={"all": True})).status_code == 503
        redis_server.start()
        for _ in range(500):
            if rt.fleet.link.up:
                break
            await asyncio.sleep(0.01)
        assert rt.fleet.link.up, "the node reconnects by itself"
        assert (await b.get("/health")).json()["redis"]["up"] is True
        assert "edgecache_redis_disconnects_total 1.0" in (await b.get("/metrics")).text
        await ask(b, "after the outage")
        assert served(await ask(a, "after the outage")) == "exact"
