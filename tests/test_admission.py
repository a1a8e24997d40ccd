"""Admission control: a bounded number of misses reach the engine, a bounded queue waits, the rest get 429."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from edgecache.admission import AdmissionGate
from edgecache.http.app import create_app
from edgecache.errors import Overloaded
from tests.conftest import chat_body, serve_in_process
from tests.fakes import FakeEngine


async def test_twenty_concurrent_misses_with_a_limit_of_two(make_settings: Any) -> None:
    settings = make_settings(admission__max_concurrent_misses=2, admission__max_queue=5,
                             admission__retry_after_s=7)
    engine = FakeEngine()
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        warm = await c.post("/v1/chat/completions", json=chat_body("a cached question"))
        assert warm.status_code == 200
        engine.gate = asyncio.Event()
        tasks = [asyncio.create_task(c.post("/v1/chat/completions", json=chat_body(f"distinct {i}")))
                 for i in range(20)]
        for _ in range(500):
            if rt.admission.running + rt.admission.queued + rt.admission.rejected == 20:
                break
            await asyncio.sleep(0.01)
        assert (rt.admission.running, rt.admission.queued, rt.admission.rejected) == (2, 5, 13)
        # A hit does not queue behind the misses.
        hit = await c.post("/v1/chat/completions", json=chat_body("a cached question"))
        assert hit.status_code == 200 and hit.headers["x-edgecache"] == "exact"
        assert engine.running == 2
        engine.gate.set()
        responses = await asyncio.gather(*tasks)
        ok = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code == 429]
        assert len(ok) == 7 and len(refused) == 13
        for r in refused:
            assert r.headers["retry-after"] == "7"
            assert r.json()["error"]["type"] == "rate_limit_error"
        assert engine.max_running == 2
        metrics = (await c.get("/metrics")).text
        assert "edgecache_admission_rejections_total 13.0" in metrics
        assert 'edgecache_requests_total{outcome="rejected",scenario="default",tenant="default"} 13.0' in metrics


async def test_a_per_tenant_limit_does_not_block_other_tenants() -> None:
    gate = AdmissionGate(max_running=3, max_queue=10, queue_timeout_s=5, retry_after_s=1)
    release = asyncio.Event()
    running: list[str] = []

    async def work(tenant: str, limit: int | None) -> None:
        async with gate.slot(tenant, limit):
            running.append(tenant)
            await release.wait()

    tasks = [asyncio.create_task(work("greedy", 1)) for _ in range(3)]
    await asyncio.sleep(0.01)
    other = asyncio.create_task(work("polite", None))
    await asyncio.sleep(0.01)
    assert running == ["greedy", "polite"], "the polite tenant passed the greedy one's queued requests"
    release.set()
    await asyncio.gather(*tasks, other)
    assert gate.running == 0 and gate.queued == 0


async def test_waiting_too_long_is_a_429_and_frees_the_queue() -> None:
    gate = AdmissionGate(max_running=1, max_queue=1, queue_timeout_s=0.05, retry_after_s=3)
    hold = asyncio.Event()

    async def holder() -> None:
        async with gate.slot("a"):
            await hold.wait()

    task = asyncio.create_task(holder())
    await asyncio.sleep(0)
    with pytest.raises(Overloaded) as info:
        async with gate.slot("b"):
            pass
    assert info.value.headers() == {"Retry-After": "3"}
    assert gate.queued == 0
    hold.set()
    await task
    async with gate.slot("b"):
        assert gate.running == 1
    assert gate.running == 0


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    gate = AdmissionGate(max_running=1, max_queue=4, queue_timeout_s=5, retry_after_s=1)
    hold = asyncio.Event()

    async def holder() -> None:
        async with gate.slot("a"):
            await hold.wait()

    first = asyncio.create_task(holder())
    await asyncio.sleep(0)
    waiter = asyncio.create_task(holder())
    await asyncio.sleep(0.01)
    assert gate.queued == 1
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert gate.queued == 0
    hold.set()
    await first
    assert gate.running == 0


async def test_tenants_take_turns_for_free_slots() -> None:
    """acme queues five calls before beta's one: beta's runs as soon as a slot frees, not after acme's five."""
    gate = AdmissionGate(max_running=1, max_queue=10, queue_timeout_s=30, retry_after_s=1)
    order: list[str] = []
    release: dict[str, asyncio.Event] = {}

    async def work(name: str, tenant: str) -> None:
        release[name] = asyncio.Event()
        async with gate.slot(tenant):
            order.append(name)
            await release[name].wait()

    tasks = [asyncio.create_task(work(f"acme{i}", "acme")) for i in range(6)]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(work("beta0", "beta")))
    for _ in range(200):
        if gate.queued == 6:
            break
        await asyncio.sleep(0.001)
    assert order == ["acme0"] and gate.queued == 6
    for served in range(1, 7):  # each call ends in turn, and the free slot goes to whoever waited its turn
        release[order[-1]].set()
        for _ in range(500):
            if len(order) > served:
                break
            await asyncio.sleep(0.001)
    release[order[-1]].set()
    await asyncio.gather(*tasks)
    assert order[:3] == ["acme0", "beta0", "acme1"] and len(order) == 7
