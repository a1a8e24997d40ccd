"""The upstream engine's HTTP transport (``engines/http_transport.py``) against a raw asyncio HTTP server that writes
exactly the bytes each test needs: chunked and sized bodies, kept-alive connections, a stale one, a silent server,
a malformed answer, a reader that leaves early, and a stream read in batches."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import httpx
import pytest

from edgecache.engines.http_transport import BatchingTransport
from edgecache.engines.openai_upstream import _default_transport
from tests.conftest import until

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server:
    """An HTTP server that answers each request with ``handler``; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                self.requests.append(head + await reader.readexactly(length))
                await self.handler(reader, writer)
                if writer.is_closing():
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.closed.set()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def client(base: str, batch_s: float = 0.0, read: float = 10.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base, transport=BatchingTransport(batch_s=batch_s, max_batch_s=max(batch_s, 0.05)),
                             timeout=httpx.Timeout(read, connect=5.0))


async def test_a_chunked_stream_arrives_whole_and_a_sized_body_too() -> None:
    parts = [b"data: %d\n\n" % i for i in range(30)]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if b"/sized" in server.requests[-1]:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
            return
        writer.write(SSE_HEAD)
        for part in parts:
            writer.write(chunk(part))
            await writer.drain()
        writer.write(b"0\r\n\r\n")

    server = Server(handler)
    async with server as base, client(base) as http:
        async with http.stream("POST", "/stream", json={"a": 1}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            body = b"".join([piece async for piece in response.aiter_raw()])
        assert body == b"".join(parts)
        sized = await http.get("/sized")
        assert (sized.status_code, sized.text) == (200, "hello")
    assert server.connections == 1  # the second request reused the kept-alive connection
    assert b'POST /stream HTTP/1.1' in server.requests[0] and server.requests[0].endswith(b'{"a":1}')


async def test_a_streamed_body_is_read_in_batches() -> None:
    """Thirty chunks written 5 ms apart, read under a 2 s batch: the first chunk at once (the first token is never
    held back), the other 29 in one read when the batch ends, where a read per chunk would make thirty."""
    parts = [b"data: %d\n\n" % i for i in range(30)]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD)
        for part in parts:
            writer.write(chunk(part))
            await writer.drain()
            await asyncio.sleep(0.005)
        writer.write(b"0\r\n\r\n")

    async with Server(handler) as base, client(base, batch_s=2.0) as http:
        async with http.stream("GET", "/") as response:
            pieces = [piece async for piece in response.aiter_raw()]
    assert b"".join(pieces) == b"".join(parts)
    assert pieces[0] == parts[0]
    assert len(pieces) <= 3


async def test_a_body_delimited_by_close_and_a_connection_closed_while_idle() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(server.requests) == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            writer.close()  # the kept-alive connection goes away while the client holds it idle
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
            await writer.drain()
            writer.close()

    server = Server(handler)
    async with server as base, client(base) as http:
        assert (await http.get("/")).text == "ok"
        await server.closed.wait()
        await asyncio.sleep(0)  # the client's side of the closed connection sees the close
        assert (await http.get("/")).text == "until the end"
    assert server.connections == 2


async def test_a_request_on_a_kept_alive_connection_the_server_dropped_goes_once_more_on_a_new_one() -> None:
    """The server reads the second request and closes without a byte of answer (it had timed the connection out):
    the request goes again on a new connection. A new connection that does the same is an error (no loop)."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(server.requests) in (2, 4, 5):
            writer.close()
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n%d" % (10 + len(server.requests)))

    server = Server(handler)
    async with server as base, client(base) as http:
        assert (await http.get("/")).text == "11"
        assert (await http.get("/")).text == "13"  # request 2 dropped, sent again as request 3
        assert server.connections == 2
        with pytest.raises(httpx.ReadError):
            await http.get("/")  # request 4 dropped on the kept-alive connection, 5 on a new one: no third try
    assert server.connections == 3


class ClosedHandle:
    """A transport as uvloop leaves it once the upstream closed it, before the protocol hears of it (its
    connection_lost comes a turn later): closing, or not yet saying so, and refusing every write."""

    def __init__(self, says_closing: bool) -> None:
        self.says_closing = says_closing

    def is_closing(self) -> bool:
        return self.says_closing

    def writelines(self, data: object) -> None:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

    def close(self) -> None:
        pass


@pytest.mark.parametrize("says_closing", [True, False])
async def test_a_kept_alive_connection_the_upstream_closed_but_not_yet_lost_is_not_used(says_closing: bool) -> None:
    """A request starting between the upstream's close of an idle kept-alive connection and the protocol's
    connection_lost goes on a new connection instead of failing on the closed one. uvloop, which the server runs
    on, refuses such a write outright (asyncio drops it): under load (64 streams) that failed flights several times
    a round."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    server = Server(handler)
    transport = BatchingTransport(batch_s=0.0)
    async with server as base, httpx.AsyncClient(base_url=base, transport=transport) as http:
        assert (await http.get("/")).text == "ok"
        [idle] = [conn for pool in transport._idle.values() for conn in pool]
        idle._transport = ClosedHandle(says_closing)  # type: ignore[assignment]
        assert (await http.get("/")).text == "ok"
    assert server.connections == 2


async def test_a_silent_upstream_is_a_read_timeout_and_a_closed_port_a_connect_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + chunk(b"data: 1\n\n"))
        await asyncio.sleep(30)

    async with Server(handler) as base, client(base, read=0.2) as http:
        with pytest.raises(httpx.ReadTimeout):
            async with http.stream("GET", "/") as response:
                async for _ in response.aiter_raw():
                    pass
    async with Server(handler) as base:
        pass  # the port is free again
    async with client(base) as http:
        with pytest.raises(httpx.ConnectError):
            await http.get("/")


async def test_a_malformed_answer_and_an_early_end_are_transport_errors() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(server.requests) == 1:
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        else:
            writer.write(SSE_HEAD + chunk(b"data: 1\n\n"))
            await writer.drain()
            writer.close()  # mid-body

    server = Server(handler)
    async with server as base, client(base) as http:
        with pytest.raises(httpx.RemoteProtocolError):
            await http.get("/")
        with pytest.raises(httpx.ReadError):
            await http.get("/")


async def test_leaving_a_stream_early_closes_its_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD)
        for i in range(10_000):
            writer.write(chunk(b"data: %d\n\n" % i))
            await writer.drain()
            await asyncio.sleep(0.001)

    server = Server(handler)
    async with server as base, client(base) as http:
        async with http.stream("GET", "/") as response:
            async for _ in response.aiter_raw():
                break
        await asyncio.wait_for(server.closed.wait(), 30)


async def test_a_request_cancelled_before_the_answer_closes_its_connection() -> None:
    """A caller that goes away while the upstream is still computing (before the answer's head) closes the
    connection, which is how the upstream learns to stop."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # no answer: until the client closes

    server = Server(handler)
    async with server as base, client(base) as http:
        request = asyncio.ensure_future(http.post("/", json={}))
        await until(lambda: bool(server.requests))
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        await asyncio.wait_for(server.closed.wait(), 30)


async def test_a_body_larger_than_the_buffer_bound_arrives_whole() -> None:
    big = bytes(range(256)) * 16_384  # 4 MiB, past the 1 MiB the transport buffers before it stops reading

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big)

    async with Server(handler) as base, client(base, batch_s=0.001) as http:
        async with http.stream("GET", "/") as response:
            received = bytearray()
            async for piece in response.aiter_raw():
                received += piece
                await asyncio.sleep(0.001)  # a slow reader
    assert bytes(received) == big


def test_a_proxy_in_the_environment_gets_httpx_own_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY",
                 "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert isinstance(_default_transport("http://10.0.0.5:30000/v1"), BatchingTransport)
    monkeypatch.setenv("http_proxy", "http://proxy.internal:3128")
    assert _default_transport("http://10.0.0.5:30000/v1") is None
    monkeypatch.setenv("no_proxy", "10.0.0.5")
    assert isinstance(_default_transport("http://10.0.0.5:30000/v1"), BatchingTransport)


def test_the_batch_window_widens_with_the_streams_read_at_once() -> None:
    transport = BatchingTransport(batch_s=0.005, reads_per_s=4000, max_batch_s=0.05)
    assert transport.window() == 0.005
    transport._streaming = 16
    assert transport.window() == 0.005   # 16 streams at 5 ms: 3,200 reads a second
    transport._streaming = 64
    assert transport.window() == pytest.approx(0.016)
    transport._streaming = 1000
    assert transport.window() == 0.05    # capped
    assert BatchingTransport(batch_s=0).window() == 0.0


async def test_a_stream_counts_while_it_is_read_and_not_after() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")

    transport = BatchingTransport(batch_s=0.001)
    async with Server(handler) as base, httpx.AsyncClient(base_url=base, transport=transport) as http:
        async with http.stream("GET", "/") as response:
            assert transport._streaming == 1
            async for _ in response.aiter_raw():
                pass
        assert transport._streaming == 0


async def test_the_upstream_engine_streams_through_the_batching_transport_directly() -> None:
    """A streamed generation goes to the batching transport without httpx's client layers: the request still
    carries what the client would send (the path under the base URL, the key, the JSON body), and the answer is
    relayed whole."""
    from edgecache.engines.base import GenerationRequest, Message, SamplingParams
    from edgecache.engines.openai_upstream import OpenAIUpstreamEngine

    frames = [b'data: {"choices":[{"index":0,"delta":{"content":"%s"},"finish_reason":null}]}\n\n' % t
              for t in (b"Blue", b" sky")]
    frames.append(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
                  b'"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\ndata: [DONE]\n\n')

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + b"".join(chunk(f) for f in frames) + b"0\r\n\r\n")

    server = Server(handler)
    async with server as base:
        # The version pinned: this server answers every request with the stream (no /v1/models to ask at start).
        engine = OpenAIUpstreamEngine(base + "/v1", api_key="k", model="m", version="pinned")
        await engine.start()
        try:
            assert engine._direct is not None  # the default transport is the batching one
            request = GenerationRequest(messages=(Message(role="user", content="sky?"),),
                                        params=SamplingParams(max_tokens=4))
            chunks = [c async for c in engine.generate(request)]
        finally:
            await engine.close()
    assert "".join(c.text for c in chunks) == "Blue sky"
    assert (chunks[-1].finish_reason, chunks[-1].prompt_tokens, chunks[-1].completion_tokens) == ("stop", 5, 2)
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    assert lines[0] == b"post /v1/chat/completions http/1.1"
    assert b"authorization: bearer k" in lines and b"content-type: application/json" in lines
    sent = json.loads(body)
    assert sent["model"] == "m" and sent["stream"] is True and sent["messages"][0]["content"] == "sky?"


async def test_a_stream_read_to_its_last_event_keeps_its_connection_for_the_next_generation() -> None:
    """The engine stops reading at ``data: [DONE]``; the upstream writes its chunked body's end a moment later. The
    transport reads that end on and keeps the connection: three generations, one connection (each had opened its
    own, and closed it)."""
    from edgecache.engines.base import GenerationRequest, Message, SamplingParams
    from edgecache.engines.openai_upstream import OpenAIUpstreamEngine

    frames = (b'data: {"choices":[{"index":0,"delta":{"content":"Blue"},"finish_reason":null}]}\n\n'
              b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
              b'"usage":{"prompt_tokens":5,"completion_tokens":1}}\n\ndata: [DONE]\n\n')

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + chunk(frames))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")

    server = Server(handler)
    async with server as base:
        # A grace no busy test box outlasts: what is tested is that the end is read on, not how fast it comes.
        transport = BatchingTransport(batch_s=0.005, end_grace_s=60.0)
        engine = OpenAIUpstreamEngine(base + "/v1", model="m", transport=transport, version="pinned")
        await engine.start()
        try:
            for _ in range(3):
                request = GenerationRequest(messages=(Message(role="user", content="sky?"),),
                                            params=SamplingParams(max_tokens=4))
                chunks = [c async for c in engine.generate(request)]
                assert "".join(c.text for c in chunks) == "Blue" and chunks[-1].finish_reason == "stop"
                await until(lambda: sum(map(len, transport._idle.values())) == 1, "the connection back in the pool")
        finally:
            await engine.close()
    assert (server.connections, len(server.requests)) == (1, 3)


async def test_a_body_still_read_on_when_the_transport_closes_closes_its_connection() -> None:
    """The reader left at its last event and the transport was closed before the body's end came: when the end
    comes, the connection is closed, not kept in the closed transport's pool."""
    transport_closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + chunk(b"data: [DONE]\n\n"))
        await writer.drain()
        await asyncio.wait_for(transport_closed.wait(), 30)  # the client leaves and closes its transport first
        writer.write(b"0\r\n\r\n")

    server = Server(handler)
    transport = BatchingTransport(batch_s=0.005, end_grace_s=60.0)
    async with server as base:
        async with httpx.AsyncClient(base_url=base, transport=transport) as http:
            async with http.stream("POST", "/", json={}) as response:
                async for piece in response.aiter_raw():
                    assert piece == b"data: [DONE]\n\n"
                    break
        transport_closed.set()
        await asyncio.wait_for(server.closed.wait(), 30)
    assert not any(transport._idle.values())


@pytest.mark.parametrize("status, error", [(400, "BadRequest"), (503, "EngineError")])
async def test_an_upstream_refusal_on_the_direct_path_is_the_engines_error(status: int, error: str) -> None:
    """On the direct path too, an upstream's refusal is read whole and named: a 400 is the caller's to fix (a 400
    naming the upstream's reason), anything else the engine's failure (a 502)."""
    from edgecache.engines.base import GenerationRequest, Message, SamplingParams
    from edgecache.engines.openai_upstream import OpenAIUpstreamEngine

    body = b'{"error": {"message": "no such field: frobnicate"}}'

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 %d Nope\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (status, len(body), body))

    server = Server(handler)
    async with server as base:
        engine = OpenAIUpstreamEngine(base + "/v1", model="m", version="pinned")
        await engine.start()
        try:
            request = GenerationRequest(messages=(Message(role="user", content="x"),),
                                        params=SamplingParams(max_tokens=4))
            with pytest.raises(Exception) as raised:
                [c async for c in engine.generate(request)]
        finally:
            await engine.close()
    assert type(raised.value).__name__ == error and "no such field: frobnicate" in str(raised.value)
