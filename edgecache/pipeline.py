"""The request path, top to bottom, as DESIGN.md draws it.

::

    key: canonical hash of (model version, tenant, scenario, messages, output-affecting params)
    ├─ 1. exact result store       hit -> replay the stored answer                         X-EdgeCache: exact
    ├─ 2. in-flight de-dup         an identical request is computing -> follow its stream  X-EdgeCache: shared
    ├─ 3. semantic cache           (not yet)
    └─ 4. engine                   stream to the client and followers; a complete answer is stored  miss

The HTTP layer (:mod:`edgecache.app`) authenticates, validates and renders; this module decides who answers. Each
layer is an instance handed in by the app factory, so tests pass fakes without patching.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Literal

import msgspec

from edgecache.engines.base import Chunk, Engine, GenerationRequest
from edgecache.errors import EngineError
from edgecache.inflight import Flight, InflightTable
from edgecache.keys import is_cacheable, request_key
from edgecache.metrics import Metrics
from edgecache.result_store import CachedAnswer, DiskResultStore

Served = Literal["exact", "shared", "miss"]


class Call(msgspec.Struct, frozen=True, kw_only=True):
    """One request as the pipeline sees it: what to generate, for whom, under which scenario."""

    request: GenerationRequest
    tenant: str = "default"
    scenario: str = "default"


class Reply(msgspec.Struct, kw_only=True):
    """Who served the call, and the answer: a stored one (``answer``) or a stream of chunks (text deltas; the
    last one carries the counts and the finish reason). :meth:`stream` gives chunks in either case."""

    served: Served
    answer: CachedAnswer | None = None
    chunks: AsyncIterator[Chunk] | None = None

    def stream(self) -> AsyncIterator[Chunk]:
        if self.answer is not None:
            return replay(self.answer)
        assert self.chunks is not None
        return self.chunks


def replay(answer: CachedAnswer) -> AsyncIterator[Chunk]:
    """A stored answer as a two-chunk stream: all its text, then its counts. The engine's prefix cache did not
    serve it, so cached_tokens is every prompt token: nothing was computed."""

    async def chunks() -> AsyncIterator[Chunk]:
        yield Chunk(text=answer.text)
        yield Chunk(finish_reason=answer.finish_reason, prompt_tokens=answer.prompt_tokens,  # type: ignore[arg-type]
                    completion_tokens=answer.completion_tokens, cached_tokens=answer.prompt_tokens)

    return chunks()


class RequestPipeline:
    def __init__(self, *, engine: Engine, store: DiskResultStore, inflight: InflightTable, metrics: Metrics,
                 default_ttl_s: float) -> None:
        self.engine = engine
        self.store = store
        self.inflight = inflight
        self.metrics = metrics
        self.default_ttl_s = default_ttl_s

    async def serve(self, call: Call) -> Reply:
        if not is_cacheable(call.request):
            # Sampling without a seed: every call should differ, so no layer may share or keep it.
            return Reply(served="miss", chunks=self._engine_stream(call.request))
        key = request_key(call.request, model_version=self.engine.version, tenant=call.tenant,
                          scenario=call.scenario)

        # 1. exact result store (memory first: a hot hit never leaves the event loop)
        answer = self.store.get_memory(key) or await self.store.get(key)
        if answer is not None:
            return Reply(served="exact", answer=answer)

        # 2. in-flight de-duplication
        flight = self.inflight.get(key)
        if flight is not None:
            return Reply(served="shared", chunks=flight.follow())

        # 3. semantic cache: not yet.

        # 4. engine: lead a flight that streams to every listener and stores the complete answer.
        flight = self.inflight.lead(key, lambda f: self._compute_and_store(call, key, f))
        return Reply(served="miss", chunks=flight.follow())

    async def _engine_stream(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        async with aclosing(self.engine.generate(request)) as stream:
            async for chunk in stream:
                if chunk.finish_reason is not None:
                    self.metrics.observe_engine_call(chunk.prompt_tokens, chunk.cached_tokens,
                                                     chunk.completion_tokens)
                yield chunk

    async def _compute_and_store(self, call: Call, key: str, flight: Flight) -> None:
        final: Chunk | None = None
        async with aclosing(self._engine_stream(call.request)) as stream:
            async for chunk in stream:
                flight.publish(chunk)
                if chunk.finish_reason is not None:
                    final = chunk
        if final is None:
            raise EngineError("the engine ended its stream without a finish reason")
        # Listeners have the whole answer now; storing it is the flight's last job (it stays joinable meanwhile).
        flight.finish()
        now = time.time()
        await self.store.put(key, CachedAnswer(
            text="".join(c.text for c in flight.chunks), finish_reason=final.finish_reason,
            prompt_tokens=final.prompt_tokens, completion_tokens=final.completion_tokens,
            created_at=now, expires_at=now + self.default_ttl_s))
