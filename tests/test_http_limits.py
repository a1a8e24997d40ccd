"""The server under the app, on a real socket: head-size limit (431), read timeouts against slow-loris clients
(408 and close), a non-streaming client that hangs up releasing its engine call and admission slot, and the
server's start-up heap frozen once it serves."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn

from edgecache.engines.base import Chunk
from edgecache.http.app import create_app
from edgecache.http.server import uvicorn_config
from tests.conftest import chat_body, until
from tests.fakes import FakeEngine


@asynccontextmanager
async def uvicorn_server(app: Any, settings: Any) -> AsyncIterator[int]:
    """The app behind the real server config on a free port, on this test's event loop; yields the port."""
    server = uvicorn.Server(uvicorn_config(app, settings, port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    for _ in range(1000):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    assert server.started, "the server did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    rt = app.state.runtime
    for _ in range(500):
        if rt.ready:
            break
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        await task


async def read_all(reader: asyncio.StreamReader) -> bytes:
    """Everything until the server closes the connection (bounded, so a server that never closes fails)."""
    return await asyncio.wait_for(reader.read(), timeout=20)


def request_bytes(body: dict[str, Any], extra_headers: str = "") -> bytes:
    raw = json.dumps(body).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n{extra_headers}\r\n").encode() + raw


async def get_ok(port: int) -> bool:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    answer = await read_all(reader)
    writer.close()
    return answer.startswith(b"HTTP/1.1 200")


async def test_an_oversized_head_is_431_and_closed(make_settings: Any) -> None:
    settings = make_settings(server__max_header_bytes="8KiB")
    app = create_app(settings, engine=FakeEngine())
    async with uvicorn_server(app, settings) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        for _ in range(64):  # 1 MiB of one header, sent in pieces: refused long before it is all in
            writer.write(b"a" * 16384)
            try:
                await writer.drain()
            except ConnectionError:
                break
        answer = await read_all(reader)
        assert answer.startswith(b"HTTP/1.1 431")
        writer.close()
        # Headers under the limit are fine, and the server still serves.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Ok: " + b"b" * 4000 + b"\r\nConnection: close\r\n\r\n")
        assert (await read_all(reader)).startswith(b"HTTP/1.1 200")
        writer.close()
        app.state.front.access_log.flush()
        metrics = app.state.runtime.metrics.render().decode()
        assert 'edgecache_refused_requests_total{reason="headers_too_large"} 1.0' in metrics


async def test_slow_loris_connections_get_408_and_are_closed(make_settings: Any) -> None:
    settings = make_settings(server__read_timeout_s=0.5)
    engine = FakeEngine()
    app = create_app(settings, engine=engine)
    async with uvicorn_server(app, settings) as port:
        # Unfinished headers.
        r1, w1 = await asyncio.open_connection("127.0.0.1", port)
        w1.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: a")
        # A half-sent body.
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
        w2.write(request_bytes(chat_body("hello"))[:-10])
        # A connection that never says anything.
        r3, w3 = await asyncio.open_connection("127.0.0.1", port)
        first, second, silent = await asyncio.gather(read_all(r1), read_all(r2), read_all(r3))
        assert first.startswith(b"HTTP/1.1 408")
        assert second.startswith(b"HTTP/1.1 408")
        assert silent.startswith(b"HTTP/1.1 408")
        for w in (w1, w2, w3):
            w.close()
        assert engine.calls == 0
        assert await get_ok(port)
        metrics = app.state.runtime.metrics.render().decode()
        assert 'edgecache_refused_requests_total{reason="read_timeout"} 3.0' in metrics


async def test_a_trickled_request_gets_408_at_its_deadline_whatever_its_pace(make_settings: Any) -> None:
    """A byte every 0.2 s never trips the 5 s read timeout; the deadline on the whole request ends it."""
    settings = make_settings(server__read_timeout_s=5.0, server__request_deadline_s=1.0)
    engine = FakeEngine()
    app = create_app(settings, engine=engine)
    async with uvicorn_server(app, settings) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        whole = request_bytes(chat_body("hello " * 50))
        answer = b""
        for i in range(200):  # bounded: 40 s at most, the deadline ends it after ~5 bytes of body
            try:
                writer.write(whole[i:i + 1] if i else whole[:120])
                await writer.drain()
            except ConnectionError:
                break
            try:
                answer = await asyncio.wait_for(reader.read(4096), timeout=0.2)
            except TimeoutError:
                continue
            break
        answer += await read_all(reader)
        assert answer.startswith(b"HTTP/1.1 408") and b"not whole within 1 s" in answer
        writer.close()
        assert engine.calls == 0 and await get_ok(port)


async def test_a_non_streaming_client_gone_frees_its_slot_unless_another_listens(make_settings: Any) -> None:
    settings = make_settings(admission__max_concurrent_misses=1)
    engine = FakeEngine()
    app = create_app(settings, engine=engine)
    async with uvicorn_server(app, settings) as port:
        rt = app.state.runtime
        engine.gate = asyncio.Event()  # the engine never answers until the test says so

        # Alone: the client hangs up, and the engine call is aborted and the slot freed.
        _, lonely = await asyncio.open_connection("127.0.0.1", port)
        lonely.write(request_bytes(chat_body("nobody waits for this")))
        await until(lambda: engine.running == 1 and rt.admission.running == 1, "the miss started")
        lonely.close()
        await until(lambda: rt.admission.running == 0 and engine.running == 0, "the slot was freed")
        assert engine.aborted == 1 and len(rt.inflight) == 0

        # Shared: one of two identical requests hangs up; the other still gets the answer.
        _, leaving = await asyncio.open_connection("127.0.0.1", port)
        leaving.write(request_bytes(chat_body("two wait for this")))
        await until(lambda: engine.running == 1, "the shared miss started")
        staying_reader, staying = await asyncio.open_connection("127.0.0.1", port)
        staying.write(request_bytes(chat_body("two wait for this"), "Connection: close\r\n"))
        flight = next(iter(rt.inflight._flights.values()))
        await until(lambda: flight.listeners == 2, "both listen")
        leaving.close()
        await until(lambda: flight.listeners == 1, "one left")
        assert engine.running == 1 and rt.admission.running == 1
        engine.gate.set()
        answer = await read_all(staying_reader)
        assert answer.startswith(b"HTTP/1.1 200") and b"answer to: two wait for this" in answer
        staying.close()
        assert engine.aborted == 1 and engine.completed == 1
        app.state.front.access_log.flush()
        metrics = rt.metrics.render().decode()
        assert 'edgecache_refused_requests_total{reason="client_gone"} 2.0' in metrics


async def test_a_streaming_client_gone_mid_answer_aborts_the_engine_call_and_stores_nothing(
        make_settings: Any) -> None:
    """The client reads the first frame of a streamed miss and hangs up: the stream ends, the engine call is
    aborted, the admission slot is freed and nothing is stored; the server serves on."""
    class FirstThenWait(FakeEngine):
        async def generate(self, request: Any) -> Any:
            self.calls += 1
            self.running += 1
            try:
                yield Chunk(text="first words")
                await asyncio.Event().wait()  # the rest never comes
            finally:
                self.running -= 1
                self.aborted += 1

    settings = make_settings(admission__max_concurrent_misses=1)
    engine = FirstThenWait()
    app = create_app(settings, engine=engine)
    async with uvicorn_server(app, settings) as port:
        rt = app.state.runtime
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request_bytes(chat_body("stream, then nobody reads", stream=True)))
        seen = b""
        while b"first words" not in seen:
            seen += await reader.read(4096)
        assert seen.startswith(b"HTTP/1.1 200")
        writer.close()
        await until(lambda: engine.aborted == 1 and rt.admission.running == 0 and len(rt.inflight) == 0,
                    "the engine call was aborted and its slot freed")
        assert (await rt.stores("default").stats())["entries"] == 0
        assert await get_ok(port)


def test_the_server_freezes_the_heap_start_up_built_once_it_serves(tmp_path: Path) -> None:
    """``edgecache serve``'s server moves what start-up built out of the collector's passes once it serves (a full
    pass walked it all again, stalling every stream); a plain uvicorn server, as a test or another program may run
    the app under, leaves the heap alone. In a child process: freezing is the whole process's business."""
    script = """
import asyncio, gc, sys
import uvicorn
from edgecache.http.server import EdgeCacheServer

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})

async def main(kind):
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    config.load()
    server = (EdgeCacheServer if kind == "edgecache" else uvicorn.Server)(config)
    server.lifespan = config.lifespan_class(config)
    before = gc.get_freeze_count()
    await server.startup()
    print(before, gc.get_freeze_count(), server.started)
    await server.shutdown()

asyncio.run(main(sys.argv[1]))
"""
    def run(kind: str) -> list[str]:
        done = subprocess.run([sys.executable, "-c", script, kind], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    before, after, started = run("edgecache")
    assert (before, started) == ("0", "True")
    assert int(after) > 10_000  # the modules, the app: the heap start-up built
    assert run("uvicorn")[:2] == ["0", "0"]
