"""The token path at the limit: how many tokens a second EdgeCache's miss path relays from an engine that produces
them as fast as it can, against the same engine served bare.

Three servers, each in its own process (uvicorn, uvloop, httptools, like ``edgecache serve``):

- **bare**: a litestar endpoint that streams :class:`TokenEngine`'s tokens as OpenAI SSE frames, rendered by the
  same :class:`~edgecache.http.openai_api.ResponseWriter` EdgeCache uses, with no cache, no de-duplication and no
  admission. It is also the SSE upstream double of the ``--upstream`` path.
- **in-process**: EdgeCache (every layer but the semantic one, which embeds a prompt once per miss, not per token)
  with :class:`TokenEngine` as its engine.
- **upstream**: EdgeCache with :class:`~edgecache.engines.openai_upstream.OpenAIUpstreamEngine` in front of the
  bare server.

A client (:func:`drive`: protocol callbacks on uvloop, so the client costs little next to the servers) keeps N
streams going, each a new prompt (a miss), for a fixed time, and counts the tokens that arrived. The ratio through
EdgeCache over bare is the share of the engine's token rate the miss path keeps.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
from litestar import Litestar, Request, post
from litestar.response import Stream

from edgecache.engines.base import Chunk, GenerationRequest, Message, SamplingParams
from edgecache.errors import BadRequest
from edgecache.http.openai_api import IdSource, ResponseWriter
from edgecache.http.replies import Counts

MODEL = "token-double"


class TokenEngine:
    """An engine double that yields ``max_tokens`` one-token chunks as fast as it can: one per turn of the event
    loop (an engine in the process gives the loop a turn between tokens; one that never did would starve every
    other request)."""

    kind = "TokenEngine"
    features: frozenset[str] = frozenset()
    model_id = MODEL
    version = "token-double@1"
    token = "tok "

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def check_prompt(self, request: GenerationRequest) -> None:
        pass

    async def flush(self) -> None:
        pass

    async def stats(self) -> dict[str, float | int | str]:
        return {"engine": "token-double"}

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        n = request.params.max_tokens
        for _ in range(n):
            await asyncio.sleep(0)
            yield Chunk(text=self.token)
        yield Chunk(finish_reason="length", prompt_tokens=8, completion_tokens=n, cached_tokens=0)


class _StreamRequest(msgspec.Struct):
    model: str
    max_tokens: int = 16
    stream: bool = False


def bare_app() -> Litestar:
    """The engine double behind nothing but litestar: every request is a generation, streamed as OpenAI SSE."""
    engine, ids = TokenEngine(), IdSource()

    @post("/v1/chat/completions", status_code=200)
    async def generate(request: Request[Any, Any, Any]) -> Stream:
        try:
            body = msgspec.json.decode(await request.body(), type=_StreamRequest)
        except msgspec.DecodeError as exc:
            raise BadRequest(str(exc)) from exc
        writer = ResponseWriter(chat=True, model=body.model, response_id=ids.next("chat"),
                                include_usage=True)
        generation = GenerationRequest(messages=(Message(role="user", content="-"),),
                                       params=SamplingParams(max_tokens=body.max_tokens))

        async def frames() -> AsyncIterator[bytes]:
            yield writer.sse_start()
            async for chunk in engine.generate(generation):
                if chunk.text:
                    yield writer.sse_delta(chunk.text)
                if chunk.finish_reason is not None:
                    yield writer.sse_end(chunk.finish_reason, Counts(chunk.prompt_tokens, chunk.completion_tokens,
                                                                     chunk.cached_tokens))

        return Stream(frames(), media_type="text/event-stream")

    return Litestar([generate], openapi_config=None, logging_config=None)


def serve_edgecache(data_dir: Path, upstream: str | None, port: int) -> None:
    """EdgeCache with the engine double in process, or in front of the bare server at ``upstream``, served as
    ``edgecache serve`` serves it (its protocol with the request limits, its server)."""
    from edgecache.engines.openai_upstream import OpenAIUpstreamEngine
    from edgecache.http.app import create_app
    from edgecache.http.server import EdgeCacheServer, uvicorn_config
    from edgecache.settings import resolve_settings

    settings = resolve_settings("cpu", {
        "data_dir": str(data_dir), "semantic.enabled": False, "server.port": port, "server.log_level": "warning",
        # Every stream computes at once, as on an engine that batches them all (the admission gate is not measured).
        "admission.max_concurrent_misses": 256, "admission.max_queue": 256}, environ={})
    engine = OpenAIUpstreamEngine(upstream, model=MODEL) if upstream else TokenEngine()
    app = create_app(settings, engine=engine)  # type: ignore[arg-type]
    EdgeCacheServer(uvicorn_config(app, settings)).run()


def serve(app: Any, port: int) -> None:
    """A baseline app (the bare engine double, the bare endpoint) under plain uvicorn, uvloop and httptools."""
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning",
                access_log=False)


_TERMINATOR = b"\r\n0\r\n\r\n"


class Tally(msgspec.Struct):
    streams: int = 0
    tokens: int = 0
    seconds: float = 0.0
    sample: bytes = b""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


class _StreamClient(asyncio.Protocol):
    """One connection of :func:`drive`: asks for a streamed miss, reads it whole, asks for the next, until the run
    ends. Callbacks only (no task, future or timeout per read), so the client's cost per read is a few microseconds:
    on a 2-core box the client shares the cores with the servers it measures, and every microsecond it spends per
    token is taken from them (the StreamReader client this replaced cost as much per token as the bare double)."""

    def __init__(self, tally: Tally, request: Callable[[], bytes], done: asyncio.Future[None],
                 read_every_s: float = 0.0) -> None:
        self.tally = tally
        self.request = request
        self.done = done
        self.read_every_s = read_every_s
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.running = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.write(self.request())

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if not buf.endswith(_TERMINATOR):
            if self.read_every_s and self.transport is not None:
                # Read again only after a pause: what arrives meanwhile comes in one read.
                self.transport.pause_reading()
                asyncio.get_running_loop().call_later(self.read_every_s, self._resume)
            return
        if not buf.startswith(b"HTTP/1.1 200") or b"data: [DONE]" not in buf or b"x-edgecache: exact" in buf:
            self._fail(RuntimeError(f"a stream failed: {bytes(buf[:300])!r} ... {bytes(buf[-300:])!r}"))
            return
        self.tally.sample = bytes(buf)
        self.tally.streams += 1
        self.tally.tokens += buf.count(_MARKER)
        self.buf = bytearray()
        if self.running:
            assert self.transport is not None
            self.transport.write(self.request())

    def _resume(self) -> None:
        if self.running and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.running:
            self._fail(RuntimeError(f"the server closed the stream: {bytes(self.buf[-300:])!r}"))

    def stop(self) -> None:
        """The run is over: the stream under way counts for the tokens it brought."""
        if self.running:
            self.running = False
            self.tally.tokens += self.buf.count(_MARKER)
        if self.transport is not None:
            self.transport.close()

    def _fail(self, exc: BaseException) -> None:
        self.running = False
        if not self.done.done():
            self.done.set_exception(exc)


_MARKER = TokenEngine.token.encode()


async def drive(port: int, streams: int, seconds: float, tokens: int, read_every_s: float = 0.0) -> Tally:
    """``streams`` connections, each asking for one streamed miss of ``tokens`` tokens after another for
    ``seconds``; the tokens that arrived in that time (those of a stream cut off at the end too), per second.
    Each complete stream must be a 200 that ends in ``[DONE]``; the last complete one is kept in ``sample``, for
    the caller to check its text. Run it on uvloop (:func:`run_drive`): the servers measured use it too.

    ``read_every_s``: each connection is read at most that often (0: as bytes come). On one box the reader's pace
    is the writer's cost: a server that writes every token (as the bare double does, and SGLang and vLLM) pays a
    reader's wake-up per write when its reader keeps up, and none when the reader takes what gathered since its last
    read (as EdgeCache's upstream transport does). The bare double's rate depends on it, so both paces are
    measured."""
    tally = Tally()
    counter = itertools.count()
    run = os.urandom(6).hex()  # every prompt new, across runs against the same server: each stream is a miss
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def request() -> bytes:
        body = msgspec.json.encode({  # temperature 0: cacheable, so the miss runs the whole cached path
            "model": MODEL, "max_tokens": tokens, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": f"stream {run} {next(counter)}"}]})
        return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    clients = [(await loop.create_connection(lambda: _StreamClient(tally, request, done, read_every_s),
                                             "127.0.0.1", port))[1] for _ in range(streams)]
    timer = loop.call_later(seconds, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        timer.cancel()
        for client in clients:
            client.stop()
    tally.seconds = seconds
    return tally


def run_drive(port: int, streams: int, seconds: float, tokens: int, read_every_s: float = 0.0) -> Tally:
    """:func:`drive` on its own uvloop event loop."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(drive(port, streams, seconds, tokens, read_every_s))


def sample_text(raw: bytes) -> str:
    """The content a chunked SSE response carried (to check a stream relayed every token)."""
    _head, _, body = raw.partition(b"\r\n\r\n")
    out, rest = bytearray(), body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out += rest[:size]
        rest = rest[size + 2:]
    text = []
    for frame in bytes(out).split(b"\n\n"):
        if frame.startswith(b"data: {"):
            event = msgspec.json.decode(frame[6:])
            for choice in event.get("choices") or ():
                text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text)
