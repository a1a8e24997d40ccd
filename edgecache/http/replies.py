"""From the pipeline's :class:`~edgecache.pipeline.Reply` to the wire, for every API.

Each API (OpenAI Chat and Completions in :mod:`edgecache.http.openai_api`, and any other the front speaks) only says
how one answer looks: an :class:`AnswerWriter` renders a JSON body, or SSE frames (start, text deltas, end; a whole
answer at once; an error after the headers are gone). Everything else is the same for every API and lives here:
the hot path for a stored answer, waiting for the first chunk before any byte is sent, watching for the client
hanging up, the ``X-EdgeCache`` headers, and counting the outcome in the metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Any, NamedTuple, Protocol, TypeVar

from litestar import Request
from litestar.response import Stream
from litestar.types import ASGIApp

from edgecache.call import HITS, Call
from edgecache.engines.base import Choice, Chunk
from edgecache.errors import ClientGone, EdgeCacheError, Overloaded
from edgecache.pipeline import Reply
from edgecache.runtime import Runtime

T = TypeVar("T")


class Counts(NamedTuple):
    """An answer's token counts; ``cached`` is the part of the prompt nobody computed (all of it, for a hit)."""

    prompt: int
    completion: int
    cached: int


class AnswerWriter(Protocol):
    """How one API renders one answer, for one request. ``id`` names the response (every frame of it)."""

    id: str

    def body(self, text: str, finish_reason: str | None, counts: Counts,
             choices: tuple[Choice, ...] | None = None) -> bytes: ...

    def sse_start(self) -> bytes: ...

    def sse_delta(self, text: str) -> bytes: ...

    def sse_end(self, finish_reason: str | None, counts: Counts) -> bytes: ...

    def sse_whole(self, choices: tuple[Choice, ...], counts: Counts) -> bytes:
        """A whole answer (tool calls, logprobs, several choices), streamed at once."""
        ...

    def sse_error(self, error: EdgeCacheError) -> bytes:
        """An error once the stream has begun (the status is sent already): the API's own error event."""
        ...


class RawAnswer:
    """A complete response as a bare ASGI app, its headers already bytes, sent exactly as given.

    A hit costs little beyond writing its response, so the response's own cost shows: litestar's ``Response``
    rebuilds a case-insensitive header map and re-checks every header per response, which measured about a third
    of our hit path's time above a bare endpoint. The answers here need none of that. It also leaves a media type
    alone: litestar appends ``; charset=utf-8`` to any ``text/*`` type, which gave /metrics a duplicate charset
    parameter that strict parsers (Prometheus 3's Go ``mime.ParseMediaType``) reject.
    """

    __slots__ = ("body", "headers")

    def __init__(self, body: bytes, headers: list[tuple[bytes, bytes]], content_type: bytes = b"application/json"
                 ) -> None:
        self.body = body
        self.headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *headers]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


def reply_headers(reply: Reply) -> list[tuple[bytes, bytes]]:
    headers = [(b"x-edgecache", reply.served.encode())]
    if reply.answer is not None:
        # HTTP's Age: seconds since the answer was made (a stored answer's; one still being made is 0 old).
        headers.append((b"age", str(max(0, int(time.time() - reply.answer.created_at))).encode()))
    elif reply.served in HITS:
        headers.append((b"age", b"0"))
    if reply.ttl_s is not None:
        headers.append((b"x-edgecache-ttl", str(max(0, int(reply.ttl_s))).encode()))
    if reply.similarity is not None:
        headers.append((b"x-edgecache-similarity", f"{reply.similarity:.3f}".encode()))
    return headers


async def respond(rt: Runtime, request: Request[Any, Any, Any], call: Call, stream: bool, writer: AnswerWriter,
                  started: float) -> ASGIApp:
    """Serve ``call`` through the pipeline and render the reply with ``writer``: a JSON body, or an SSE stream."""
    assert rt.pipeline is not None  # the route checked readiness
    try:
        reply = await rt.pipeline.serve(call)
    except Overloaded:
        rt.metrics.observe_request(call.tenant, call.scenario, "rejected", None)
        raise
    metrics = rt.metrics
    answer = reply.answer
    if answer is not None and not stream:
        # The hot path: a stored answer, rendered straight from the store's copy.
        metrics.observe_request(call.tenant, call.scenario, reply.served, time.perf_counter() - started)
        body = writer.body(answer.text, answer.finish_reason,
                           Counts(answer.prompt_tokens, answer.completion_tokens, answer.prompt_tokens),
                           answer.choices)
        return RawAnswer(body, reply_headers(reply))
    chunks = reply.stream()
    try:
        # The first chunk is awaited before any byte is sent, so an error before the first token (a bad prompt,
        # a failed engine) still gets its real HTTP status instead of a 200 stream carrying an error. Nothing is
        # sent while it waits, so the client's hanging up is watched for meanwhile.
        first = await unless_client_gone(request, anext(chunks))
    except BaseException as exc:
        await chunks.aclose()
        if not isinstance(exc, ClientGone):
            metrics.observe_request(call.tenant, call.scenario,
                                    "rejected" if isinstance(exc, Overloaded) else "error", None)
        raise
    ttft = time.perf_counter() - started

    if not stream:
        async def rest() -> tuple[list[str], Chunk]:
            texts, final = [first.text], first
            async for chunk in chunks:
                texts.append(chunk.text)
                final = chunk
            return texts, final

        try:
            texts, final = await unless_client_gone(request, rest())
        except BaseException as exc:
            if not isinstance(exc, ClientGone):
                metrics.observe_request(call.tenant, call.scenario, "error", None)
            raise
        finally:
            await chunks.aclose()
        metrics.observe_request(call.tenant, call.scenario, reply.served, ttft)
        body = writer.body("".join(texts), final.finish_reason,
                           Counts(final.prompt_tokens, final.completion_tokens, final.cached_tokens), final.choices)
        return RawAnswer(body, reply_headers(reply))

    headers = {name.decode(): value.decode() for name, value in reply_headers(reply)}
    return Stream(content=_sse(rt, call, reply.served, writer, first, chunks, ttft), media_type="text/event-stream",
                  headers={**headers, "Cache-Control": "no-cache"}).to_asgi_response(None, request)


async def unless_client_gone(request: Request[Any, Any, Any], work: Awaitable[T]) -> T:
    """``work``'s result, unless the client hangs up first: then ``work`` is cancelled (which releases what it
    holds: the flight listener, and with the last listener the engine call and its admission slot) and ClientGone
    is raised. The request body has been read, so the next ASGI message can only be the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait([task])
            if watcher.done():
                raise ClientGone("the client closed the connection before its answer was ready")
        watcher.cancel()
    return task.result()


async def _disconnected(request: Request[Any, Any, Any]) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(rt: Runtime, call: Call, served: str, writer: AnswerWriter, first: Chunk,
               chunks: AsyncIterator[Chunk], ttft: float) -> AsyncIterator[bytes]:
    outcome = "error"
    try:
        async with aclosing(chunks):
            if first.choices is not None:
                # A whole answer (tool calls, logprobs, several choices) arrives as one final chunk.
                yield writer.sse_whole(first.choices, Counts(first.prompt_tokens, first.completion_tokens,
                                                             first.cached_tokens))
                outcome = served
                return
            yield writer.sse_start()
            chunk: Chunk | None = first
            while chunk is not None:
                if chunk.text:
                    yield writer.sse_delta(chunk.text)
                if chunk.finish_reason is not None:
                    yield writer.sse_end(chunk.finish_reason,
                                         Counts(chunk.prompt_tokens, chunk.completion_tokens, chunk.cached_tokens))
                    outcome = served
                    return
                chunk = await anext(chunks, None)
    except EdgeCacheError as exc:
        # Headers are gone already: the error travels as an event in the API's own error shape.
        yield writer.sse_error(exc)
    finally:
        rt.metrics.observe_request(call.tenant, call.scenario, outcome, ttft if outcome != "error" else None)
