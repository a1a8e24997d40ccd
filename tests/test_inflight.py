"""In-flight de-duplication: flights driven by scripted producers, followed by several listeners."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

import pytest

from edgecache.engines.base import Chunk
from edgecache.errors import BadRequest, EdgeCacheError, EngineError
from edgecache.inflight.local import Flight, InflightTable


class Script:
    """A producer the test steps by hand: each ``step()`` lets it publish one more chunk."""

    def __init__(self, pieces: list[str], *, finish: bool = True) -> None:
        self.pieces = pieces
        self.finish = finish
        self.go = asyncio.Semaphore(0)
        self.published = 0
        self.cancelled = False
        self.returned = False
        self.store_gate = asyncio.Event()  # held closed: the "store write" after finish() waits on it
        self.store_gate.set()

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.go.release()

    async def __call__(self, flight: Flight) -> None:
        try:
            for piece in self.pieces:
                await self.go.acquire()
                flight.publish(Chunk(text=piece))
                self.published += 1
            await self.go.acquire()
            flight.publish(Chunk(finish_reason="stop", prompt_tokens=1, completion_tokens=len(self.pieces)))
            if self.finish:
                flight.finish()
            await self.store_gate.wait()
            self.returned = True
        except asyncio.CancelledError:
            self.cancelled = True
            raise


async def collect(stream: AsyncIterator[Chunk]) -> list[Chunk]:
    async with aclosing(stream) as s:
        return [c async for c in s]


async def settle(times: int = 10) -> None:
    for _ in range(times):
        await asyncio.sleep(0)


def texts(chunks: list[Chunk]) -> list[str]:
    return [c.text for c in chunks]


PIECES = ["Hel", "lo ", "wor", "ld"]


async def test_leader_and_followers_receive_identical_chunk_sequences() -> None:
    table = InflightTable()
    script = Script(PIECES)
    flight = table.lead("k", script)
    listeners = [asyncio.create_task(collect(flight.follow())) for _ in range(3)]
    await settle()
    assert table.get("k") is flight
    script.step(len(PIECES) + 1)
    results = await asyncio.gather(*listeners)
    assert texts(results[0]) == PIECES + [""]
    assert results[0][-1].finish_reason == "stop"
    assert results[1] == results[0] and results[2] == results[0]
    await flight.task
    assert len(table) == 0


async def test_a_late_follower_gets_earlier_chunks_then_the_rest_live() -> None:
    table = InflightTable()
    script = Script(PIECES)
    flight = table.lead("k", script)
    leader = asyncio.create_task(collect(flight.follow()))
    script.step(2)
    await settle()
    assert script.published == 2

    late = flight.follow()
    first_two = [await late.__anext__(), await late.__anext__()]  # already produced: no waiting
    assert texts(first_two) == PIECES[:2]
    pending = asyncio.create_task(late.__anext__())
    await settle()
    assert not pending.done()  # the third chunk does not exist yet: the follower waits live
    script.step()
    assert (await pending).text == PIECES[2]
    script.step(2)
    rest = await collect(late)
    assert texts(first_two) + [PIECES[2]] + texts(rest) == PIECES + [""]
    assert texts(await leader) == PIECES + [""]


async def test_a_follower_that_leaves_early_does_not_cancel_the_flight() -> None:
    table = InflightTable()
    script = Script(PIECES)
    flight = table.lead("k", script)
    stays = asyncio.create_task(collect(flight.follow()))
    leaves = flight.follow()
    script.step()
    assert (await leaves.__anext__()).text == PIECES[0]
    await leaves.aclose()
    await settle()
    assert flight.listeners == 1
    assert not flight.task.cancelling()
    script.step(len(PIECES))
    assert texts(await stays) == PIECES + [""]
    await flight.task
    assert not script.cancelled and script.returned


async def test_the_leader_leaving_early_does_not_cancel_the_flight_for_followers() -> None:
    table = InflightTable()
    script = Script(PIECES)
    flight = table.lead("k", script)
    leader = flight.follow()
    script.step()
    assert (await leader.__anext__()).text == PIECES[0]
    follower = asyncio.create_task(collect(table.get("k").follow()))
    await settle()
    await leader.aclose()
    script.step(len(PIECES))
    assert texts(await follower) == PIECES + [""]
    assert not script.cancelled


async def test_the_last_listener_leaving_cancels_the_flight() -> None:
    table = InflightTable()
    script = Script(PIECES)
    flight = table.lead("k", script)
    a, b = flight.follow(), flight.follow()
    script.step()
    assert (await a.__anext__()).text == PIECES[0]
    assert (await b.__anext__()).text == PIECES[0]
    await a.aclose()
    await settle()
    assert not flight.task.cancelling()  # b still listens
    await b.aclose()
    # A request arriving now must not join the dying flight.
    assert table.get("k") is None
    await asyncio.wait([flight.task])
    assert script.cancelled and not script.returned
    assert flight.done and isinstance(flight.error, EngineError)
    assert len(table) == 0


async def test_a_listener_cancelled_while_waiting_releases_the_flight() -> None:
    table = InflightTable()
    script = Script(PIECES)
    flight = table.lead("k", script)
    listener = asyncio.create_task(collect(flight.follow()))
    await settle()
    assert flight.listeners == 1
    listener.cancel()  # e.g. the client disconnected and the server cancelled its handler
    with pytest.raises(asyncio.CancelledError):
        await listener
    await asyncio.wait([flight.task])
    assert script.cancelled
    assert len(table) == 0


async def test_a_new_request_after_cancellation_leads_a_new_flight() -> None:
    table = InflightTable()
    first = table.lead("k", Script(PIECES))
    stream = first.follow()
    pending = asyncio.create_task(stream.__anext__())
    await settle()
    pending.cancel()
    await asyncio.wait([pending, first.task])
    assert table.get("k") is None
    script = Script(PIECES)
    second = table.lead("k", script)
    assert second is not first and table.get("k") is second
    script.step(len(PIECES) + 1)
    assert texts(await collect(second.follow())) == PIECES + [""]
    await second.task
    assert len(table) == 0


async def test_a_flight_led_while_the_old_one_is_still_cancelling_keeps_its_table_entry() -> None:
    table = InflightTable()
    first = Script(PIECES)
    old = table.lead("k", first)
    stream = old.follow()
    first.step()
    assert (await stream.__anext__()).text == PIECES[0]
    await stream.aclose()
    assert not old.task.done() and old.task.cancelling()  # cancel requested, not yet delivered
    assert table.get("k") is None
    script = Script(PIECES)
    new = table.lead("k", script)
    await asyncio.wait([old.task])
    # The old flight's cleanup must not remove its successor.
    assert table.get("k") is new
    script.step(len(PIECES) + 1)
    assert texts(await collect(new.follow())) == PIECES + [""]
    await new.task
    assert len(table) == 0


async def test_an_edgecache_error_reaches_every_listener() -> None:
    table = InflightTable()
    failure = BadRequest("the prompt is too long for the context window")

    async def produce(flight: Flight) -> None:
        flight.publish(Chunk(text="par"))
        await asyncio.sleep(0)
        raise failure

    flight = table.lead("k", produce)
    listeners = [asyncio.create_task(collect(flight.follow())) for _ in range(3)]
    results = await asyncio.gather(*listeners, return_exceptions=True)
    assert all(r is failure for r in results), results
    assert len(table) == 0


async def test_an_unexpected_exception_becomes_an_engine_error_for_every_listener() -> None:
    table = InflightTable()
    gate = asyncio.Event()

    async def produce(flight: Flight) -> None:
        flight.publish(Chunk(text="par"))
        await gate.wait()
        raise ZeroDivisionError("a bug in the producer")

    flight = table.lead("k", produce)
    listeners = [asyncio.create_task(collect(flight.follow())) for _ in range(3)]
    await settle()
    gate.set()
    results = await asyncio.wait_for(asyncio.gather(*listeners, return_exceptions=True), timeout=5)
    for r in results:
        assert isinstance(r, EngineError) and isinstance(r, EdgeCacheError)
        assert "ZeroDivisionError" in r.message
    assert len(table) == 0


async def test_a_producer_that_returns_without_finishing_fails_its_listeners() -> None:
    table = InflightTable()
    script = Script(PIECES, finish=False)
    flight = table.lead("k", script)
    listener = asyncio.create_task(collect(flight.follow()))
    script.step(len(PIECES) + 1)
    with pytest.raises(EngineError):
        await asyncio.wait_for(listener, timeout=5)


async def test_the_flight_stays_joinable_until_the_producer_returns_after_finish() -> None:
    table = InflightTable()
    script = Script(PIECES)
    script.store_gate.clear()  # the "store write" after finish() blocks
    flight = table.lead("k", script)
    first = asyncio.create_task(collect(flight.follow()))
    script.step(len(PIECES) + 1)
    assert texts(await first) == PIECES + [""]
    assert flight.done

    # The store window: the answer is complete but not yet stored, so a new request must still share it.
    joined = table.get("k")
    assert joined is flight
    assert texts(await collect(joined.follow())) == PIECES + [""]
    # Its listener leaving now must not cancel the store write.
    assert not flight.task.cancelling()

    script.store_gate.set()
    await flight.task
    assert script.returned and not script.cancelled
    assert table.get("k") is None and len(table) == 0


async def test_flights_for_different_keys_are_independent() -> None:
    table = InflightTable()
    a, b = Script(["a"]), Script(["b"])
    fa, fb = table.lead("ka", a), table.lead("kb", b)
    assert len(table) == 2 and table.get("ka") is fa and table.get("kb") is fb
    a.step(2)
    b.step(2)
    assert texts(await collect(fa.follow())) == ["a", ""]
    assert texts(await collect(fb.follow())) == ["b", ""]
    await asyncio.gather(fa.task, fb.task)
    assert len(table) == 0


async def test_drain_lets_running_flights_finish() -> None:
    table = InflightTable()
    script = Script(PIECES)
    flight = table.lead("k", script)
    listener = asyncio.create_task(collect(flight.follow()))
    await settle()
    drain = asyncio.create_task(table.drain(timeout_s=10))
    await settle()
    assert not drain.done()
    script.step(len(PIECES) + 1)
    await drain
    assert script.returned and not script.cancelled
    assert texts(await listener) == PIECES + [""]
    assert len(table) == 0


async def test_drain_cancels_flights_that_outlast_the_grace_period() -> None:
    table = InflightTable()
    stuck = Script(PIECES)  # never stepped
    flight = table.lead("k", stuck)
    listener = asyncio.create_task(collect(flight.follow()))
    await table.drain(timeout_s=0.05)
    assert stuck.cancelled and flight.task.done()
    with pytest.raises(EngineError):
        await listener
    assert len(table) == 0


async def test_drain_with_nothing_in_flight_returns() -> None:
    await InflightTable().drain(timeout_s=0.01)


async def test_the_last_listener_leaving_after_the_final_chunk_does_not_cancel_the_store() -> None:
    """A streaming client closes on the last frame, before the producer has stored the answer: that must not
    abort the producer (regression: every streaming miss was lost this way)."""
    table = InflightTable()
    stored = asyncio.Event()
    release = asyncio.Event()

    async def produce(flight: Flight) -> None:
        flight.publish(Chunk(text="whole answer"))
        flight.publish(Chunk(finish_reason="stop"))
        await release.wait()  # the engine winding down, then the store write
        flight.finish()
        stored.set()

    flight = table.lead("k", produce)
    async with aclosing(flight.follow()) as chunks:
        async for chunk in chunks:
            if chunk.finish_reason is not None:
                break
    await asyncio.sleep(0)
    assert flight.task is not None and not flight.task.cancelling()
    release.set()
    await asyncio.wait_for(stored.wait(), 5)


async def test_a_batching_listener_gets_the_chunks_published_meanwhile_merged() -> None:
    """With batch_s, what was published since the last delivery comes as one chunk; the final chunk stays whole."""
    table = InflightTable()
    script = Script(PIECES)
    flight = table.lead("k", script)
    script.step(3)
    await settle()
    assert script.published == 3
    listener = flight.follow(batch_s=3600)
    first = await listener.__anext__()
    assert first.text == "".join(PIECES[:3])  # three published before it looked: one delivery
    script.step(2)  # the last piece and the final chunk: the answer is complete, so no waiting for the batch
    rest = await collect(listener)
    assert texts(rest) == [PIECES[3], ""]
    assert rest[-1].finish_reason == "stop" and rest[-1].completion_tokens == len(PIECES)
    await flight.task


async def test_a_batching_listener_waits_out_its_batch_before_the_next_delivery() -> None:
    table = InflightTable()
    script = Script(PIECES)
    flight = table.lead("k", script)
    listener = flight.follow(batch_s=3600)
    pending = asyncio.create_task(listener.__anext__())
    await settle()
    script.step()
    assert (await pending).text == PIECES[0]  # the first chunk goes at once
    pending = asyncio.create_task(listener.__anext__())
    script.step(2)
    await settle()
    assert not pending.done()  # within the batch: held back
    script.step(2)  # the answer completes: everything goes
    assert (await pending).text == "".join(PIECES[1:])
    assert (await listener.__anext__()).finish_reason == "stop"
    await listener.aclose()
    await flight.task
