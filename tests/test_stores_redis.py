"""The Redis result store against a real redis-server: TTL, per-tenant quota with LRU, flush, tenants apart, and
serving on from the memory tier while Redis is away."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest

from edgecache.errors import NotReady
from edgecache.fleet.link import RedisLink
from edgecache.stores import CachedAnswer, ResultStores
from edgecache.stores.disk import DiskResultStore, TenantStores
from edgecache.stores.redis import RedisResultStore, RedisTenantStores
from tests.conftest import until
from edgecache.bench.redis_servers import RedisServer

KiB = 1024


def answer(text: str, ttl_s: float = 60.0) -> CachedAnswer:
    now = time.time()
    return CachedAnswer(text=text, finish_reason="stop", prompt_tokens=3, completion_tokens=2, created_at=now,
                        expires_at=now + ttl_s)


@pytest.fixture
async def link(redis_url: str) -> AsyncIterator[RedisLink]:
    link = RedisLink(redis_url, timeout_s=5.0, check_interval_s=0.05)
    await link.start()
    assert link.up
    yield link
    await link.close()


def stores_on(link: RedisLink, quota: int = 10**6, memory: int = 10**6, version: str = "m@1") -> RedisTenantStores:
    return RedisTenantStores(link, quota_for=lambda tenant: quota, memory_bytes=memory, model_version=lambda: version)


async def test_an_answer_put_by_one_node_is_read_by_another(link: RedisLink) -> None:
    node_a, node_b = stores_on(link), stores_on(link)
    await node_a("t1").put("k1", answer("forty-two"), tag="default")
    assert node_b("t1").get_memory("k1") is None
    got = await node_b("t1").get("k1")
    assert got is not None and got.text == "forty-two"
    assert node_b("t1").get_memory("k1") == got  # now in B's memory tier


async def test_keys_carry_tenant_and_model_version_and_expire(link: RedisLink) -> None:
    store = stores_on(link)("t1")
    await store.put("k1", answer("x", ttl_s=30))
    key = store.entry_key("k1")
    assert "t1" in key and "m@1" in key
    ttl_ms = await link.client.pttl(key)
    assert 0 < ttl_ms <= 30_000
    # Another model version does not see it.
    assert await stores_on(link, version="m@2")("t1").get("k1") is None


@pytest.mark.parametrize("poison", [
    {"created_at": float("-inf")},
    {"expires_at": float("nan")},
    {"choices": ()},
    {"finish_reason": "exploded"},
    {"completion_tokens": -1},
])
async def test_a_poisoned_entry_is_dropped_counted_and_a_miss(link: RedisLink, poison: dict[str, Any]) -> None:
    """What another writer of the shared Redis may leave under a key: never served, never a 500, never kept."""
    node_a, node_b = stores_on(link), stores_on(link)
    await node_a("t1").put("k1", answer("fine"))
    store = node_b("t1")
    bad = msgspec.structs.replace(answer("poison"), **poison)  # what another writer left in its place
    await link.client.set(store.entry_key("k1"), msgspec.msgpack.encode(bad), keepttl=True)
    assert await store.get("k1") is None
    assert await link.client.exists(store.entry_key("k1")) == 0
    assert (await store.stats())["dropped_unreadable"] == 1
    assert not await node_b("t1").put("k2", bad)  # and this node never writes such an entry itself
    await node_b("t1").put("k1", answer("good"))
    got = await stores_on(link)("t1").get("k1")
    assert got is not None and got.text == "good"


async def test_a_poisoned_entry_on_disk_is_dropped_too(tmp_path: Any) -> None:
    stores = TenantStores(tmp_path, quota_for=lambda tenant: 10**6, memory_bytes=10**6)
    store = stores("t1")
    await store.put("k1", msgspec.structs.replace(answer("poison"), choices=()))
    store.forget_memory()
    assert await store.get("k1") is None
    assert (await store.stats())["dropped_unreadable"] == 1
    stores.close()


async def test_tenants_stay_apart(link: RedisLink) -> None:
    stores = stores_on(link)
    await stores("alice").put("same-key", answer("alice's"))
    assert await stores_on(link)("bob").get("same-key") is None
    await stores("bob").put("same-key", answer("bob's"))
    assert (await stores_on(link)("alice").get("same-key")).text == "alice's"  # type: ignore[union-attr]
    await stores("bob").clear()
    assert (await stores_on(link)("alice").get("same-key")).text == "alice's"  # type: ignore[union-attr]


async def test_quota_evicts_the_tenants_least_recently_used_only(link: RedisLink) -> None:
    big = "x" * 2000
    tight = stores_on(link, quota=9 * KiB, memory=0)
    roomy = stores_on(link, memory=0)
    await roomy("other").put("o", answer(big))
    for i in range(4):
        await tight("t1").put(f"k{i}", answer(big))
    await tight("t1").get("k0")  # k0 is now the most recently used
    await tight("t1").put("k4", answer(big))  # over 9 KiB: the least recently used (k1) goes
    present = {k for k in ("k0", "k1", "k2", "k3", "k4") if await tight("t1").get(k) is not None}
    assert present == {"k0", "k2", "k3", "k4"}
    stats = await tight("t1").stats()
    assert stats["entries"] == 4 and stats["bytes"] <= 9 * KiB
    assert await roomy("other").get("o") is not None  # another tenant's entries are never evicted for t1


async def test_scenario_flush_drops_only_its_entries_and_the_memory_copy(link: RedisLink) -> None:
    node_a, node_b = stores_on(link), stores_on(link)
    await node_a("t1").put("faq", answer("faq answer"), tag="faq")
    await node_a("t1").put("chat", answer("chat answer"), tag="default")
    assert await node_b("t1").get("faq") is not None
    assert await node_a("t1").clear(tag="faq") == 1
    assert node_a("t1").get_memory("faq") is None
    assert await stores_on(link)("t1").get("faq") is None
    assert await stores_on(link)("t1").get("chat") is not None
    assert (await node_a("t1").stats())["entries"] == 1
    assert await node_a("t1").clear() == 1
    assert (await node_a("t1").stats())["bytes"] == 0
    assert await stores_on(link).known_tenants() == []


async def test_expired_entries_leave_no_bookkeeping_behind(link: RedisLink) -> None:
    store = stores_on(link, memory=0)("t1")
    await store.put("short", answer("soon gone", ttl_s=0.05))
    await store.put("long", answer("stays"))
    time.sleep(0.1)
    assert await store.get("short") is None
    stats = await store.stats()  # prunes what Redis expired
    assert stats["entries"] == 1


async def test_redis_down_serves_from_memory_and_never_raises_on_the_request_path(
        redis_server: RedisServer, redis_url: str) -> None:
    # A generous timeout: a kill fails commands at once, and a short one would mark Redis down before the kill (a
    # second disconnect) whenever the box is slow to connect.
    link = RedisLink(redis_url, timeout_s=5.0, check_interval_s=0.05)
    await link.start()
    try:
        store = stores_on(link)("t1")
        await store.put("hot", answer("in memory"))
        redis_server.kill()
        assert (await store.get("hot")).text == "in memory"  # type: ignore[union-attr]
        assert await store.get("cold") is None          # a miss, not an error: the engine will answer it
        assert texts(await store.get_many(["cold", "hot"])) == [None, "in memory"]  # a warmup's look, too
        await store.put("new", answer("kept here"))      # no error; kept in the memory tier
        assert not link.up and link.error
        assert (await store.get("new")).text == "kept here"  # type: ignore[union-attr]
        with pytest.raises(NotReady):
            await store.clear()
        redis_server.start()
        await until(lambda: link.up)
        assert link.disconnects == 1
        await store.put("after", answer("shared again"))
        assert (await stores_on(link)("t1").get("after")).text == "shared again"  # type: ignore[union-attr]
    finally:
        await link.close()


@pytest.mark.parametrize("backend", ["disk", "redis"])
async def test_both_backends_answer_the_one_store_protocol(backend: str, link: RedisLink, tmp_path: Any) -> None:
    # What the runtime calls on either backend, typed as the protocol (so a backend lacking a method fails here).
    def open_node() -> ResultStores:
        if backend == "disk":
            return TenantStores(tmp_path / "results", quota_for=lambda tenant: 10**6, memory_bytes=10**6)
        return stores_on(link)

    node = open_node()
    try:
        store = node("t1")
        await store.put("k", answer("kept"), tag="default")
        assert store.get_memory("k") is not None
        store.forget_memory()
        assert store.get_memory("k") is None  # the memory copy went
        assert (await store.get("k")).text == "kept"  # type: ignore[union-attr]  # the backend's did not
        assert list(node.opened()) == ["t1"] and node.existing_tenants() == ["t1"]
        other = open_node()
        assert await other.known_tenants() == ["t1"]  # found in the backend (its directory, or Redis) unopened
        other.close()
        assert (await store.stats())["memory_entries"] == 1
        # One answer dropped (a caller marked a semantic hit's copy wrong): memory, backend and its bookkeeping.
        await store.put("gone", answer("dropped"), tag="default")
        assert await store.delete("gone") is True
        assert store.get_memory("gone") is None and await store.get("gone") is None
        assert await store.delete("gone") is False
        stats = await store.stats()
        assert stats["entries"] == 1 and stats["memory_entries"] == 1 and (await store.get("k")).text == "kept"  # type: ignore[union-attr]
    finally:
        node.close()


@pytest.fixture(params=["disk", "redis", "redis-cluster"])
async def open_node(request: pytest.FixtureRequest, tmp_path: Any) -> AsyncIterator[Callable[[], ResultStores]]:
    """Opens one node's stores on one backend: disk, one Redis, or a Redis Cluster (emptied for the test)."""
    if request.param == "disk":
        yield lambda: TenantStores(tmp_path / "results", quota_for=lambda tenant: 10**6, memory_bytes=10**6)
        return
    url = str(request.getfixturevalue("redis_url")) if request.param == "redis" else \
        request.getfixturevalue("redis_cluster").url
    if request.param == "redis-cluster":
        request.getfixturevalue("redis_cluster").flushall()
    link = RedisLink(url, timeout_s=5.0, check_interval_s=0.05)
    await link.start()
    assert link.up
    yield lambda: stores_on(link)
    await link.close()


def texts(answers: list[CachedAnswer | None]) -> list[str | None]:
    return [None if a is None else a.text for a in answers]


async def test_get_many_reads_what_get_reads_in_the_order_asked_and_fills_no_memory_copy(
        open_node: Callable[[], ResultStores]) -> None:
    node = open_node()
    try:
        store, other = node("t1"), node("t2")
        assert isinstance(store, (DiskResultStore, RedisResultStore))
        store.READ_BATCH = 2  # the keys below span several of the backend's batches
        await store.put("a", answer("A"), tag="default")
        await store.put("b", answer("B"))
        await store.put("soon", answer("gone soon", ttl_s=0.05))
        await other.put("c", answer("theirs"))
        store.forget_memory()
        time.sleep(0.1)
        got = await store.get_many(["a", "missing", "b", "soon", "c", "a"])
        assert texts(got) == ["A", None, "B", None, None, "A"]
        assert store.get_memory("a") is None and (await store.stats())["memory_entries"] == 0  # not filled
        assert texts(await other.get_many(["a", "b", "c"])) == [None, None, "theirs"]  # tenants apart
        assert await store.get_many([]) == []
        # A copy in the memory tier answers without the backend: one written by this node since.
        await store.put("new", answer("in memory"))
        assert store.get_memory("new") is not None
        assert texts(await store.get_many(["new", "a"])) == ["in memory", "A"]
    finally:
        node.close()


async def test_get_many_drops_and_counts_an_unreadable_entry(open_node: Callable[[], ResultStores]) -> None:
    node = open_node()
    try:
        store = node("t1")
        await store.put("good", answer("fine"))
        bad = msgspec.structs.replace(answer("poison"), finish_reason="exploded")
        if isinstance(store, DiskResultStore):
            await store.put("bad", bad)  # the disk store writes what it is given
        else:
            assert isinstance(store, RedisResultStore)
            await store.put("bad", answer("fine for now"))
            await store._link.client.set(store.entry_key("bad"), msgspec.msgpack.encode(bad), keepttl=True)
        store.forget_memory()
        assert texts(await store.get_many(["bad", "good"])) == [None, "fine"]
        assert (await store.stats())["dropped_unreadable"] == 1
        assert await store.get("bad") is None and (await store.stats())["dropped_unreadable"] == 1  # it went
    finally:
        node.close()


@pytest.mark.parametrize("cluster", [False, True])
async def test_get_many_moves_what_it_reads_up_the_tenants_lru(cluster: bool, request: pytest.FixtureRequest) -> None:
    # As get does: a warmup run again over the tenant's answers keeps them, and the quota evicts the others first.
    if cluster:
        request.getfixturevalue("redis_cluster").flushall()
    url = request.getfixturevalue("redis_cluster").url if cluster else request.getfixturevalue("redis_url")
    link = RedisLink(url, timeout_s=5.0, check_interval_s=0.05)
    await link.start()
    try:
        tight = stores_on(link, quota=9 * KiB, memory=0)("t1")
        big = "x" * 2000
        for i in range(4):
            await tight.put(f"k{i}", answer(big))
        assert texts(await tight.get_many(["k0", "k1"])) == [big, big]  # k0 and k1 now the most recently used
        await tight.put("k4", answer(big))  # over 9 KiB: the least recently used (k2) goes
        assert [a is not None for a in await tight.get_many([f"k{i}" for i in range(5)])] == \
            [True, True, False, True, True]
    finally:
        await link.close()


def test_a_single_box_never_imports_redis(tmp_path: Any) -> None:
    # The disk backend is the default; building and serving its app must not even import the redis client.
    code = (
        "import sys, asyncio\n"
        "from edgecache.http.app import create_app\n"
        "from edgecache.settings import resolve_settings\n"
        "from tests.fakes import FakeEngine\n"
        "from tests.conftest import serve_in_process, chat_body\n"
        f"s = resolve_settings('cpu', {{'data_dir': {str(tmp_path)!r}, 'semantic.enabled': False}}, environ={{}})\n"
        "async def main():\n"
        "    async with serve_in_process(create_app(s, engine=FakeEngine())) as c:\n"
        "        assert (await c.post('/v1/chat/completions', json=chat_body('hi'))).status_code == 200\n"
        "asyncio.run(main())\n"
        "assert not any(m == 'redis' or m.startswith('redis.') for m in sys.modules), 'redis was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
