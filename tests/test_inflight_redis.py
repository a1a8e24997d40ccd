"""Flights across nodes through a real Redis: two or three flight tables (one per "node") on one redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import msgspec
import pytest

from edgecache.engines.base import Chunk
from edgecache.errors import EdgeCacheError, EngineError
from edgecache.fleet.link import RedisLink
from edgecache.inflight.local import Flight
from edgecache.inflight.redis import RedisFlightTable
from edgecache.bench.redis_servers import RedisServer

PIECES = ["The ", "answer ", "is ", "42."]


class Producer:
    """A scripted engine call: publishes PIECES, waiting on ``step`` before each when given; counts calls."""

    def __init__(self, *, fail_at: int | None = None) -> None:
        self.calls = 0
        self.fail_at = fail_at
        self.step: asyncio.Queue[None] | None = None

    async def __call__(self, flight: Flight) -> None:
        self.calls += 1
        for n, piece in enumerate(PIECES):
            if self.step is not None:
                await self.step.get()
            if self.fail_at is not None and n == self.fail_at:
                raise EngineError("the engine broke mid-stream")
            flight.publish(Chunk(text=piece))
        flight.publish(Chunk(finish_reason="stop", prompt_tokens=3, completion_tokens=4))
        flight.finish()


async def collect(flight: Flight) -> list[str]:
    async with aclosing(flight.follow()) as chunks:
        return [chunk.text async for chunk in chunks]


@pytest.fixture
async def links(redis_url: str) -> AsyncIterator[list[RedisLink]]:
    made = [RedisLink(redis_url, timeout_s=5.0, check_interval_s=0.05) for _ in range(3)]
    for link in made:
        await link.start()
    yield made
    for link in made:
        await link.close()


def tables(links: list[RedisLink], lease_s: float = 2.0) -> list[RedisFlightTable]:
    return [RedisFlightTable(link, node_id=f"node{i}", epoch=lambda: 0, lease_s=lease_s)
            for i, link in enumerate(links)]


async def test_one_node_computes_and_the_others_follow_from_the_start(links: list[RedisLink]) -> None:
    a, b, c = tables(links)
    producer = Producer()
    producer.step = asyncio.Queue()
    lead = a.lead("k", producer)
    leader_text = asyncio.create_task(collect(lead))
    producer.step.put_nowait(None)
    producer.step.put_nowait(None)
    follower_b = b.lead("k", producer)  # joins after two chunks: it still gets them all
    text_b = asyncio.create_task(collect(follower_b))
    for _ in range(len(PIECES) - 2):
        producer.step.put_nowait(None)
    follower_c = c.lead("k", producer)
    assert "".join(await collect(follower_c)) == "The answer is 42."
    assert "".join(await text_b) == "".join(await leader_text) == "The answer is 42."
    assert producer.calls == 1
    assert (a.led, b.followed, c.followed) == (1, 1, 1)


async def test_a_request_just_after_the_end_reads_the_finished_answer(links: list[RedisLink]) -> None:
    a, b, _ = tables(links)
    producer = Producer()
    assert "".join(await collect(a.lead("k", producer))) == "The answer is 42."
    assert "".join(await collect(b.lead("k", producer))) == "The answer is 42."
    assert producer.calls == 1


async def test_the_leaders_error_reaches_every_follower(links: list[RedisLink]) -> None:
    a, b, c = tables(links)
    producer = Producer(fail_at=2)
    producer.step = asyncio.Queue()
    lead = a.lead("k", producer)
    leader_task = asyncio.create_task(collect(lead))
    producer.step.put_nowait(None)
    followers = [asyncio.create_task(collect(t.lead("k", producer))) for t in (b, c)]
    await asyncio.sleep(0)  # (the followers take their place; the outcome below does not depend on it)
    for _ in range(3):
        producer.step.put_nowait(None)
    for task in (leader_task, *followers):
        with pytest.raises(EdgeCacheError, match="broke mid-stream"):
            await task
    assert producer.calls == 1


async def test_a_dead_leaders_followers_get_an_error_and_the_next_request_computes(links: list[RedisLink]) -> None:
    a, b, _ = tables(links, lease_s=0.3)
    # A "leader" that took the lease and wrote one chunk, then died: nobody renews the lease.
    await links[0].client.set("ec:f:0:{k}", "dead-node:1", px=300)
    await links[0].client.xadd("ec:f:0:{k}:dead-node:1", {"c": msgspec.msgpack.encode(Chunk(text="The "))})
    producer = Producer()
    with pytest.raises(EngineError, match="stopped before finishing"):
        await collect(b.lead("k", producer))
    assert producer.calls == 0
    assert "".join(await collect(a.lead("k", producer))) == "The answer is 42."
    assert producer.calls == 1


async def test_with_redis_away_each_node_computes_alone(redis_server: RedisServer, redis_url: str) -> None:
    link = RedisLink(redis_url, timeout_s=5.0, check_interval_s=0.05)  # a kill fails commands at once
    await link.start()
    try:
        (table,) = tables([link])
        redis_server.kill()
        producer = Producer()
        assert "".join(await collect(table.lead("k", producer))) == "The answer is 42."  # marks the link down
        assert "".join(await collect(table.lead("k2", producer))) == "The answer is 42."
        assert producer.calls == 2 and not link.up
    finally:
        redis_server.start()
        await link.close()
