"""The HTTP front: an app factory that builds the litestar app from one :class:`~edgecache.settings.Settings`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (OpenAI), ``GET /health``
(503 while the model loads), ``GET /metrics`` (Prometheus), ``GET /stats`` (JSON).

Handlers take the raw body and decode it with msgspec themselves: the strict request structs are the validation,
and skipping litestar's signature modelling keeps the cache-hit path short. Every error leaves through one handler
that renders the OpenAI error shape; a bug becomes a logged traceback and a plain 500, never a traceback on the wire.

Resources live in the lifespan: the result store opens first, the engine loads in the background (so /health can
say 503 until it is ready), and shutdown runs in reverse: finish in-flight answers, close the engine, close the
store.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.response import Stream

from edgecache.engines.base import Chunk, Engine, GenerationRequest
from edgecache.errors import BadRequest, EdgeCacheError, ModelNotFound, NotReady, PayloadTooLarge, error_body
from edgecache.inflight import InflightTable
from edgecache.metrics import Metrics
from edgecache.openai_api import (ChatCompletionRequest, CompletionRequest, IdSource, ModelCard, ModelList,
                                  ResponseWriter, decode_request, usage)
from edgecache.pipeline import Call, RequestPipeline
from edgecache.result_store import DiskResultStore
from edgecache.semantic_cache import SemanticCache
from edgecache.settings import Settings

log = logging.getLogger("edgecache")

_json = msgspec.json.Encoder()
JSON = "application/json"
SHUTDOWN_GRACE_S = 30.0


class Runtime:
    """Everything one running app holds, on ``app.state.runtime``. Built by the lifespan, closed in reverse.

    The store opens at once; the engine and the embedder load in the background (:meth:`load`), and the request
    pipeline is assembled when both are ready. Until then every model route answers 503.
    """

    def __init__(self, settings: Settings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = Metrics()
        self.inflight = InflightTable()
        self.ids = IdSource()
        self.parsed = ParsedRequests()
        self.store = DiskResultStore(settings.data_path / "results", disk_bytes=settings.store.disk_bytes,
                                     memory_bytes=settings.store.memory_bytes)
        self.semantic: SemanticCache | None = None
        self.pipeline: RequestPipeline | None = None
        self.ready = False
        self.load_error: str | None = None
        self.started_at = int(time.time())
        self._background: list[asyncio.Task[None]] = []

    async def load(self) -> None:
        try:
            await self.engine.start()
            if self.settings.semantic.enabled:
                self.semantic = await asyncio.get_running_loop().run_in_executor(
                    None, build_semantic_cache, self.settings, self.metrics)
        except EdgeCacheError as exc:
            self.load_error = exc.message
            log.error("loading failed: %s", exc.message)
            return
        except Exception as exc:  # a load failure must show on /health, not kill the server silently
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.exception("loading failed")
            return
        self.pipeline = RequestPipeline(engine=self.engine, store=self.store, inflight=self.inflight,
                                        metrics=self.metrics, ttl_for=self.settings.scenario_ttl_s,
                                        semantic=self.semantic)
        if self.semantic is not None:
            self._background.append(asyncio.create_task(self._save_indexes_periodically(), name="index-saver"))
        self.ready = True
        log.info("model %s ready (%s)%s", self.engine.model_id, self.engine.version,
                 f", embedder {self.semantic.embedder.version}" if self.semantic else "")

    async def _save_indexes_periodically(self) -> None:
        # The vectors are committed to SQLite as they are added; the index files are a rebuildable copy, written
        # every few seconds so a restart does not have to rebuild them.
        assert self.semantic is not None
        while True:
            await asyncio.sleep(self.settings.semantic.save_interval_s)
            await self.semantic.save()
            await self.refresh_index_gauge()

    async def refresh_index_gauge(self) -> None:
        if self.semantic is not None:
            for (tenant, scenario), count in (await self.semantic.sizes()).items():
                self.metrics.semantic_index_vectors.labels(tenant, scenario).set(count)

    async def close(self) -> None:
        # 1. let in-flight answers finish (they may still be stored), 2. close the engine, 3. save the indexes,
        # 4. close the store.
        self.ready = False
        for task in self._background:
            task.cancel()
        try:
            await self.inflight.drain(SHUTDOWN_GRACE_S)
            await self.engine.close()
        finally:
            try:
                if self.semantic is not None:
                    self.semantic.close()
            finally:
                self.store.close()


def build_semantic_cache(settings: Settings, metrics: Metrics) -> SemanticCache:
    """Load the embedder and open the indexes (blocking: model load). Thresholds: the scenario's own, else the
    value calibrated for this embedder."""
    from edgecache.embedders import default_threshold, load_embedder
    from edgecache.semantic_index import SemanticIndex

    sem = settings.semantic
    embedder = load_embedder(sem.embedder, model_dir=sem.model_dir, device=sem.device, threads=sem.threads)
    index = SemanticIndex(settings.data_path / "semantic", dim=embedder.dim, embedder_version=embedder.version,
                          dtype=sem.vector_dtype, max_vectors=sem.max_vectors_per_index)

    def threshold_for(scenario: str) -> float:
        configured = settings.scenarios[scenario].threshold
        return configured if configured is not None else default_threshold(embedder.version, scenario)

    return SemanticCache(embedder=embedder, index=index, threshold_for=threshold_for, max_batch=sem.batch_max,
                         max_wait_s=sem.batch_wait_ms / 1000, observe_embed=metrics.embed_seconds.observe,
                         observe_search=metrics.semantic_search_seconds.observe)


def _runtime(state: State) -> Runtime:
    return state.runtime  # type: ignore[no-any-return]


def _check_ready(rt: Runtime, model: str) -> None:
    if not rt.ready:
        raise NotReady(rt.load_error and f"the model failed to load: {rt.load_error}" or
                       "the model is still loading; retry shortly")
    if model != rt.engine.model_id:
        raise ModelNotFound(f"the model {model!r} does not exist here; this server serves "
                            f"{rt.engine.model_id!r}", param="model")


class Parsed(msgspec.Struct, frozen=True, kw_only=True):
    """A validated request: the pipeline's Call plus how to render the answer."""

    call: Call
    model: str
    chat: bool
    stream: bool
    include_usage: bool


def _parse_chat(body: bytes, settings: Settings) -> Parsed:
    req = decode_request(body, ChatCompletionRequest)
    assert isinstance(req, ChatCompletionRequest)
    if len(req.messages) > settings.server.max_messages:
        raise PayloadTooLarge(f"at most {settings.server.max_messages} messages per request")
    params = req.sampling(settings.engine.default_max_tokens, req.max_completion_tokens)
    generation = GenerationRequest(messages=tuple(m.to_message() for m in req.messages), params=params,
                                   salt="default")
    return _parsed(req, generation, chat=True)


def _parse_completion(body: bytes, settings: Settings) -> Parsed:
    req = decode_request(body, CompletionRequest)
    assert isinstance(req, CompletionRequest)
    generation = GenerationRequest(prompt=req.prompt, params=req.sampling(settings.engine.default_max_tokens),
                                   salt="default")
    return _parsed(req, generation, chat=False)


def _parsed(req: ChatCompletionRequest | CompletionRequest, generation: GenerationRequest, *, chat: bool) -> Parsed:
    scenario = (req.edgecache.scenario if req.edgecache else None) or "default"
    return Parsed(call=Call(request=generation, scenario=scenario), model=req.model, chat=chat, stream=req.stream,
                  include_usage=bool(req.stream_options and req.stream_options.include_usage))


class ParsedRequests:
    """Recently seen request bodies -> their parsed form, bounded by count.

    A repeated request is the common case on a cache (that is what a hit is), and its body is byte-for-byte the
    same. Looking the bytes up costs a hash; decoding, validating and rebuilding the call costs several times that
    and would be most of an exact hit's time. Only valid bodies are kept, so an invalid one is re-checked (and
    refused) every time. Keyed by route and body only: nothing per-connection goes into a parse.
    """

    MAX_BODY_BYTES = 16_384

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[bool, bytes], Parsed] = OrderedDict()

    def parse(self, chat: bool, body: bytes, settings: Settings) -> Parsed:
        key = (chat, body)
        parsed = self._entries.get(key)
        if parsed is not None:
            self._entries.move_to_end(key)
            return parsed
        parsed = _parse_chat(body, settings) if chat else _parse_completion(body, settings)
        if len(body) <= self.MAX_BODY_BYTES:
            self._entries[key] = parsed
            if len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return parsed


def _with_headers(parsed: Parsed, request: Request[Any, Any, Any], rt: Runtime) -> Parsed:
    """Apply the per-request headers (``X-EdgeCache-Scenario``) over what the body said, and check the scenario."""
    scenario = request.headers.get("x-edgecache-scenario")
    if scenario is not None and scenario != parsed.call.scenario:
        parsed = msgspec.structs.replace(parsed, call=msgspec.structs.replace(parsed.call, scenario=scenario))
    if parsed.call.scenario not in rt.settings.scenarios:
        raise BadRequest(f"unknown scenario {parsed.call.scenario!r}; this server has: "
                         f"{', '.join(sorted(rt.settings.scenarios))}", param="edgecache.scenario")
    return parsed


async def _respond(rt: Runtime, parsed: Parsed, started: float) -> Response[Any]:
    call, stream, chat, include_usage = parsed.call, parsed.stream, parsed.chat, parsed.include_usage
    assert rt.pipeline is not None  # _check_ready ran
    reply = await rt.pipeline.serve(call)
    writer = ResponseWriter(chat=chat, model=rt.engine.model_id, include_usage=include_usage,
                            response_id=rt.ids.next("chat" if chat else "text"))
    headers = {"X-EdgeCache": reply.served}
    if reply.similarity is not None:
        headers["X-EdgeCache-Similarity"] = f"{reply.similarity:.3f}"
    metrics = rt.metrics
    answer = reply.answer
    if answer is not None and not stream:
        # The hot path: a stored answer, rendered straight from the store's copy.
        metrics.observe_request(call.tenant, call.scenario, reply.served, time.perf_counter() - started)
        body = writer.body(answer.text, answer.finish_reason,
                           usage(answer.prompt_tokens, answer.completion_tokens, answer.prompt_tokens))
        return Response(content=body, media_type=JSON, headers=headers)
    chunks = reply.stream()
    try:
        # The first chunk is awaited before any byte is sent, so an error before the first token (a bad prompt,
        # a failed engine) still gets its real HTTP status instead of a 200 stream carrying an error.
        first = await anext(chunks)
    except BaseException:
        await chunks.aclose()
        metrics.observe_request(call.tenant, call.scenario, "error", None)
        raise
    ttft = time.perf_counter() - started

    if not stream:
        try:
            texts, final = [first.text], first
            async for chunk in chunks:
                texts.append(chunk.text)
                final = chunk
        except BaseException:
            metrics.observe_request(call.tenant, call.scenario, "error", None)
            raise
        finally:
            await chunks.aclose()
        metrics.observe_request(call.tenant, call.scenario, reply.served, ttft)
        body = writer.body("".join(texts), final.finish_reason,
                           usage(final.prompt_tokens, final.completion_tokens, final.cached_tokens))
        return Response(content=body, media_type=JSON, headers=headers)

    return Stream(content=_sse(rt, call, reply.served, writer, first, chunks, ttft), media_type="text/event-stream",
                  headers={**headers, "Cache-Control": "no-cache"})


async def _sse(rt: Runtime, call: Call, served: str, writer: ResponseWriter, first: Chunk,
               chunks: AsyncIterator[Chunk], ttft: float) -> AsyncIterator[bytes]:
    outcome = "error"
    try:
        async with aclosing(chunks):
            yield writer.sse_start()
            chunk: Chunk | None = first
            while chunk is not None:
                if chunk.text:
                    yield writer.sse_delta(chunk.text)
                if chunk.finish_reason is not None:
                    yield writer.sse_end(chunk.finish_reason,
                                         usage(chunk.prompt_tokens, chunk.completion_tokens, chunk.cached_tokens))
                    outcome = served
                    return
                chunk = await anext(chunks, None)
    except EdgeCacheError as exc:
        # Headers are gone already: the error travels as an SSE event in the OpenAI error shape.
        yield writer.sse_error(_json.encode(error_body(exc)))
    finally:
        rt.metrics.observe_request(call.tenant, call.scenario, outcome, ttft if outcome != "error" else None)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
    started = time.perf_counter()
    rt = _runtime(request.app.state)
    parsed = rt.parsed.parse(True, await request.body(), rt.settings)
    _check_ready(rt, parsed.model)
    return await _respond(rt, _with_headers(parsed, request, rt), started)


@post("/v1/completions", status_code=200)
async def completions(request: Request[Any, Any, Any]) -> Response[Any]:
    started = time.perf_counter()
    rt = _runtime(request.app.state)
    parsed = rt.parsed.parse(False, await request.body(), rt.settings)
    _check_ready(rt, parsed.model)
    return await _respond(rt, _with_headers(parsed, request, rt), started)


@get("/v1/models")
async def list_models(state: State) -> Response[Any]:
    rt = _runtime(state)
    return Response(_json.encode(ModelList(data=[ModelCard(id=rt.engine.model_id, created=rt.started_at)])),
                    media_type=JSON)


@get("/health")
async def health(state: State) -> Response[Any]:
    rt = _runtime(state)
    status = "ready" if rt.ready else ("failed" if rt.load_error else "loading")
    body = {"status": status, "model": rt.engine.model_id, "version": rt.engine.version}
    if rt.load_error:
        body["error"] = rt.load_error
    return Response(_json.encode(body), media_type=JSON, status_code=200 if rt.ready else 503)


@get("/metrics")
async def metrics(state: State) -> Response[Any]:
    return Response(_runtime(state).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@get("/stats")
async def stats(state: State) -> Response[Any]:
    rt = _runtime(state)
    body = rt.metrics.snapshot()
    body["store"] = await rt.store.stats()
    body["engine_state"] = await rt.engine.stats() if rt.ready else {}
    body["inflight"] = len(rt.inflight)
    body["model"] = {"id": rt.engine.model_id, "version": rt.engine.version, "ready": rt.ready}
    body["profile"] = rt.settings.profile
    return Response(_json.encode(body), media_type=JSON)


def _error_response(_: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    if isinstance(exc, EdgeCacheError):
        err = exc
    elif isinstance(exc, HTTPException):
        # litestar's own refusals (unknown route, wrong method, body over the limit) in the OpenAI shape.
        err = EdgeCacheError(str(exc.detail))
        err.status = exc.status_code
        err.error_type = {404: "not_found_error", 413: "invalid_request_error", 405: "invalid_request_error"}.get(
            exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error")
    else:
        log.error("unhandled error", exc_info=exc)
        err = EdgeCacheError("internal server error")
    return Response(_json.encode(error_body(err)), status_code=err.status, media_type=JSON, headers=err.headers())


def create_app(settings: Settings, engine: Engine | None = None,
               engine_factory: Callable[[Settings], Engine] | None = None) -> Litestar:
    """Build the app. ``engine`` injects a ready-made engine (tests pass a fake); otherwise the engine named by
    ``settings.engine.kind`` is built."""

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        if engine is not None:
            chosen = engine
        else:
            from edgecache.engines import engine_from_settings
            chosen = (engine_factory or engine_from_settings)(settings)
        Path(settings.data_path).mkdir(parents=True, exist_ok=True)
        rt = Runtime(settings, chosen)
        app.state.runtime = rt
        loading = asyncio.create_task(rt.load(), name="load")
        try:
            yield
        finally:
            if not loading.done():
                loading.cancel()
                await asyncio.wait([loading])
            await rt.close()

    return Litestar(
        route_handlers=[chat_completions, completions, list_models, health, metrics, stats],
        lifespan=[lifespan],
        exception_handlers={Exception: _error_response},
        request_max_body_size=settings.server.max_body_bytes,
        openapi_config=None,
        logging_config=None,  # logging is the host's to configure (the CLI does); litestar must not replace it
        debug=False,
    )
