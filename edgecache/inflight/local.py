"""In-flight de-duplication: identical concurrent requests share one engine call (single-flight on the key).

Layer 2 of the request path. The first request for a key leads: it starts a :class:`Flight`, a task that owns the
engine call and records every chunk it produces. Requests for the same key that arrive while the flight is in the
table follow it: each follower replays the chunks already produced, then receives the rest live, so a streaming
follower sees the same tokens as the leader and a late joiner misses nothing.

The flight belongs to no client. A follower (or the leader's client) that disconnects only stops listening; the
engine call is aborted when the last listener leaves before the answer is complete, so an answer nobody waits for
costs nothing more and, being partial, is never stored. An engine error reaches every listener.

A flight stays in the table after its answer is complete until the producer has written it to the result store
(the window in which the store does not yet have it), so a request arriving in that gap shares it too. The producer
calls ``finish()`` only after those writes: a listener that waits for the end (a non-streaming reply) returns once
the answer is in every layer, so its client's next request finds it there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from edgecache.engines.base import Chunk
from edgecache.errors import EdgeCacheError, EngineError

log = logging.getLogger(__name__)


class Flight:
    """One engine call and the chunks it has produced so far."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.chunks: list[Chunk] = []
        self.done = False
        self.answered = False  # the final chunk (the one with a finish reason) has been published
        self.error: EdgeCacheError | None = None
        self.listeners = 0
        self.task: asyncio.Task[None] | None = None
        self._waiters: list[asyncio.Future[None]] = []  # listeners waiting for the next chunk or the end
        self._batch_waiters: list[asyncio.Future[None]] = []  # listeners holding a batch: woken by the end only

    def publish(self, chunk: Chunk) -> None:
        self.chunks.append(chunk)
        if chunk.finish_reason is not None:
            self.answered = True
            self._wake(self._batch_waiters)
        self._wake(self._waiters)

    def finish(self, error: EdgeCacheError | None = None) -> None:
        if self.done:
            return
        self.done = True
        self.error = error
        self._wake(self._batch_waiters)
        self._wake(self._waiters)

    @staticmethod
    def _wake(waiters: list[asyncio.Future[None]]) -> None:
        # A future per waiting listener, made only when one waits: a chunk nobody waits for costs a look at a list.
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        waiters.clear()

    async def follow(self, batch_s: float = 0.0) -> AsyncIterator[Chunk]:
        """Every chunk of the flight from the first, live. Raises the flight's error if it fails.

        With ``batch_s``, the listener takes at most one delivery per ``batch_s``, and the text chunks published
        since its last delivery come merged into one (the final chunk follows as it is). The first chunk, and
        the rest once the answer is complete, go at once. A client then gets the same text in fewer frames when
        an engine produces tokens faster than every ``batch_s``, and each listener's work (its wake-up, its
        frame, its write) is paid per delivery instead of per token.

        Use inside ``contextlib.aclosing`` so that leaving early releases the listener at once.
        """
        self.listeners += 1
        loop = asyncio.get_running_loop()
        try:
            sent = 0
            ready_at = 0.0  # batch_s after the last delivery
            while True:
                if sent < len(self.chunks):
                    if not batch_s:
                        chunk = self.chunks[sent]
                        sent += 1
                        yield chunk
                        continue
                    if not (self.answered or self.done) and (wait := ready_at - loop.time()) > 0:
                        # More may come meanwhile; the answer completing ends the wait.
                        held = loop.create_future()
                        self._batch_waiters.append(held)
                        timer = loop.call_later(wait, _resolve, held)
                        try:
                            await held
                        finally:
                            timer.cancel()
                            if held in self._batch_waiters:  # the timer ended it: the end did not clear it
                                self._batch_waiters.remove(held)
                    chunks = self.chunks[sent:]
                    sent += len(chunks)
                    ready_at = loop.time() + batch_s
                    for chunk in _merged(chunks):
                        yield chunk
                    continue
                if self.done:
                    if self.error is not None:
                        raise self.error
                    return
                waiter = loop.create_future()
                self._waiters.append(waiter)
                await waiter
        finally:
            self.listeners -= 1
            if self.listeners == 0 and not self.answered and not self.done and self.task is not None:
                # Nobody is listening to an unfinished answer: abort the engine call. The partial answer is
                # never stored because the producer only stores after the engine's final chunk. Once the final
                # chunk is out the answer is whole: a listener that leaves then (every streaming client does, on
                # the last frame) must not cancel the producer while it winds the engine down and stores it.
                self.task.cancel()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _merged(chunks: list[Chunk]) -> list[Chunk]:
    """Consecutive text chunks as one (their texts and token ends joined, the counts of the last); a chunk that
    finishes the answer stays as it is."""
    if len(chunks) == 1:
        return chunks
    out: list[Chunk] = []
    texts: list[Chunk] = []
    for chunk in chunks:
        if chunk.finish_reason is None and chunk.choices is None:
            texts.append(chunk)
            continue
        if texts:
            out.append(_joined(texts))
            texts = []
        out.append(chunk)
    if texts:
        out.append(_joined(texts))
    return out


def _joined(texts: list[Chunk]) -> Chunk:
    if len(texts) == 1:
        return texts[0]
    ends = [end for chunk in texts for end in chunk.token_ends or ()]
    last = texts[-1]
    return Chunk(text="".join(chunk.text for chunk in texts), token_ends=tuple(ends) if ends else None,
                 prompt_tokens=last.prompt_tokens, cached_tokens=last.cached_tokens)


Producer = Callable[[Flight], Awaitable[None]]


class InflightTable:
    """Flights by request key. Event-loop only: the check-then-lead step has no await, so it is atomic."""

    def __init__(self) -> None:
        self._flights: dict[str, Flight] = {}

    def __len__(self) -> int:
        return len(self._flights)

    def get(self, key: str) -> Flight | None:
        flight = self._flights.get(key)
        if flight is None or (flight.task is not None and flight.task.cancelling()):
            return None
        return flight

    def lead(self, key: str, produce: Producer) -> Flight:
        """Start a flight for ``key``; ``produce`` publishes its chunks, persists the answer, then calls ``finish()``."""
        flight = Flight(key)
        self._flights[key] = flight
        flight.task = asyncio.create_task(self._run(flight, produce), name=f"flight-{key[:8]}")
        return flight

    async def _run(self, flight: Flight, produce: Producer) -> None:
        try:
            await produce(flight)
            if not flight.done:
                flight.finish(EngineError("the engine stopped without finishing its answer"))
        except asyncio.CancelledError:
            flight.finish(EngineError("the generation was aborted"))
        except EdgeCacheError as exc:
            flight.finish(exc)
        except Exception as exc:  # the task boundary: followers must get an error, not hang forever
            log.exception("flight %s failed", flight.key[:8])
            flight.finish(EngineError(f"internal error while generating: {type(exc).__name__}"))
        finally:
            if self._flights.get(flight.key) is flight:
                del self._flights[flight.key]

    async def drain(self, timeout_s: float) -> None:
        """Wait for running flights to finish (shutdown step: let answers complete), then cancel the rest."""
        tasks = [f.task for f in self._flights.values() if f.task is not None]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
