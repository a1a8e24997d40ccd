"""Three nodes in one process sharing one real Redis (fake engines, so engine calls can be counted): results,
flushes, tenants and Redis outages across the fleet. tests/test_fleet_e2e.py covers real processes."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from edgecache.http.app import create_app
from edgecache.semantic.decision_log import DecisionRecord, read_records
from edgecache.settings import Settings
from tests.conftest import chat_body, serve_in_process, until
from tests.fakes import FakeEngine
from edgecache.bench.redis_servers import RedisServer
from tests.test_tenants import ADMIN, TenantMarkingEngine, auth, write_tenants_file


@asynccontextmanager
async def fleet(make_settings: Callable[..., Settings], tmp_path: Path, redis_url: str, engines: list[FakeEngine],
                **overrides: Any) -> AsyncIterator[list[httpx.AsyncClient]]:
    """One in-process node per engine, each with its own data dir, all on ``redis_url``. Redis commands get a
    generous timeout: on a busy test box a slow answer would count as Redis down, and the node (rightly) compute
    alone."""
    overrides.setdefault("store__redis_timeout_s", 5.0)
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
    await until(lambda: not len(rt.inflight))
    return resp


def served(resp: httpx.Response) -> str:
    return resp.headers["x-edgecache"]


def text(resp: httpx.Response) -> str:
    return str(resp.json()["choices"][0]["message"]["content"])


async def test_a_miss_on_one_node_is_exact_on_the_others(
        make_settings: Any, tmp_path: Path, fleet_redis_url: str) -> None:
    engines = [FakeEngine(), FakeEngine(), FakeEngine()]
    async with fleet(make_settings, tmp_path, fleet_redis_url, engines) as (a, b, c):
        first = await ask(a, "What is the capital of France?")
        assert served(first) == "miss"
        for node in (b, c):
            again = await ask(node, "What is the capital of France?")
            assert served(again) == "exact" and text(again) == text(first)
        assert [e.calls for e in engines] == [1, 0, 0]
        health = (await b.get("/health")).json()
        assert health["redis"]["up"] is True


async def test_a_flush_on_one_node_is_seen_by_the_others(
        make_settings: Any, tmp_path: Path, fleet_redis_url: str) -> None:
    engines = [FakeEngine(), FakeEngine(), FakeEngine()]
    async with fleet(make_settings, tmp_path, fleet_redis_url, engines) as (a, b, c):
        await ask(a, "Hello there")
        await ask(a, "Goodbye")
        assert served(await ask(c, "Hello there")) == "exact"  # now also in C's memory tier
        resp = await b.post("/admin/flush", json={"all": True})
        assert resp.status_code == 200, resp.text
        assert resp.json()["result_entries"] == 2
        # the event reaches both other nodes' followers
        await until(lambda: all(n.app.state.runtime.fleet.events.applied for n in (a, c)))  # type: ignore[attr-defined]
        # C held "Hello there" in its memory tier: the flush event dropped it, and Redis no longer has it.
        assert served(await ask(c, "Hello there")) == "miss"
        assert served(await ask(a, "Hello there")) == "exact"  # C's fresh answer, through Redis
        assert served(await ask(a, "Goodbye")) == "miss"
        assert sum(e.calls for e in engines) == 4


async def test_tenants_stay_apart_across_nodes(make_settings: Any, tmp_path: Path, fleet_redis_url: str) -> None:
    tenants = write_tenants_file(tmp_path / "tenants.toml")
    engines = [TenantMarkingEngine(), TenantMarkingEngine(), TenantMarkingEngine()]
    async with fleet(make_settings, tmp_path, fleet_redis_url, engines, tenants_file=str(tenants)) as (a, b, c):
        first = await ask(a, "Same question", headers=auth("t01"))
        other = await ask(b, "Same question", headers=auth("t02"))
        assert served(other) == "miss" and "<t02>" in text(other)
        assert served(await ask(c, "Same question", headers=auth("t01"))) == "exact"
        assert "<t01>" in text(first)
        # A flush of t02 on C leaves t01's answers everywhere.
        assert (await c.post("/admin/flush", json={"tenant": "t02"}, headers=ADMIN)).status_code == 200
        again = await ask(b, "Same question", headers=auth("t01"))
        assert served(again) == "exact" and "<t01>" in text(again)


async def test_the_admin_stats_of_a_node_with_a_tenants_file(make_settings: Any, tmp_path: Path,
                                                              redis_url: str) -> None:
    """A plan's byte quota (a ByteSize from the tenants file) is read back as a plain count: /stats answers once a
    tenant's Redis store is open, and names its budget."""
    tenants = write_tenants_file(tmp_path / "tenants.toml")
    async with fleet(make_settings, tmp_path, redis_url, [FakeEngine()], tenants_file=str(tenants)) as (node,):
        await ask(node, "Count me", headers=auth("t01"))
        resp = await node.get("/stats", headers=ADMIN)
        assert resp.status_code == 200, resp.text
        assert resp.json()["stores"]["t01"]["budget_bytes"] == 2 * 10**9
        assert resp.json()["by_tenant"]["t01"]


async def test_redis_killed_and_restarted_mid_run(make_settings: Any, tmp_path: Path, redis_server: RedisServer,
                                                  redis_url: str) -> None:
    engines = [FakeEngine(), FakeEngine()]
    # The fleet's generous Redis timeout: a kill closes the nodes' connections and refuses new ones at once, and
    # a short timeout would mark Redis down before the kill whenever the box is slow to connect.
    async with fleet(make_settings, tmp_path, redis_url, engines) as (a, b):
        await ask(a, "hot question")
        assert served(await ask(b, "hot question")) == "exact"
        redis_server.kill()
        for _ in range(20):  # hits from the memory tier never fail while Redis is away
            assert served(await ask(b, "hot question")) == "exact"
        fresh = await ask(b, "a new question")   # a miss: the engine answers, no 5xx
        assert served(fresh) == "miss"
        health = await b.get("/health")
        assert health.status_code == 200 and health.json()["redis"]["up"] is False
        assert "edgecache_redis_up 0.0" in (await b.get("/metrics")).text
        assert (await b.post("/admin/flush", json={"all": True})).status_code == 503
        redis_server.start()
        # each node reconnects by itself, on its own monitor's beat
        await until(lambda: all(n.app.state.runtime.fleet.link.up for n in (a, b)))  # type: ignore[attr-defined]
        assert (await b.get("/health")).json()["redis"]["up"] is True
        assert "edgecache_redis_disconnects_total 1.0" in (await b.get("/metrics")).text
        await ask(b, "after the outage")
        assert served(await ask(a, "after the outage")) == "exact"


def sse_text(resp: httpx.Response) -> str:
    """The content of an SSE chat stream; an error event fails the caller's comparison with its message."""
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[6:])
            if "error" in event:
                return f"ERROR: {event['error']['message']}"
            out.extend(choice["delta"].get("content") or "" for choice in event["choices"])
    return "".join(out)


def listeners(node: httpx.AsyncClient) -> int:
    """Clients listening to this node's flights (a leader's own mirror to Redis counts as one)."""
    flights = node.app.state.runtime.inflight._local._flights.values()  # type: ignore[attr-defined]
    return sum(f.listeners for f in flights)


async def test_concurrent_identical_requests_across_nodes_make_one_engine_call(
        make_settings: Any, tmp_path: Path, fleet_redis_url: str) -> None:
    engines = [FakeEngine(pieces=6), FakeEngine(pieces=6), FakeEngine(pieces=6)]
    gate = asyncio.Event()
    for engine in engines:
        engine.gate = gate
    async with fleet(make_settings, tmp_path, fleet_redis_url, engines) as nodes:
        async def one(i: int) -> tuple[str, str]:
            stream = i % 2 == 1
            resp = await nodes[i % 3].post("/v1/chat/completions",
                                           json=chat_body("Tell me a story", stream=stream))
            assert resp.status_code == 200, resp.text
            return served(resp), sse_text(resp) if stream else text(resp)

        tasks = [asyncio.create_task(one(i)) for i in range(30)]
        # Every request is attached to the one flight before the engine produces anything.
        await until(lambda: sum(listeners(n) for n in nodes) == 30 + 1)
        gate.set()
        outcomes = await asyncio.gather(*tasks)
        assert sum(e.calls for e in engines) == 1
        assert {answer for _, answer in outcomes} == {"answer to: Tell me a story"}
        # Only the request that led says miss; the rest, on any node, were shared.
        assert sorted(how for how, _ in outcomes) == ["miss"] + ["shared"] * 29
        assert sum(n.app.state.runtime.inflight.followed for n in nodes) == 2  # type: ignore[attr-defined]


async def test_a_leader_failing_mid_stream_fails_every_follower_and_stores_nothing(
        make_settings: Any, tmp_path: Path, fleet_redis_url: str) -> None:
    engines = [FakeEngine(pieces=6, fail_after=2) for _ in range(3)]
    gate = asyncio.Event()
    for engine in engines:
        engine.gate = gate
    async with fleet(make_settings, tmp_path, fleet_redis_url, engines) as nodes:
        async def one(i: int) -> tuple[int, str]:
            stream = i % 2 == 1
            resp = await nodes[i % 3].post("/v1/chat/completions", json=chat_body("Fail please", stream=stream))
            return resp.status_code, sse_text(resp) if stream and resp.status_code == 200 else resp.text

        tasks = [asyncio.create_task(one(i)) for i in range(6)]
        await until(lambda: sum(listeners(n) for n in nodes) == 6 + 1)
        gate.set()
        outcomes = await asyncio.gather(*tasks)
        assert sum(e.calls for e in engines) == 1
        for status, body in outcomes:
            # Before the first byte the error keeps its status (502); a stream already under way ends in an
            # error event. Never a complete answer.
            assert status == 502 or body.startswith("ERROR:"), (status, body)
            assert "failed mid-stream" in body
        for engine in engines:
            engine.fail_after = None
        for node in nodes:  # nothing was stored anywhere: each node's next request computes
            resp = await ask(node, "Fail please")
            assert served(resp) in ("miss", "exact")
        assert sum(e.calls for e in engines) == 2


async def test_a_paraphrase_stored_on_one_node_is_a_semantic_hit_on_another(
        make_settings: Any, tmp_path: Path, fleet_redis_url: str) -> None:
    engines = [FakeEngine(), FakeEngine()]
    # The threshold rule (opt-in) serves a paraphrase at first sight: this test is about the shared vectors.
    async with fleet(make_settings, tmp_path, fleet_redis_url, engines, semantic__enabled=True,
                     semantic__decision="threshold") as (a, b):
        first = await ask(a, "How do I reset my password?")
        assert served(first) == "miss"
        feed = b.app.state.runtime.fleet.vectors  # type: ignore[attr-defined]
        await until(lambda: feed.applied >= 1)  # B's index took A's vector from the stream
        para = await ask(b, "How can I reset my password?")
        assert served(para) == "semantic"
        assert text(para) == text(first)
        assert sum(e.calls for e in engines) == 1
        # A restarted node replays the stream from where it stopped: a third node starting now catches up too.
        async with fleet(make_settings, tmp_path / "late", fleet_redis_url, [FakeEngine()],
                         semantic__enabled=True, semantic__decision="threshold") as (c,):
            late_feed = c.app.state.runtime.fleet.vectors  # type: ignore[attr-defined]
            await until(lambda: late_feed.applied >= 1)
            assert served(await ask(c, "how do I reset my password?")) == "semantic"


async def test_a_warmup_on_one_node_makes_a_paraphrase_a_semantic_hit_on_another(
        make_settings: Any, tmp_path: Path, fleet_redis_url: str) -> None:
    # A warmup indexes its vectors in batches (SemanticIndex.add_many): those must reach the fleet like a miss's
    # single addition does. They once stayed on the warming node: SharedIndex shared only ``add``.
    engines = [FakeEngine(), FakeEngine()]
    async with fleet(make_settings, tmp_path, fleet_redis_url, engines, semantic__enabled=True,
                     semantic__decision="threshold") as (a, b):
        lines = [{"line": 1, "request": {"messages": [{"role": "user", "content": "How do I reset my password?"}],
                                         "max_tokens": 16, "answer": "Use the 'Forgot password' link."}},
                 {"line": 2, "request": {"messages": [{"role": "user", "content": "Where is my parcel?"}],
                                         "max_tokens": 16, "answer": "Track it under Orders."}}]
        warm = await a.post("/admin/warmup", json={"lines": lines})
        assert warm.status_code == 200, warm.text
        assert [r["outcome"] for r in warm.json()["results"]] == ["written", "written"]
        feed = b.app.state.runtime.fleet.vectors  # type: ignore[attr-defined]
        await until(lambda: feed.applied >= 2)
        para = await ask(b, "How can I reset my password?")
        assert served(para) == "semantic"
        assert text(para) == "Use the 'Forgot password' link."
        assert sum(e.calls for e in engines) == 0


async def test_the_fleets_vectors_are_written_on_the_index_thread(
        make_settings: Any, tmp_path: Path, fleet_redis_url: str) -> None:
    # Every index call runs on the semantic cache's one index thread (adds in order with the searches after
    # them); the fleet's vectors once went through the loop's default executor instead.
    engines = [FakeEngine(), FakeEngine()]
    async with fleet(make_settings, tmp_path, fleet_redis_url, engines, semantic__enabled=True) as (a, b):
        local = b.app.state.runtime.semantic.index.local  # type: ignore[attr-defined]
        threads: list[str] = []
        add = local.add

        def add_noting_the_thread(*args: Any, **kwargs: Any) -> int:
            threads.append(threading.current_thread().name)
            return int(add(*args, **kwargs))

        local.add = add_noting_the_thread
        await ask(a, "How do I reset my password?")
        feed = b.app.state.runtime.fleet.vectors  # type: ignore[attr-defined]
        await until(lambda: feed.applied >= 1)
        assert threads and all(name.startswith("semantic-index") for name in threads), threads


async def test_a_label_on_one_node_teaches_the_others(make_settings: Any, tmp_path: Path, fleet_redis_url: str) -> None:
    # Node A explores a paraphrase of a shared answer and finds it wrong; node B, which never saw that label, stops
    # serving the answer too. Without the shared labels B would go on serving it: its own learner is confident.
    from tests.test_decision_log import settled
    from tests.test_learner_serving import ORIGINAL, PARAPHRASE, ScriptedEngine, teach_confidence

    engines = [ScriptedEngine(["Open Settings, then Security, then Reset password.",
                               "Bananas are yellow fruit, rich in potassium."]), FakeEngine()]
    async with fleet(make_settings, tmp_path, fleet_redis_url, engines, semantic__enabled=True,
                     semantic__decision="learner") as (a, b):
        ra, rb = (n.app.state.runtime for n in (a, b))  # type: ignore[attr-defined]
        for rt in (ra, rb):
            teach_confidence(rt.learner, "default", "default")
            rt.learner.demote_after = 1
        rb.learner.audit_share = 0.0
        assert served(await ask(a, ORIGINAL)) == "miss"
        await until(lambda: rb.fleet.vectors.applied >= 1)
        assert served(await ask(b, "How could I reset my password?")) == "semantic"  # B serves A's answer
        ra.learner.audit_share = 1.0
        assert served(await ask(a, PARAPHRASE)) == "miss"  # explored: the fresh answer is about bananas
        await settled(a)  # the label comes after the answer
        ra.decisions.flush()
        explored = [r for r in read_records(tmp_path / "node0" / "decisions") if isinstance(r, DecisionRecord)][-1]
        assert explored.decision == "explore" and ra.learner.is_demoted("default", "default", explored.store_key)
        await until(lambda: rb.fleet.labels.applied >= 1)
        assert rb.learner.is_demoted("default", "default", explored.store_key)
        assert rb.learner.entry_labels_of("default", "default", explored.store_key)[-1][1] is False
        calls = engines[1].calls
        assert served(await ask(b, "how do I reset my password?")) == "miss"  # demoted on B too
        assert engines[1].calls == calls + 1
        health = (await b.get("/health")).json()
        assert health["redis"]["labels"]["applied"] >= 1
        assert (await a.get("/health")).json()["redis"]["labels"]["published"] >= 1


async def test_a_file_taught_in_parts_on_two_nodes_teaches_each_node_what_it_teaches_whole(
        make_settings: Any, tmp_path: Path, fleet_redis_url: str) -> None:
    # Half of a tenant's groups warmed on node A, the other half on node B once A's lines and teaching reached it:
    # B teaches its half against A's lines (their group names come with the teaching, their vectors with the fleet's
    # index), and both nodes end taught what one box is taught by the whole file.
    from tests.test_teaching import _same_teaching, _taught_labels, faq, warm

    rows = faq()
    groups = list(dict.fromkeys(row["group"] for row in rows))
    halves = [[row for row in rows if row["group"] in half] for half in (groups[:13], groups[13:])]
    async with serve_in_process(create_app(make_settings(semantic__enabled=True, data_dir=str(tmp_path / "box")),
                                           engine=FakeEngine())) as box:
        assert (await warm(box, rows)).status_code == 200
        expected = _taught_labels(box.app.state.runtime.learner, "default", "default")  # type: ignore[attr-defined]
    async with fleet(make_settings, tmp_path, fleet_redis_url, [FakeEngine(), FakeEngine()],
                     semantic__enabled=True) as (a, b):
        ra, rb = (n.app.state.runtime for n in (a, b))  # type: ignore[attr-defined]
        assert (await warm(a, halves[0])).status_code == 200
        await until(lambda: rb.fleet.vectors.applied >= len(halves[0]) and rb.fleet.labels.applied >= 1)
        assert (await warm(b, halves[1])).status_code == 200
        await until(lambda: ra.fleet.labels.applied >= 1)
        for rt in (ra, rb):
            assert _same_teaching(_taught_labels(rt.learner, "default", "default"), expected)


async def test_a_label_that_cannot_be_taught_does_not_stop_the_label_follower(fleet_redis_url: str) -> None:
    from edgecache.fleet.labels import LabelFeed, SharedLabel
    from edgecache.fleet.link import RedisLink

    taught: list[str] = []

    def on_label(label: SharedLabel) -> None:
        if label.store_key == "bad":
            raise RuntimeError("cannot teach this one")
        taught.append(label.store_key)

    link = RedisLink(fleet_redis_url, timeout_s=5.0)
    await link.start()
    sender, receiver = LabelFeed(link, "node-a", lambda label: None), LabelFeed(link, "node-b", on_label)
    try:
        receiver.start()
        await until(lambda: receiver._cursor is not None)  # it reads from the stream's end: start it first
        sender.start()
        for key in ("bad", "good"):
            sender.publish("t", "s", key, 0.9, False, None)
        await until(lambda: taught == ["good"])
        assert receiver.applied == 1 and sender.published == 2 and sender.applied == 0
    finally:
        await sender.close()
        await receiver.close()
        await link.close()


class _ListIndex:
    """A semantic index that keeps what it is given (the vector feed's side of it)."""

    dim = 4

    def __init__(self) -> None:
        self.added: list[str] = []

    def remove_store_key(self, tenant: str, index: str, store_key: str) -> None:
        pass

    def add(self, tenant: str, index: str, vector: Any, store_key: str, text: str, cap: Any) -> int:
        self.added.append(store_key)
        return len(self.added)


async def test_a_malformed_vector_record_is_skipped_and_the_feed_goes_on_after_a_restart_too(
        fleet_redis_url: str, tmp_path: Path) -> None:
    import msgspec
    import numpy as np

    from edgecache.fleet.link import RedisLink, SkippedRecords
    from edgecache.fleet.vectors import VectorFeed, VectorRecord

    async def on_thread(fn: Any) -> Any:
        return await asyncio.to_thread(fn)

    link = RedisLink(fleet_redis_url, timeout_s=5.0)
    await link.start()
    skipped: list[str] = []

    def feed_on(index: _ListIndex) -> VectorFeed:
        return VectorFeed(link, "node-b", embedder_version="e1", local_index=index, cursor_file=tmp_path / "cursors",
                          cap_for=lambda tenant: None, index_thread=on_thread, skips=SkippedRecords(skipped.append))

    index = _ListIndex()
    receiver = feed_on(index)
    stream = receiver.stream("t1")
    good = np.ones(4, dtype=np.float16).tobytes()
    for key, vector in (("short", b"\x01"), ("good", good)):  # a 1-byte vector first, as another writer left it
        record = VectorRecord(origin="node-a", tenant="t1", index="default", store_key=key, text=key, vector=vector)
        await link.client.xadd(stream, {"r": msgspec.msgpack.encode(record)})
    await link.client.xadd(stream, {"r": b"\xc1 not msgpack"})
    await link.client.sadd("ec:v:e1:streams", stream)
    try:
        receiver.start()
        await until(lambda: index.added == ["good"] and len(skipped) == 2)
        assert receiver.skips.counts == {"vectors": 2} and receiver.applied == 1
    finally:
        await receiver.close()
    later = _ListIndex()
    restarted = feed_on(later)  # from the saved cursor: past the bad records, and alive for the next one
    record = VectorRecord(origin="node-a", tenant="t1", index="default", store_key="next", text="next", vector=good)
    await link.client.xadd(stream, {"r": msgspec.msgpack.encode(record)})
    try:
        restarted.start()
        await until(lambda: later.added == ["next"])
        assert len(skipped) == 2
    finally:
        await restarted.close()
        await link.close()


async def test_a_flush_that_fails_here_does_not_stop_the_later_ones(fleet_redis_url: str) -> None:
    from edgecache.fleet.events import FleetEvents
    from edgecache.fleet.link import RedisLink

    seen: list[str | None] = []

    async def on_flush(tenant: str | None, scenario: str | None) -> None:
        if tenant == "bad":
            raise RuntimeError("the store is away")
        seen.append(tenant)

    link = RedisLink(fleet_redis_url, timeout_s=5.0)
    await link.start()
    sender, receiver = FleetEvents(link, "node-a", on_flush), FleetEvents(link, "node-b", on_flush)
    try:
        await receiver.start()
        await sender.start()
        await sender.publish_flush("bad", None)
        await sender.publish_flush("good", None)
        await until(lambda: seen == ["good"])
        assert receiver.skips.counts == {"events": 1}
    finally:
        await sender.close()
        await receiver.close()
        await link.close()
