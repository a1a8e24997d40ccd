"""From the pipeline's :class:`~edgecache.pipeline.Reply` to the wire, for every API.

Each API (OpenAI Chat and Completions in :mod:`edgecache.http.openai_api`, and any other the front speaks) only says
how one answer looks: an :class:`AnswerWriter` renders a JSON body, or SSE frames (start, text deltas, end; a whole
answer at once; an error after the headers are gone). Everything else is the same for every API and lives here:
the hot path for a stored answer, waiting for the first chunk before any byte is sent, watching for the client
hanging up, the ``X-EdgeCache`` headers, and counting the outcome in the metrics.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Hashable
from contextlib import aclosing
from typing import Any, NamedTuple, Protocol, TypeVar

from litestar import Request
from litestar.types import ASGIApp

from edgecache.call import HITS, Call
from edgecache.engines.base import Choice, Chunk
from edgecache.errors import ClientGone, EdgeCacheError, Overloaded
from edgecache.ledger import ENGINE_ERROR
from edgecache.pipeline import Reply
from edgecache.runtime import Runtime
from edgecache.stores import CachedAnswer

T = TypeVar("T")


class Counts(NamedTuple):
    """An answer's token counts; ``cached`` is the part of the prompt nobody computed (all of it, for a hit);
    ``writes``: what the engine wrote to its prefix cache at the client's breakpoints, ``(ttl_s, tokens)``."""

    prompt: int
    completion: int
    cached: int
    writes: tuple[tuple[float, int], ...] = ()

    @classmethod
    def of(cls, final: Chunk) -> Counts:
        """An engine call's counts, from its last chunk."""
        return cls(final.prompt_tokens, final.completion_tokens, final.cached_tokens, final.cache_writes)


class AnswerWriter(Protocol):
    """How one API renders one answer, for one request. ``id`` names the response (every frame of it).

    ``replay_shape`` is what, besides ``id``, makes this writer's rendering differ from another's: the API, chat or
    text, the model, the request's settings a response echoes, the response's timestamp. Two writers of equal
    shape render a stored answer to the same bytes but for the id, so a hit writes a rendering made once with its
    own id put in (:class:`Renderings`). Every other per-response value must therefore be the id or carry its
    tail (what follows the id's kind, see :func:`id_tail`: a Response's item ids do) or be in the shape. A writer
    without the attribute, or None, renders each hit afresh. Rendering has no side effects beyond the writer's own
    stream state; a writer that keeps what it serves (a stored Response) does so in ``replayed`` for a hit.

    ``replayed``, where a writer has it and it is not None, is called as ``replayed(answer, body)`` once a stored
    answer is rendered for this response (a hit), ``body`` the answer as this response's JSON body.
    """

    id: str
    replay_shape: Hashable | None

    def body(self, text: str, finish_reason: str | None, counts: Counts,
             choices: tuple[Choice, ...] | None = None, stop_sequence: str | None = None) -> bytes: ...

    def sse_start(self) -> bytes: ...

    def sse_delta(self, text: str) -> bytes: ...

    def sse_end(self, finish_reason: str | None, counts: Counts, stop_sequence: str | None = None) -> bytes:
        """The stream's end. ``stop_sequence``: the stop string that ended the answer (an API that reports it
        does; see :class:`~edgecache.engines.base.Chunk`)."""
        ...

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


class StreamedAnswer:
    """An SSE response as a bare ASGI app: its headers already bytes, then each frame as ``frames`` yields it.

    The client hanging up ends it: ``frames`` is closed at once, which releases the flight listener (and with the
    last listener the engine call), as litestar's streaming response does. Litestar runs the stream and its
    disconnect watcher in an anyio task group; per streamed answer that cost more than relaying a short answer's
    tokens, and a watcher task that cancels the streaming one does the same work.
    """

    __slots__ = ("frames", "headers")

    def __init__(self, frames: AsyncIterator[bytes], headers: list[tuple[bytes, bytes]]) -> None:
        self.frames = frames
        self.headers = [(b"content-type", SSE), *headers]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            await disconnected(receive)
            gone = True
            streaming.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            async with aclosing(self.frames) as frames:
                async for frame in frames:
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            streaming.uncancel()  # the client left: this stream is over, not the task that served it
        finally:
            watcher.cancel()


class Renderings:
    """Stored answers rendered once per writer shape (a JSON body, or the whole SSE stream of a streamed hit), with
    the id's tail left out: a hit joins the pieces with its own, which costs a copy instead of an encode. Every
    API's writer is served here (see :class:`AnswerWriter`).

    Keyed by the answer object: the memory tier hands a hot answer out as the same object on every hit, and an
    entry holds its answer, so an id is never reused while its entry lives. Bounded by count and by bytes; an
    answer whose rendering is over an eighth of the bytes is rendered each time.
    """

    def __init__(self, max_entries: int = 4096, max_bytes: int = 32 << 20) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        # key -> (the answer, its rendering's pieces around the id's tail, their size, the id's kind)
        self._entries: OrderedDict[tuple[int, bool, Hashable], tuple[CachedAnswer, list[bytes], int, str]] = \
            OrderedDict()
        # Stands for the id's tail while a rendering is made: random, so no answer's text can hold it.
        self._slot = f"edgecachereplay{os.urandom(12).hex()}"

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def render(self, writer: AnswerWriter, answer: CachedAnswer, stream: bool) -> bytes:
        shape = getattr(writer, "replay_shape", None)
        if shape is None:
            return render_answer(writer, answer, stream)
        key = (id(answer), stream, shape)
        entry = self._entries.get(key)
        if entry is not None and entry[0] is answer and writer.id.startswith(entry[3]):
            self._entries.move_to_end(key)
            return writer.id[len(entry[3]):].encode().join(entry[1])
        kind, tail = id_tail(writer.id)
        own_id, writer.id = writer.id, kind + self._slot
        try:
            pieces = render_answer(writer, answer, stream).split(self._slot.encode())
        finally:
            writer.id = own_id
        size = sum(map(len, pieces))
        if size <= self.max_bytes // 8:
            if entry is not None:
                self._drop(key)
            self._entries[key] = (answer, pieces, size, kind)
            self.bytes += size
            while self.bytes > self.max_bytes or len(self._entries) > self.max_entries:
                self._drop(next(iter(self._entries)))
        return tail.encode().join(pieces)

    def _drop(self, key: tuple[int, bool, Hashable]) -> None:
        self.bytes -= self._entries.pop(key)[2]


_KIND = re.compile(r"[A-Za-z]+[-_]")


def id_tail(response_id: str) -> tuple[str, str]:
    """A response id as its kind (``chatcmpl-``, ``resp_``, ``msg_``: see
    :class:`~edgecache.http.openai_api.IdSource`) and its tail, the part unique to the response."""
    kind = _KIND.match(response_id)
    return ("", response_id) if kind is None else (kind.group(), response_id[kind.end():])


def render_answer(writer: AnswerWriter, answer: CachedAnswer, stream: bool) -> bytes:
    """A stored answer, whole: its JSON body, or every SSE frame a stream of it carries (what :func:`_sse` writes
    for the stored answer's replay: start, its text, end; or a whole answer at once)."""
    counts = Counts(answer.prompt_tokens, answer.completion_tokens, answer.prompt_tokens)  # a hit computed nothing
    if not stream:
        return writer.body(answer.text, answer.finish_reason, counts, answer.choices, answer.stop_sequence)
    if answer.choices is not None:
        return writer.sse_whole(answer.choices, counts)
    return (writer.sse_start() + (writer.sse_delta(answer.text) if answer.text else b"")
            + writer.sse_end(answer.finish_reason, counts, answer.stop_sequence))


SSE_HEADERS = [(b"cache-control", b"no-cache")]
SSE = b"text/event-stream; charset=utf-8"


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
    if reply.bucket is not None:
        headers.append((b"x-edgecache-bucket", reply.bucket.encode()))
    return headers


async def respond(rt: Runtime, request: Request[Any, Any, Any], call: Call, stream: bool, writer: AnswerWriter,
                  started: float) -> ASGIApp:
    """Serve ``call`` through the pipeline and render the reply with ``writer``: a JSON body, or an SSE stream."""
    assert rt.pipeline is not None  # the route checked readiness
    try:
        reply = await rt.pipeline.serve(call)
    except Overloaded:
        observe(rt, call, None, "rejected", None)
        raise
    request.app.state.front.ledger.remember(writer.id, call, reply)  # what served it, for the caller's feedback
    answer = reply.answer
    if answer is not None:
        # The hot path: a stored answer, its JSON body or its whole SSE stream made once and sent as one body.
        rt.metrics.observe_request(call.tenant, call.scenario, reply.served, time.perf_counter() - started)
        rt.ledger.request(call.tenant, call.scenario, reply.served, prompt_tokens=answer.prompt_tokens,
                          completion_tokens=answer.completion_tokens)
        renderings = request.app.state.front.renderings
        body = renderings.render(writer, answer, stream)
        replayed = getattr(writer, "replayed", None)
        if replayed is not None:
            replayed(answer, renderings.render(writer, answer, False) if stream else body)
        if stream:
            return RawAnswer(body, reply_headers(reply) + SSE_HEADERS, content_type=SSE)
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
            observe(rt, call, reply, "rejected" if isinstance(exc, Overloaded) else "error", None)
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
                observe(rt, call, reply, "error", None)
            raise
        finally:
            await chunks.aclose()
        observe(rt, call, reply, reply.served, ttft, final)
        body = writer.body("".join(texts), final.finish_reason,
                           Counts.of(final), final.choices,
                           final.stop_sequence)
        return RawAnswer(body, reply_headers(reply))

    return StreamedAnswer(_sse(rt, call, reply, writer, first, chunks, ttft), reply_headers(reply) + SSE_HEADERS)


def observe(rt: Runtime, call: Call, reply: Reply | None, outcome: str, ttft: float | None,
            final: Chunk | None = None) -> None:
    """A request's outcome, once: in the metrics and in the ledger (a shared answer saved the tokens its final
    chunk counts; a miss is counted under its reason, and under engine_error when the engine it asked failed)."""
    rt.metrics.observe_request(call.tenant, call.scenario, outcome, ttft)  # type: ignore[arg-type]
    miss_reason = None
    if reply is not None and reply.served == "miss":
        miss_reason = ENGINE_ERROR if outcome == "error" else reply.miss_reason
    rt.ledger.request(call.tenant, call.scenario, outcome, miss_reason=miss_reason,
                      prompt_tokens=final.prompt_tokens if final is not None else 0,
                      completion_tokens=final.completion_tokens if final is not None else 0)


async def unless_client_gone(request: Request[Any, Any, Any], work: Awaitable[T]) -> T:
    """``work``'s result, unless the client hangs up first: then ``work`` is cancelled (which releases what it
    holds: the flight listener, and with the last listener the engine call and its admission slot) and ClientGone
    is raised. The request body has been read, so the next ASGI message can only be the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected(request.receive))
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


async def disconnected(receive: Any) -> None:
    """Until the client hangs up. Only once the request body is read: then the next message can only be the
    disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _sse(rt: Runtime, call: Call, reply: Reply, writer: AnswerWriter, first: Chunk,
               chunks: AsyncIterator[Chunk], ttft: float) -> AsyncIterator[bytes]:
    outcome = "error"
    served = reply.served
    final: Chunk | None = None
    try:
        async with aclosing(chunks):
            if first.choices is not None:
                # A whole answer (tool calls, logprobs, several choices) arrives as one final chunk.
                yield writer.sse_whole(first.choices, Counts.of(first))
                outcome, final = served, first
                return
            yield writer.sse_start()
            chunk: Chunk | None = first
            while chunk is not None:
                if chunk.text:
                    yield writer.sse_delta(chunk.text)
                if chunk.finish_reason is not None:
                    yield writer.sse_end(chunk.finish_reason, Counts.of(chunk), chunk.stop_sequence)
                    outcome, final = served, chunk
                    return
                chunk = await anext(chunks, None)
    except EdgeCacheError as exc:
        # Headers are gone already: the error travels as an event in the API's own error shape.
        yield writer.sse_error(exc)
    finally:
        observe(rt, call, reply, outcome, ttft if outcome != "error" else None, final)
