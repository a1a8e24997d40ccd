"""The request path, top to bottom, as DESIGN.md draws it.

::

    key: canonical hash of (model version, tenant, scenario, messages, output-affecting params)
    ├─ 1. exact result store       hit -> replay the stored answer                         X-EdgeCache: exact
    ├─ 2. in-flight de-dup         an identical request is computing -> follow its stream  X-EdgeCache: shared
    ├─ 3. semantic cache           a paraphrase's answer, similar enough and guarded       X-EdgeCache: semantic
    └─ 4. engine                   stream to the client and followers; a complete answer is stored (and, for a
                                   first-turn chat prompt, its vector indexed)             X-EdgeCache: miss

The HTTP layer (:mod:`edgecache.app`) authenticates, validates and renders; this module decides who answers. Each
layer is an instance handed in by the app factory, so tests pass fakes without patching.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Literal

import msgspec

from edgecache.engines.base import Chunk, Engine, GenerationRequest
from edgecache.errors import EngineError
from edgecache.inflight import Flight, InflightTable
from edgecache.keys import is_cacheable, request_key
from edgecache.metrics import Metrics
from edgecache.result_store import CachedAnswer, DiskResultStore
from edgecache.semantic_cache import Lookup, Probe, SemanticCache, probe_for

Served = Literal["exact", "shared", "semantic", "miss"]


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
    similarity: float | None = None

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
                 ttl_for: Callable[[str], float], semantic: SemanticCache | None = None) -> None:
        self.engine = engine
        self.store = store
        self.inflight = inflight
        self.metrics = metrics
        self.ttl_for = ttl_for
        self.semantic = semantic

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

        # 3. semantic cache: first-turn chat prompts only, nearest neighbour over threshold and past the guard.
        probe = probe_for(call.request, self.engine.version) if self.semantic is not None else None
        lookup: Lookup | None = None
        if probe is not None:
            lookup = await self._semantic_lookup(call, key, probe)
            if lookup.hit is not None:
                answer = await self.store.get(lookup.hit.store_key)
                if answer is not None:
                    # Kept under this request's own key too, so its repeats are exact hits (same expiry).
                    await self.store.put(key, answer)
                    return Reply(served="semantic", answer=answer, similarity=lookup.hit.similarity)
                await self.semantic.forget(call.tenant, call.scenario, probe, lookup.hit.vector_key)  # type: ignore[union-attr]
            # An identical request may have started computing while this one looked.
            flight = self.inflight.get(key)
            if flight is not None:
                return Reply(served="shared", chunks=flight.follow())

        # 4. engine: lead a flight that streams to every listener and stores the complete answer.
        flight = self.inflight.lead(key, lambda f: self._compute_and_store(call, key, f, probe, lookup))
        return Reply(served="miss", chunks=flight.follow())

    async def _semantic_lookup(self, call: Call, key: str, probe: Probe) -> Lookup:
        assert self.semantic is not None
        lookup = await self.semantic.lookup(call.tenant, call.scenario, probe)
        if lookup.refused_by_guard is not None:
            self.metrics.semantic_guard_rejections.labels(lookup.refused_by_guard.split(":", 1)[0]).inc()
        return lookup

    async def _engine_stream(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        async with aclosing(self.engine.generate(request)) as stream:
            async for chunk in stream:
                if chunk.finish_reason is not None:
                    self.metrics.observe_engine_call(chunk.prompt_tokens, chunk.cached_tokens,
                                                     chunk.completion_tokens)
                yield chunk

    async def _compute_and_store(self, call: Call, key: str, flight: Flight, probe: Probe | None = None,
                                 lookup: Lookup | None = None) -> None:
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
            created_at=now, expires_at=now + self.ttl_for(call.scenario)))
        if probe is not None and lookup is not None and lookup.vector is not None and self.semantic is not None:
            await self.semantic.remember(call.tenant, call.scenario, probe, lookup.vector, key)
