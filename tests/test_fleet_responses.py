"""The Responses API's stored responses shared by a fleet (:mod:`edgecache.fleet.responses`): nodes in one process on
one real Redis, each with its own data dir. A response created on one node is read, listed, continued and deleted
on another; tenants stay apart; each tenant's byte bound holds whichever node writes; every record has its TTL; and
with Redis away a read is a 503 while a create still answers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from edgecache.fleet.link import RedisLink
from edgecache.fleet.responses import RedisResponseStore
from edgecache.http.response_store import ResponseStore
from tests.conftest import until
from tests.fakes import FakeEngine
from edgecache.bench.redis_servers import RedisServer
from tests.test_fleet import fleet
from tests.test_tenants import auth, write_tenants_file

MODEL = "fake-model"


@asynccontextmanager
async def redis_link(url: str) -> AsyncIterator[RedisLink]:
    """A link to look into the fleet's Redis with: one Redis, or a cluster (the link's own detection)."""
    link = RedisLink(url, timeout_s=5.0)
    await link.start()
    try:
        yield link
    finally:
        await link.close()


def store_of(node: httpx.AsyncClient) -> ResponseStore:
    return node.app.state.front.responses.store  # type: ignore[attr-defined,no-any-return]


async def create(node: httpx.AsyncClient, text: str, headers: dict[str, str] | None = None,
                 **extra: Any) -> dict[str, Any]:
    """One stored response, and until its node has written it to Redis (the client gets the answer first)."""
    made = await node.post("/v1/responses", json={"model": MODEL, "input": text, "temperature": 0, **extra},
                           headers=headers or {})
    assert made.status_code == 200, made.text
    await store_of(node).flushed()
    return made.json()  # type: ignore[no-any-return]


async def test_a_response_created_on_one_node_is_read_continued_and_deleted_on_another(
        make_settings: Any, tmp_path: Path, fleet_redis_url: str) -> None:
    engines = [FakeEngine(), FakeEngine()]
    async with fleet(make_settings, tmp_path, fleet_redis_url, engines) as (a, b):
        assert isinstance(store_of(a), RedisResponseStore) and isinstance(store_of(b), RedisResponseStore)
        made = await create(a, "My name is Ada.", instructions="Be kind.")
        got = await b.get(f"/v1/responses/{made['id']}")
        assert got.status_code == 200 and got.json() == made
        items = (await b.get(f"/v1/responses/{made['id']}/input_items")).json()
        assert [item["content"][0]["text"] for item in items["data"]] == ["My name is Ada."]
        # Continued on B: B's engine gets the conversation A stored, A's answer included.
        follow = await b.post("/v1/responses", json={"model": MODEL, "input": "What is my name?", "temperature": 0,
                                                     "previous_response_id": made["id"]})
        assert follow.status_code == 200, follow.text
        seen = engines[1].requests[-1].messages
        assert [(m.role, m.content) for m in seen] == [
            ("user", "My name is Ada."), ("assistant", "answer to: My name is Ada."), ("user", "What is my name?")]
        await store_of(b).flushed()
        assert (await a.get(f"/v1/responses/{follow.json()['id']}")).json() == follow.json()
        # Deleted on B: gone on both.
        deleted = await b.delete(f"/v1/responses/{made['id']}")
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        for node in (a, b):
            assert (await node.get(f"/v1/responses/{made['id']}")).status_code == 404
        assert (await a.delete(f"/v1/responses/{made['id']}")).status_code == 404
        # The data dirs hold no copy: the fleet's store is Redis alone.
        assert not (tmp_path / "node0" / "responses").exists()


async def test_another_tenants_id_is_a_404_on_every_node(make_settings: Any, tmp_path: Path,
                                                         fleet_redis_url: str) -> None:
    tenants = write_tenants_file(tmp_path / "tenants.toml")
    async with fleet(make_settings, tmp_path, fleet_redis_url, [FakeEngine(), FakeEngine()],
                     tenants_file=str(tenants)) as (a, b):
        made = await create(a, "Mine alone.", headers=auth("t01"))
        path = f"/v1/responses/{made['id']}"
        for node in (a, b):
            assert (await node.get(path, headers=auth("t02"))).status_code == 404
            assert (await node.get(path + "/input_items", headers=auth("t02"))).status_code == 404
            continued = await node.post("/v1/responses", headers=auth("t02"), json={
                "model": MODEL, "input": "And?", "previous_response_id": made["id"]})
            assert continued.status_code == 404 and continued.json()["error"]["param"] == "previous_response_id"
            assert (await node.delete(path, headers=auth("t02"))).status_code == 404
        assert (await b.get(path, headers=auth("t01"))).json() == made  # the other tenant's delete left it
        # In Redis the tenant is in every key of the record and its bookkeeping.
        async with redis_link(fleet_redis_url) as link:
            keys = sorted(await link.scan("ec:{*}:resp:*"))
        assert keys == ["ec:{t01}:resp:age", "ec:{t01}:resp:bytes", f"ec:{{t01}}:resp:r:{made['id']}",
                        "ec:{t01}:resp:sizes"]


async def bookkeeping(redis_url: str, tenant: str) -> tuple[int, int, int]:
    """(records in the age order, the byte counter, the bytes the records really hold) of one tenant."""
    async with redis_link(redis_url) as link:
        client = link.client
        members = await client.zrange(f"ec:{{{tenant}}}:resp:age", 0, -1)
        held = sum([await client.strlen(m) for m in members])
        counter = int(await client.get(f"ec:{{{tenant}}}:resp:bytes") or 0)
    return len(members), counter, held


async def test_the_byte_bound_holds_across_nodes(make_settings: Any, tmp_path: Path, fleet_redis_url: str) -> None:
    bound = 16_384
    async with fleet(make_settings, tmp_path, fleet_redis_url, [FakeEngine(), FakeEngine()],
                     store__responses_bytes=bound) as (a, b):
        ids = []
        for i in range(30):  # both nodes write at once, each pair concurrently
            pair = await asyncio.gather(*(node.post("/v1/responses", json={
                "model": MODEL, "input": f"question {i} {name} " + "x" * 200, "temperature": 0})
                for node, name in ((a, "a"), (b, "b"))))
            ids.extend(resp.json()["id"] for resp in pair)
        await asyncio.gather(store_of(a).flushed(), store_of(b).flushed())
        rows, used = await store_of(a).tenant_usage("default")
        assert (rows, used) == await store_of(b).tenant_usage("default")
        assert 0 < used <= bound and 0 < rows < 60
        # The counter is what the records hold: every eviction took its bytes off, whichever node evicted.
        assert await bookkeeping(fleet_redis_url, "default") == (rows, used, used)
        for node in (a, b):
            assert (await node.get(f"/v1/responses/{ids[0]}")).status_code == 404  # the oldest went first
        for response_id in ids[-rows:]:
            assert (await b.get(f"/v1/responses/{response_id}")).status_code == 200


async def test_each_record_has_the_ttl_and_an_expired_ones_bytes_are_given_back(
        make_settings: Any, tmp_path: Path, fleet_redis_url: str) -> None:
    ttl_s = 300.0
    async with fleet(make_settings, tmp_path, fleet_redis_url, [FakeEngine()], store__responses_ttl_s=ttl_s) as (a,):
        first = await create(a, "Kept five minutes.")
        second = await create(a, "Kept five minutes too.")
        async with redis_link(fleet_redis_url) as link:
            client = link.client
            for key in (f"ec:{{default}}:resp:r:{first['id']}", "ec:{default}:resp:age", "ec:{default}:resp:sizes",
                        "ec:{default}:resp:bytes"):
                assert 0 < await client.pttl(key) <= ttl_s * 1000, key
            size = await client.strlen(f"ec:{{default}}:resp:r:{first['id']}")
            # What Redis does when the TTL runs out (the record's key goes, its bookkeeping stays), done now.
            await client.delete(f"ec:{{default}}:resp:r:{first['id']}")
        assert (await a.get(f"/v1/responses/{first['id']}")).status_code == 404
        before = await bookkeeping(fleet_redis_url, "default")
        assert before[0] == 2 and before[1] == before[2] + size  # counted, no longer held
        await create(a, "A third one.")  # a write drops the expired record's bookkeeping at the oldest end
        rows, counter, held = await bookkeeping(fleet_redis_url, "default")
        assert rows == 2 and counter == held
        assert (await a.get(f"/v1/responses/{second['id']}")).status_code == 200


async def test_with_redis_away_a_read_is_a_503_and_a_create_still_answers(
        make_settings: Any, tmp_path: Path, redis_server: RedisServer, redis_url: str) -> None:
    # The fleet's generous Redis timeout: a kill fails the nodes' commands at once, and a short timeout would fail
    # the write before the kill whenever the box is slow to connect.
    async with fleet(make_settings, tmp_path, redis_url, [FakeEngine(), FakeEngine()]) as (a, b):
        kept = await create(a, "Stored before the outage.")
        redis_server.kill()
        made = await a.post("/v1/responses", json={"model": MODEL, "input": "During the outage.", "temperature": 0})
        assert made.status_code == 200 and made.json()["output"][0]["content"][0]["text"] == \
            "answer to: During the outage."
        await store_of(a).flushed()
        assert store_of(a).dropped == 1  # type: ignore[attr-defined]  # its write failed, and was logged
        for node in (a, b):
            for path in (f"/v1/responses/{kept['id']}", f"/v1/responses/{kept['id']}/input_items"):
                got = await node.get(path)
                assert got.status_code == 503 and got.json()["error"]["type"] == "storage_unavailable", got.text
            assert (await node.delete(f"/v1/responses/{kept['id']}")).status_code == 503
        continued = await b.post("/v1/responses", json={"model": MODEL, "input": "And?", "temperature": 0,
                                                        "previous_response_id": kept["id"]})
        assert continued.status_code == 503 and continued.json()["error"]["type"] == "storage_unavailable"
        redis_server.start()
        # each node reconnects by itself
        await until(lambda: all(n.app.state.runtime.fleet.link.up for n in (a, b)))  # type: ignore[attr-defined]
        # Redis came back empty (no persistence): the outage's response was never kept, and nothing is a 5xx.
        for node in (a, b):
            assert (await node.get(f"/v1/responses/{made.json()['id']}")).status_code == 404


@pytest.fixture
async def two_stores(fleet_redis_url: str) -> Any:
    """Two stores on two links to one Redis, as two nodes hold them, with a small bound."""
    links = [RedisLink(fleet_redis_url, timeout_s=5.0) for _ in range(2)]
    for link in links:
        await link.start()
    try:
        yield [RedisResponseStore(link, tenant_bytes=4_000, ttl_s=600.0) for link in links]
    finally:
        for link in links:
            await link.close()


async def test_concurrent_writers_keep_the_bound_and_the_counter_exact(two_stores: list[RedisResponseStore],
                                                                      fleet_redis_url: str) -> None:
    now = time.time()
    for i in range(200):
        store = two_stores[i % 2]
        store.put("default", f"resp_{i:04d}", bytes([65 + i % 26]) * (50 + i % 150), now + i / 1000, now + 600)
        if i % 7 == 0:
            await asyncio.sleep(0)  # let the writers send part of it while more is put
    await asyncio.gather(*(store.flushed() for store in two_stores))
    rows, counter, held = await bookkeeping(fleet_redis_url, "default")
    assert counter == held and 0 < held <= 4_000
    assert await two_stores[0].tenant_usage("default") == (rows, held)
    assert await two_stores[1].get("default", "resp_0199") == bytes([65 + 199 % 26]) * (50 + 199 % 150)
    assert await two_stores[0].get("default", "resp_0000") is None  # the oldest went first


async def test_a_delete_waits_for_the_write_it_would_overtake(two_stores: list[RedisResponseStore],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    store, other = two_stores
    now = time.time()
    store.put("default", "resp_queued", b"queued", now, now + 600)
    assert await store.get("default", "resp_queued") == b"queued"  # readable before it is written
    assert await store.delete("default", "resp_queued") is True
    # Hold the writer's next round trip at a gate: the record is on its way to Redis when the delete comes, and the
    # delete (on its own connection) could otherwise land first and the write after it.
    link, gate = store._link, asyncio.Event()
    run = link.run

    async def held(command: Any) -> Any:
        monkeypatch.setattr(link, "run", run)  # only the first command (the writer's batch) waits
        await gate.wait()
        return await run(command)

    monkeypatch.setattr(link, "run", held)
    store.put("default", "resp_sending", b"sending", now, now + 600)
    for _ in range(5):
        await asyncio.sleep(0)  # the writer starts and waits at the gate
    assert link.run is run and not gate.is_set()
    deleting = asyncio.create_task(store.delete("default", "resp_sending"))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not deleting.done()  # it waits for the write
    gate.set()
    assert await deleting is True
    await store.flushed()
    for name in ("resp_queued", "resp_sending"):
        assert await other.get("default", name) is None
        assert await store.get("default", name) is None
    assert await other.tenant_usage("default") == (0, 0)
