"""The HTTP front: an app factory that builds the litestar app from one :class:`~edgecache.settings.Settings`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``POST /v1/responses`` with
``GET``/``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` (OpenAI), ``POST /v1/messages``
and ``POST /v1/messages/count_tokens`` (Anthropic, whose errors come in Anthropic's shape), ``GET /health``
(503 while the model loads), ``GET /model_info`` and ``GET /server_info`` (what SGLang's router reads of a worker),
``GET /metrics`` (Prometheus), ``GET /stats`` (JSON) and ``GET /stats/history`` (the ledger minute by minute),
``GET /dashboard`` (the operator's page: :mod:`edgecache.http.dashboard`), ``POST /admin/flush`` and
``POST /admin/warmup`` (admin key when there is a tenants file), ``POST /v1/feedback`` (a caller marks a response
right or wrong: :mod:`edgecache.http.feedback`). The state they share is a
:class:`~edgecache.runtime.Runtime`.

Each API route authenticates, parses its body into the pipeline's :class:`~edgecache.call.Call` and picks its answer
writer; :func:`edgecache.http.replies.respond` serves the call and renders the reply, the same way for every API.
Handlers take the raw body and decode it with msgspec themselves: the strict request structs are the validation,
and skipping litestar's signature modelling keeps the cache-hit path short. Every error leaves through one handler
that renders the OpenAI error shape; a bug becomes a logged traceback and a plain 500, never a traceback on the wire.

Resources live in the lifespan: the result stores open first, the engine and the embedder load in the background
(so /health can say 503 until they are ready), and shutdown runs in reverse: finish in-flight answers, close the
engine, save the indexes, close the stores.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

import msgspec
from litestar import HttpMethod, Litestar, Request, Response, get, post, route
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.handlers import HTTPRouteHandler
from litestar.params import PathParameter, QueryParameter
from litestar.types import ASGIApp

from edgecache.call import HITS
from edgecache.canary import CanaryReport
from edgecache.data_dir import DataDirLock
from edgecache.engines.base import Engine
from edgecache.errors import (
    BadRequest,
    EdgeCacheError,
    ModelNotFound,
    NotFound,
    NotReady,
    error_body,
)
from edgecache.http import anthropic_api
from edgecache.http.access_log import TENANT_SCOPE_KEY, AccessLog, AccessLogMiddleware
from edgecache.http.calls import apply_headers, read_body, read_headers
from edgecache.http.dashboard import dashboard, dashboard_asset, load_assets
from edgecache.http.embeddings import EmbeddingRequest, embed
from edgecache.http.feedback import FeedbackRequest, ResponseLedger, apply_feedback
from edgecache.http.front import Front
from edgecache.http.openai_api import ModelCard, ModelInfo, ModelList, ResponseWriter, ServerInfo
from edgecache.http.openapi import openapi_document
from edgecache.http.replies import RawAnswer, respond
from edgecache.http.request_surface import check_engine_supports, decode_body
from edgecache.http.responses_api import responses_names
from edgecache.http.warmup_lines import WarmupBatch, warm_lines
from edgecache.ledger import FINE_MINUTES, HISTORY_MINUTES
from edgecache.runtime import Runtime
from edgecache.settings import Settings
from edgecache.tenants import TenantDirectory

log = logging.getLogger("edgecache")

_json = msgspec.json.Encoder()
JSON = "application/json"


def _runtime(state: State) -> Runtime:
    return state.runtime  # type: ignore[no-any-return]


def _front(state: State) -> Front:
    return state.front  # type: ignore[no-any-return]


def _check_ready(rt: Runtime, model: str) -> None:
    if not rt.ready:
        raise NotReady(rt.load_error and f"the model failed to load: {rt.load_error}" or
                       "the model is still loading; retry shortly")
    if model != rt.engine.model_id:
        raise ModelNotFound(f"the model {model!r} does not exist here; this server serves "
                            f"{rt.engine.model_id!r}", param="model")


def _credentials(request: Request[Any, Any, Any]) -> tuple[str | None, str | None]:
    """The Authorization and x-api-key headers by the one rule every route follows (sent twice: 400)."""
    headers = read_headers(request.scope["headers"])
    return headers.authorization, headers.api_key


async def _generate(request: Request[Any, Any, Any], chat: bool) -> ASGIApp:
    started = time.perf_counter()
    state = request.app.state
    rt, front = _runtime(state), _front(state)
    headers = read_headers(request.scope["headers"])
    tenant = rt.tenants.authenticate(headers.authorization, headers.api_key)           # 401 on an unknown key
    request.scope[TENANT_SCOPE_KEY] = tenant.id  # type: ignore[literal-required]  # for the access log
    body = await read_body(request.receive, rt.settings.server.max_body_bytes)         # 413
    parsed = front.parsed.parse(chat, body, tenant)                                    # 400 / 413
    _check_ready(rt, parsed.model)                                                     # 503 / 404
    check_engine_supports(parsed.features, rt.engine)                                  # 400 naming field+engine
    parsed = apply_headers(parsed, headers, tenant, rt.settings)
    writer = ResponseWriter(chat=chat, model=rt.engine.model_id, include_usage=parsed.include_usage,
                            response_id=front.ids.next("chat" if chat else "text"))
    return await respond(rt, request, parsed.call, parsed.stream, writer, started)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request[Any, Any, Any]) -> ASGIApp:
    return await _generate(request, chat=True)


@post("/v1/completions", status_code=200)
async def completions(request: Request[Any, Any, Any]) -> ASGIApp:
    return await _generate(request, chat=False)


@post("/v1/responses", status_code=200)
async def create_response(request: Request[Any, Any, Any]) -> ASGIApp:
    """The Responses API (:mod:`edgecache.http.responses_api`): the same call as chat, rendered as a Response."""
    started = time.perf_counter()
    rt, front = _runtime(request.app.state), _front(request.app.state)
    headers = read_headers(request.scope["headers"])
    tenant = rt.tenants.authenticate(headers.authorization, headers.api_key)           # 401 on an unknown key
    request.scope[TENANT_SCOPE_KEY] = tenant.id  # type: ignore[literal-required]  # for the access log
    body = await read_body(request.receive, rt.settings.server.max_body_bytes)         # 413
    asked = await front.responses.parse(body, tenant)                                  # 400 / 413 / 404
    _check_ready(rt, asked.parsed.model)                                               # 503 / 404
    with responses_names():
        check_engine_supports(asked.parsed.features, rt.engine)                        # 400 naming field+engine
    parsed = apply_headers(asked.parsed, headers, tenant, rt.settings)
    writer = front.responses.writer(asked, front.ids.next("response"), rt.engine.model_id, tenant.id)
    return await respond(rt, request, parsed.call, parsed.stream, writer, started)


# One handler for both methods: litestar answers OPTIONS on a path from the methods of the handler registered there
# first, so a second handler on the same path would be left out of its Allow header.
@route("/v1/responses/{response_id:str}", http_method=[HttpMethod.GET, HttpMethod.DELETE], status_code=200)
async def stored_response(request: Request[Any, Any, Any], response_id: Annotated[str, PathParameter()]) -> ASGIApp:
    """``GET`` a stored response (another tenant's is a 404) or ``DELETE`` it."""
    rt = _runtime(request.app.state)
    tenant = rt.tenants.authenticate(*_credentials(request))
    responses = _front(request.app.state).responses
    if request.method == HttpMethod.DELETE:
        return RawAnswer(await responses.delete(tenant.id, response_id), [])
    return RawAnswer((await responses.stored(tenant.id, response_id)).body, [])


@get("/v1/responses/{response_id:str}/input_items")
async def response_input_items(
        request: Request[Any, Any, Any], response_id: Annotated[str, PathParameter()],
        limit: Annotated[int, QueryParameter(ge=1, le=100)] = 20,
        order: Annotated[Literal["asc", "desc"], QueryParameter()] = "desc",
        after: Annotated[str | None, QueryParameter()] = None) -> ASGIApp:
    rt = _runtime(request.app.state)
    tenant = rt.tenants.authenticate(*_credentials(request))
    return RawAnswer(await _front(request.app.state).responses.input_items(
        tenant.id, response_id, limit=limit, order=order, after=after), [])


def _anthropic_error_response(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    """Errors on the Messages routes, in Anthropic's shape (the other routes keep OpenAI's)."""
    err, headers = _as_error(exc)
    return Response(_json.encode(anthropic_api.error_out(err)), status_code=err.status, media_type=JSON,
                    headers=headers)


@post("/v1/messages", status_code=200, exception_handlers={Exception: _anthropic_error_response})
async def messages(request: Request[Any, Any, Any]) -> ASGIApp:
    """Anthropic's Messages API, onto the same Call a chat request builds (:mod:`edgecache.http.anthropic_api`)."""
    started = time.perf_counter()
    rt = _runtime(request.app.state)
    headers = read_headers(request.scope["headers"])
    tenant = rt.tenants.authenticate(headers.authorization, headers.api_key)
    request.scope[TENANT_SCOPE_KEY] = tenant.id  # type: ignore[literal-required]
    front = _front(request.app.state)
    body = await read_body(request.receive, rt.settings.server.max_body_bytes)
    parsed = front.parsed.recall("messages", body, tenant, anthropic_api.parse_messages)
    _check_ready(rt, parsed.model)
    check_engine_supports(parsed.features, rt.engine)
    parsed = apply_headers(parsed, headers, tenant, rt.settings)
    writer = anthropic_api.MessageWriter(model=rt.engine.model_id, message_id=front.ids.next("message"))
    return await respond(rt, request, parsed.call, parsed.stream, writer, started)


@post("/v1/messages/count_tokens", status_code=200, exception_handlers={Exception: _anthropic_error_response})
async def count_tokens(request: Request[Any, Any, Any]) -> ASGIApp:
    """The prompt's tokens as the engine counts them: its chat template and tools included."""
    rt = _runtime(request.app.state)
    tenant = rt.tenants.authenticate(*_credentials(request))
    request.scope[TENANT_SCOPE_KEY] = tenant.id  # type: ignore[literal-required]
    model, generation = anthropic_api.parse_count_tokens(await request.body(), tenant, rt.settings)
    _check_ready(rt, model)
    count = await rt.engine.count_tokens(generation)
    return RawAnswer(_json.encode(anthropic_api.TokenCount(input_tokens=count)), [])


def _model_cards(rt: Runtime) -> list[ModelCard]:
    """The chat model, and the embedder when the semantic layer hosts one (it serves /v1/embeddings)."""
    cards = [ModelCard(id=rt.engine.model_id, created=rt.started_at)]
    if rt.semantic is not None:
        cards.append(ModelCard(id=rt.settings.semantic.embedder, created=rt.started_at))
    return cards


@post("/v1/feedback", status_code=200)
async def feedback(request: Request[Any, Any, Any]) -> ASGIApp:
    """A caller marks a response it received right or wrong (:mod:`edgecache.http.feedback`)."""
    rt = _runtime(request.app.state)
    tenant = rt.tenants.authenticate(*_credentials(request))
    request.scope[TENANT_SCOPE_KEY] = tenant.id  # type: ignore[literal-required]  # for the access log
    mark = decode_body(await request.body(), FeedbackRequest)
    done = await apply_feedback(rt, _front(request.app.state).ledger, tenant.id, mark)
    return RawAnswer(_json.encode(done), [])


@get("/v1/models")
async def list_models(state: State) -> Response[Any]:
    return Response(_json.encode(ModelList(data=_model_cards(_runtime(state)))), media_type=JSON)


@get("/v1/models/{model_id:str}")
async def retrieve_model(state: State, model_id: Annotated[str, PathParameter()]) -> Response[Any]:
    rt = _runtime(state)
    for card in _model_cards(rt):
        if card.id == model_id:
            return Response(_json.encode(card), media_type=JSON)
    raise ModelNotFound(f"the model {model_id!r} does not exist here; this server serves "
                        f"{', '.join(repr(c.id) for c in _model_cards(rt))}", param="model")


@get(["/model_info", "/get_model_info"])
async def model_info(state: State) -> Response[Any]:
    rt = _runtime(state)
    model = rt.engine.model_id
    return Response(_json.encode(ModelInfo(model_id=model, served_model_name=model, weight_version=rt.engine.version)),
                    media_type=JSON)


@get(["/server_info", "/get_server_info"])
async def server_info(state: State) -> Response[Any]:
    rt = _runtime(state)
    return Response(_json.encode(ServerInfo(served_model_name=rt.engine.model_id, version=state.version, dp_size=1,
                                            max_running_requests=rt.admission.max_running)), media_type=JSON)


@post("/v1/embeddings", status_code=200)
async def embeddings(request: Request[Any, Any, Any]) -> ASGIApp:
    rt = _runtime(request.app.state)
    tenant = rt.tenants.authenticate(*_credentials(request))
    body = decode_body(await request.body(), EmbeddingRequest)
    if not rt.ready:
        raise NotReady("the server is still loading; retry shortly")
    model_id = rt.settings.semantic.embedder
    if rt.semantic is None:
        why = rt.semantic_layer.error if rt.semantic_layer is not None else None
        raise ModelNotFound(f"this server hosts no embedder now (the semantic layer is off{': ' + why if why else ''})",
                            param="model")
    if body.model != model_id:
        raise ModelNotFound(f"the embedding model {body.model!r} does not exist here; this server's embedder is "
                            f"{model_id!r}", param="model")
    payload, all_hits = await embed(body, model_id=model_id, semantic=rt.semantic, store=rt.stores(tenant.id))
    return RawAnswer(payload, [(b"x-edgecache", b"exact" if all_hits else b"miss")])


@get("/openapi.json")
async def openapi_json(state: State) -> ASGIApp:
    """The OpenAPI document, generated from the request and response structs (see :mod:`edgecache.http.openapi`)."""
    return RawAnswer(state.openapi, [])


@get("/health")
async def health(state: State) -> Response[Any]:
    """The worst of the component checks (:mod:`edgecache.health`): 200 when ready or degraded (serving, with the
    reason), 503 while loading or when failed. Each component's status and reason is listed."""
    rt = _runtime(state)
    overall, components = rt.health.report()
    body: dict[str, Any] = {"status": overall.status, "model": rt.engine.model_id, "version": rt.engine.version,
                            "components": {name: {"status": h.status, **({"reason": h.reason} if h.reason else {})}
                                           for name, h in components.items()}}
    if overall.reason:
        body["reason"] = overall.reason
    if rt.load_error:
        body["error"] = rt.load_error
    if rt.canary is not None:
        body["canary"] = msgspec.to_builtins(rt.canary)
    if rt.fleet is not None:
        # Redis down is a detail, not a failure: the node serves from its memory tier and its engine.
        body["redis"] = rt.fleet.health()
    return Response(_json.encode(body), media_type=JSON, status_code=200 if overall.serving else 503)


PROMETHEUS_TEXT = b"text/plain; version=0.0.4; charset=utf-8"


@get("/metrics")
async def metrics(request: Request[Any, Any, Any]) -> ASGIApp:
    rt = _runtime(request.app.state)
    rt.tenants.authenticate_metrics(*_credentials(request))  # it names every tenant with its traffic
    return RawAnswer(rt.metrics.render(), [], content_type=PROMETHEUS_TEXT)


@get("/stats")
async def stats(request: Request[Any, Any, Any]) -> Response[Any]:
    """Everything for the admin key (``?tenant=NAME``: that tenant's view); a tenant's key gets its own figures
    only (its requests, store and ledger)."""
    rt = _runtime(request.app.state)
    tenant = rt.tenants.authenticate_stats(*_credentials(request))
    responses = _front(request.app.state).ledger
    if tenant is not None:
        return Response(_json.encode(await _tenant_stats(rt, tenant.id, responses)), media_type=JSON)
    named = request.query_params.get("tenant")  # the admin's view of one tenant (`edgecache stats --tenant`)
    if named:
        return Response(_json.encode(await _tenant_stats(rt, named, responses)), media_type=JSON)
    stores = await rt.refresh_gauges()
    body = rt.metrics.snapshot()
    body["ledger"] = rt.ledger.report()
    body["stores"] = stores
    if rt.semantic is not None and (learned := rt.semantic.learned()) is not None:
        body["semantic"]["learner"] = learned  # type: ignore[index]
    body["semantic"]["labelling"]["judge"] = rt.judge_status()  # type: ignore[index]
    body["semantic"]["near_cut"] = rt.near_cut()  # type: ignore[index]
    body["store"] = {field: sum(s[field] for s in stores.values())
                     for field in ("entries", "bytes", "budget_bytes", "memory_entries", "memory_bytes")}
    body["admission"] = {"running": rt.admission.running, "queued": rt.admission.queued,
                         "rejected": rt.admission.rejected, "max_running": rt.admission.max_running}
    body["engine_state"] = await rt.engine.stats() if rt.ready else {}
    body["prefix_cache"] = rt.prefix_cache_usage()
    body["inflight"] = len(rt.inflight)
    body["model"] = {"id": rt.engine.model_id, "version": rt.engine.version, "ready": rt.ready}
    body["profile"] = rt.settings.profile
    return Response(_json.encode(body), media_type=JSON)


async def _tenant_stats(rt: Runtime, tenant: str, responses: ResponseLedger) -> dict[str, Any]:
    """/stats as one tenant sees it: nothing of another tenant's, not even its name. ``bounds``: what it holds of
    everything it can grow, beside each bound."""
    body = rt.metrics.snapshot()
    mine = body["by_tenant"].get(tenant, {})
    totals: dict[str, int] = {}
    for counts in mine.values():
        for outcome, n in counts.items():
            totals[outcome] = totals.get(outcome, 0) + n
    served = sum(n for outcome, n in totals.items() if outcome not in ("error", "rejected"))
    hits = sum(totals.get(layer, 0) for layer in HITS)
    stores = {}
    if tenant in rt.stores.existing_tenants():
        stores[tenant] = await rt.stores(tenant).stats()
    bounds = await rt.tenant_bounds(tenant)
    bounds["feedback_responses"] = {"used": responses.held(tenant), "bound": responses.max_entries}
    return {"tenant": tenant, "requests": totals, "hit_rate": hits / served if served else 0.0, "bounds": bounds,
            "by_tenant": {tenant: mine}, "stores": stores, "ledger": rt.ledger.report(tenant),
            "semantic": {"near_cut": rt.near_cut(tenant)},
            "prefix_cache": {t: usage for t, usage in rt.prefix_cache_usage().items() if t == tenant},
            "model": {"id": rt.engine.model_id, "version": rt.engine.version, "ready": rt.ready},
            "profile": rt.settings.profile}


@get("/stats/history")
async def stats_history(
        request: Request[Any, Any, Any],
        minutes: Annotated[int, QueryParameter(ge=1, le=HISTORY_MINUTES)] = FINE_MINUTES,
        step: Annotated[int, QueryParameter(ge=1, le=HISTORY_MINUTES)] = 1,
        tenant: Annotated[str | None, QueryParameter()] = None) -> Response[Any]:
    """The ledger minute by minute over the last ``minutes`` (up to a day), in points of ``step`` minutes; keys
    as for /stats: the admin's sees every tenant (``?tenant=NAME``: one), a tenant's its own rows only."""
    rt = _runtime(request.app.state)
    me = rt.tenants.authenticate_stats(*_credentials(request))
    body = rt.ledger.timeline(me.id if me is not None else tenant or None, minutes=minutes, step=step)
    if me is not None:
        body["tenant"] = me.id
    body["price"] = ({"per_hour": rt.ledger.price_per_hour, "currency": rt.ledger.currency}
                     if rt.ledger.price_per_hour is not None else None)
    return Response(_json.encode(body), media_type=JSON)


class FlushRequest(msgspec.Struct, forbid_unknown_fields=True):
    tenant: str | None = None
    scenario: str | None = None
    all: bool = False


@post("/admin/flush", status_code=200)
async def admin_flush(request: Request[Any, Any, Any]) -> Response[Any]:
    """Drop cached entries across all layers: ``{"tenant": T}``, ``{"scenario": S}``, both, or ``{"all": true}``."""
    rt = _runtime(request.app.state)
    rt.tenants.authenticate_admin(*_credentials(request))
    body = decode_body(await request.body() or b"{}", FlushRequest)
    if not body.all and body.tenant is None and body.scenario is None:
        raise BadRequest("name a tenant, a scenario, or all: true")
    if body.tenant is not None and rt.tenants.get(body.tenant) is None and body.tenant not in \
            rt.stores.existing_tenants():
        raise NotFound(f"unknown tenant {body.tenant!r}", param="tenant")
    if body.scenario is not None and body.scenario not in rt.settings.scenarios:
        raise NotFound(f"unknown scenario {body.scenario!r}", param="scenario")
    if not rt.ready:
        raise NotReady("the server is still loading")
    dropped = await rt.flush(body.tenant, body.scenario)
    log.info("flushed tenant=%s scenario=%s: %s", body.tenant or "*", body.scenario or "*", dropped)
    return Response(_json.encode({"flushed": {"tenant": body.tenant, "scenario": body.scenario}, **dropped}),
                    media_type=JSON)


@post("/admin/warmup", status_code=200)
async def admin_warmup(request: Request[Any, Any, Any]) -> Response[Any]:
    """Warm the caches with a batch of prompts-file lines (see :mod:`edgecache.warmup`): one result per line, and
    what each teaching the batch gave allows now."""
    rt = _runtime(request.app.state)
    rt.tenants.authenticate_admin(*_credentials(request))
    batch = decode_body(await request.body(), WarmupBatch)
    if not rt.ready:
        raise NotReady("the server is still loading")
    assert rt.pipeline is not None
    reply = await warm_lines(rt.pipeline, batch.lines, tenants=rt.tenants, settings=rt.settings,
                             tenant=batch.tenant, prefilled=_front(request.app.state).warm_prefilled)
    return Response(_json.encode(reply), media_type=JSON)


def _as_error(exc: Exception) -> tuple[EdgeCacheError, dict[str, str]]:
    """Any exception as the EdgeCacheError it answers with, and that answer's headers."""
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
    headers = err.headers()
    if isinstance(exc, HTTPException) and exc.headers:
        headers = {**exc.headers, **headers}  # 405 names the allowed methods (Allow)
    return err, headers


def _error_response(_: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    err, headers = _as_error(exc)
    return Response(_json.encode(error_body(err)), status_code=err.status, media_type=JSON, headers=headers)


def _package_version() -> str:
    try:
        return importlib.metadata.version("edgecache")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def create_app(settings: Settings, engine: Engine | None = None,
               engine_factory: Callable[[Settings], Engine] | None = None,
               canary: CanaryReport | None = None) -> Litestar:
    """Build the app. ``engine`` injects a ready-made engine (tests pass a fake); otherwise the engine named by
    ``settings.engine.kind`` is built. The tenants file is read here, so a bad one fails before serving.
    ``canary`` is what the start-up self-test settled on (:mod:`edgecache.canary`), shown on /health."""
    tenants = (TenantDirectory.from_file(settings.tenants_file) if settings.tenants_file
               else TenantDirectory.open_directory())

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        if engine is not None:
            chosen = engine
        else:
            from edgecache.engines import engine_from_settings
            chosen = (engine_factory or engine_from_settings)(settings)
        # One process per data dir: a second one refuses here, before it opens a store (DataDirBusy).
        lock = DataDirLock(settings.data_path).acquire()
        try:
            rt = Runtime(settings, chosen, tenants)
            rt.canary = canary
            front = Front(settings, count_refusal=lambda reason: rt.metrics.refused_requests.labels(reason).inc(),
                          fleet=rt.fleet)
            rt.flush_listeners.append(front.after_flush)
            app.state.runtime, app.state.front = rt, front
            loading = asyncio.create_task(rt.load(), name="load")
            try:
                yield
            finally:
                if not loading.done():
                    loading.cancel()
                    await asyncio.wait([loading])
                try:
                    await front.close()  # before the runtime: the stored responses' last writes need the fleet's link
                finally:
                    await rt.close()
        finally:
            lock.release()

    app = Litestar(
        route_handlers=[chat_completions, completions, create_response, stored_response,
                        response_input_items, messages, count_tokens, feedback, embeddings, list_models,
                        retrieve_model, model_info, server_info, openapi_json, health, metrics, stats, stats_history,
                        dashboard, dashboard_asset, admin_flush, admin_warmup],
        lifespan=[lifespan],
        state=State({"openapi": _json.encode(openapi_document(_package_version())), "version": _package_version(),
                     "dashboard": load_assets()}),
        exception_handlers={Exception: _error_response},
        request_max_body_size=settings.server.max_body_bytes,
        openapi_config=None,
        logging_config=None,  # logging is the host's to configure (the CLI does); litestar must not replace it
        debug=False,
    )
    # The generation routes go straight to their handlers (DirectRoutes); the access log goes around that and
    # litestar's whole handler (routing and error rendering included), so 404s and 405s are logged too.
    direct = DirectRoutes(app.asgi_handler, {
        "/v1/chat/completions": (chat_completions, _error_response),
        "/v1/completions": (completions, _error_response),
        "/v1/responses": (create_response, _error_response),
        "/v1/messages": (messages, _anthropic_error_response),
    })
    app.asgi_handler = AccessLogMiddleware(direct, lambda: _access_log_of(app))
    return app


ErrorRenderer = Callable[[Request[Any, Any, Any], Exception], Response[Any]]


class DirectRoutes:
    """The generation routes, each a POST to one path, called straight from the ASGI scope ahead of litestar's
    router; every other request goes on to litestar (``routed``).

    Why: a cache hit costs little beyond writing its bytes, and litestar's per-request route machinery (the router,
    the layered exception handlers, the handler's signature model, the response conversion) is more than all of the
    cache's own work: on the 2-core box a bare litestar endpoint cost ~280 us of CPU per request and a bare ASGI
    app under the same uvicorn ~105 us. These handlers need none of it: they read the raw body, decode it with
    msgspec themselves and return a finished ASGI answer, and their errors render here exactly as litestar would
    render them (the same error handlers). The routes stay registered with litestar as well, which answers every
    other method on these paths (405) and the path spellings only its normalisation matches (a trailing slash).
    """

    __slots__ = ("routed", "routes")

    def __init__(self, routed: ASGIApp, routes: dict[str, tuple[HTTPRouteHandler, ErrorRenderer]]) -> None:
        self.routed = routed
        # path -> (the route's handler function, its litestar route handler, how its errors render)
        self.routes = {path: (handler.fn, handler, render_error) for path, (handler, render_error) in routes.items()}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            await self.routed(scope, receive, send)
            return
        handler, route_handler, render_error = route
        scope["route_handler"] = route_handler  # what litestar's router sets: the access log names the route by it
        request: Request[Any, Any, Any] = Request(scope, receive, send)
        try:
            answer = await handler(request)
        except Exception as exc:  # every error in its API's shape, as litestar's exception handlers render it
            answer = render_error(request, exc).to_asgi_response(None, request)
        await answer(scope, receive, send)


def _access_log_of(app: Litestar) -> AccessLog | None:
    front = getattr(app.state, "front", None)
    return front.access_log if front is not None else None
