"""Admission control: a bounded number of misses reach the engine, a bounded queue waits, the rest get 429."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from edgecache.admission import AdmissionGate
from edgecache.engines.base import Chunk, GenerationRequest
from edgecache.http.app import create_app
from edgecache.errors import Overloaded
from tests.conftest import chat_body, serve_in_process, until
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


async def test_waiting_too_long_behind_its_own_tenant_is_a_429_and_frees_the_queue() -> None:
    gate = AdmissionGate(max_running=1, max_queue=1, queue_timeout_s=0.05, retry_after_s=3)
    hold = asyncio.Event()

    async def holder() -> None:
        async with gate.slot("a"):
            await hold.wait()

    task = asyncio.create_task(holder())
    await asyncio.sleep(0)
    with pytest.raises(Overloaded) as info:
        async with gate.slot("a"):
            pass
    assert info.value.headers() == {"Retry-After": "3"}
    assert "its own misses running" in str(info.value)
    assert gate.queued == 0
    hold.set()
    await task
    async with gate.slot("a"):
        assert gate.running == 1
    assert gate.running == 0


async def test_a_tenant_with_nothing_running_waits_its_turn_behind_a_long_call_of_another() -> None:
    """beta's call waits behind acme's running call far past queue_timeout_s (its clock runs only while beta has
    calls running) and gets the slot when acme's call ends, before acme's next one; past turn_timeout_s it would
    get its 429. acme's own second call, waiting behind acme's first, gets its 429 at queue_timeout_s."""
    gate = AdmissionGate(max_running=1, max_queue=8, queue_timeout_s=0.05, turn_timeout_s=30, retry_after_s=1)
    hold = asyncio.Event()
    order: list[str] = []

    async def call(tenant: str) -> None:
        async with gate.slot(tenant):
            order.append(tenant)
            if tenant == "acme" and len(order) == 1:
                await hold.wait()

    long_call = asyncio.create_task(call("acme"))
    await until(lambda: gate.running == 1, "acme running")
    beta = asyncio.create_task(call("beta"))
    await until(lambda: gate.queued == 1, "beta waiting")
    with pytest.raises(Overloaded):
        await call("acme")  # behind its own tenant's call: charged, refused
    await asyncio.sleep(0.3)  # six of beta's queue timeouts
    assert not beta.done() and gate.queued == 1
    late = asyncio.create_task(call("acme"))
    await until(lambda: gate.queued == 2, "acme's next call waiting")
    hold.set()
    await asyncio.gather(long_call, beta, late)
    assert order == ["acme", "beta", "acme"]
    assert gate.running == 0 and gate.queued == 0
    assert not gate._busy_total and not gate._busy_since  # nothing kept for idle tenants


async def test_the_turn_timeout_bounds_the_whole_wait() -> None:
    gate = AdmissionGate(max_running=1, max_queue=8, queue_timeout_s=0.01, turn_timeout_s=0.1, retry_after_s=1)
    hold = asyncio.Event()

    async def holder() -> None:
        async with gate.slot("acme"):
            await hold.wait()

    task = asyncio.create_task(holder())
    await until(lambda: gate.running == 1, "acme running")
    with pytest.raises(Overloaded) as info:
        async with gate.slot("beta"):
            pass
    assert "its own misses" not in str(info.value)
    assert gate.queued == 0
    hold.set()
    await task


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


class _Calls:
    """Calls through a gate, each held in its slot until released by name; ``order`` is the order they got one."""

    def __init__(self, gate: AdmissionGate) -> None:
        self.gate = gate
        self.order: list[str] = []
        self.release: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def send(self, name: str, tenant: str, limit: int | None = None) -> asyncio.Task[None]:
        self.release[name] = asyncio.Event()

        async def work() -> None:
            async with self.gate.slot(tenant, limit):
                self.order.append(name)
                await self.release[name].wait()

        self.tasks[name] = asyncio.create_task(work())
        return self.tasks[name]

    async def end(self, name: str) -> None:
        """``name``'s call ends (it must be running), and the slot it frees is handed on."""
        assert name in self.order, f"{name} is not running"
        self.release[name].set()
        await asyncio.wait([self.tasks[name]])
        await asyncio.sleep(0)


async def test_one_tenants_flood_neither_fills_the_queue_nor_goes_ahead_of_another() -> None:
    """acme floods: two calls hold both slots, four wait and fill the queue. beta's one call still gets a place
    (acme's newest waiting call gives it up, with a 429), and takes the first slot that frees, ahead of acme's
    waiting calls: it waits behind one of acme's calls, never behind the many acme sent."""
    gate = AdmissionGate(max_running=2, max_queue=4, queue_timeout_s=600, retry_after_s=1)
    calls = _Calls(gate)
    for i in range(6):
        calls.send(f"acme{i}", "acme")
    await until(lambda: gate.running == 2 and gate.queued == 4, "acme holding both slots and the queue")
    with pytest.raises(Overloaded):
        gate.refuse_if_full("acme")  # acme may wait no more
    gate.refuse_if_full("beta")  # beta may
    calls.send("beta0", "beta")
    await until(lambda: calls.tasks["acme5"].done(), "acme's newest waiting call refused")
    assert isinstance(calls.tasks["acme5"].exception(), Overloaded)
    assert gate.queued == 4 and gate.queued_of("beta") == 1
    await calls.end("acme0")
    assert calls.order == ["acme0", "acme1", "beta0"]
    for name in ("acme1", "beta0", "acme2", "acme3"):
        await calls.end(name)
    assert calls.order == ["acme0", "acme1", "beta0", "acme2", "acme3", "acme4"]
    await calls.end("acme4")
    assert gate.running == 0 and gate.queued == 0


async def test_while_others_wait_a_tenant_runs_at_most_its_share() -> None:
    """acme alone uses all four slots; once beta waits, the slots acme frees go to beta until each runs its share
    (two of four), and acme's waiting calls start only within its share."""
    gate = AdmissionGate(max_running=4, max_queue=20, queue_timeout_s=600, retry_after_s=1)
    calls = _Calls(gate)
    for i in range(8):
        calls.send(f"acme{i}", "acme")
    await until(lambda: gate.running == 4, "acme using every slot")
    for i in range(4):
        calls.send(f"beta{i}", "beta")
    await until(lambda: gate.queued == 8, "beta waiting")
    assert gate.share("acme") == 2 and gate.share("beta") == 2
    await calls.end("acme0")
    await calls.end("acme1")
    assert calls.order[4:] == ["beta0", "beta1"]
    await calls.end("acme2")  # acme runs one now, below its share of two: its next call starts
    assert calls.order[6:] == ["acme4"]
    await calls.end("beta0")
    assert calls.order[7:] == ["beta2"]
    assert gate.running_by_tenant == {"acme": 2, "beta": 2}
    for task in calls.tasks.values():
        task.cancel()
    await asyncio.gather(*calls.tasks.values(), return_exceptions=True)
    assert gate.running == 0 and gate.queued == 0


async def test_free_slots_go_round_the_tenants_weighted_by_plan() -> None:
    """One slot, acme of weight 2 and beta of weight 1 both waiting with many calls: acme gets two turns for each
    of beta's."""
    weights = {"acme": 2.0, "beta": 1.0}
    gate = AdmissionGate(max_running=1, max_queue=40, queue_timeout_s=600, retry_after_s=1,
                         weight_of=weights.__getitem__)
    calls = _Calls(gate)
    calls.send("first", "beta")
    await until(lambda: gate.running == 1, "the first call running")
    for i in range(8):
        calls.send(f"acme{i}", "acme")
        calls.send(f"beta{i}", "beta")
    await until(lambda: gate.queued == 16, "both tenants waiting")
    for _ in range(9):
        await calls.end(calls.order[-1])
    tenants = [name.rstrip("0123456789") for name in calls.order[1:10]]
    assert tenants.count("acme") == 6 and tenants.count("beta") == 3
    assert all(tenants[i:i + 3].count("acme") == 2 for i in range(0, 9, 3)), tenants
    for task in calls.tasks.values():
        task.cancel()
    await asyncio.gather(*calls.tasks.values(), return_exceptions=True)
    assert gate.running == 0 and gate.queued == 0


class HoldingEngine(FakeEngine):
    """A long request (max_tokens over 100) writes until it is aborted; any other answers at once."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        if request.params.max_tokens <= 100:
            async for chunk in super().generate(request):
                yield chunk
            return
        self.calls += 1
        self.requests.append(request)
        self.running += 1
        try:
            yield Chunk(text="and so on")
            await asyncio.Event().wait()  # never ends by itself
        finally:
            self.running -= 1
            self.aborted += 1


async def test_a_tenant_flooding_the_engine_with_long_calls_never_shuts_another_out(make_settings: Any,
                                                                                    tmp_path: Path) -> None:
    """The hostile tenant's case: acme holds both slots with calls that would write for minutes and floods the
    queue behind them. beta's small request is admitted and answered: its place in the queue is taken from acme's
    flood, it waits behind one of acme's calls (which its plan's engine time ends, with a 400), never behind the
    rest, and no queue timeout is needed for it."""
    path = tmp_path / "tenants.toml"
    path.write_text('[plans.capped]\nmax_request_engine_s = 0.2\n[plans.plain]\n'
                    '[[tenants]]\nid = "acme"\nplan = "capped"\nkeys = ["sk-acme-00000001"]\n'
                    '[[tenants]]\nid = "beta"\nplan = "plain"\nkeys = ["sk-beta-00000001"]\n')
    settings = make_settings(tenants_file=str(path), admission__max_concurrent_misses=2, admission__max_queue=4,
                             admission__queue_timeout_s=600)
    engine = HoldingEngine()
    acme, beta = {"Authorization": "Bearer sk-acme-00000001"}, {"Authorization": "Bearer sk-beta-00000001"}
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        flood = [asyncio.create_task(c.post("/v1/chat/completions", headers=acme,
                                            json=chat_body(f"write a long essay {i}", max_tokens=1500)))
                 for i in range(6)]
        await until(lambda: engine.calls == 2 and rt.admission.queued == 4, "acme holding the engine")
        small = await c.post("/v1/chat/completions", headers=beta, json=chat_body("hi", max_tokens=4))
        assert small.status_code == 200, small.text
        assert [r.salt for r in engine.requests][:3] == ["acme", "acme", "beta"]
        answers = await asyncio.gather(*flood)
        statuses = sorted(r.status_code for r in answers)
        assert statuses == [400] * 5 + [429], statuses  # five cut by the plan's engine time, one gave beta its place
        cut = next(r for r in answers if r.status_code == 400).json()["error"]
        assert cut["code"] == "engine_time_exceeded" and cut["param"] == "max_tokens"
        assert engine.running == 0 and rt.admission.running == 0
        again = await c.post("/v1/chat/completions", headers=acme, json=chat_body("write a long essay 0",
                                                                                  max_tokens=1500))
        assert again.status_code == 400, "a refused call was cached"
