from __future__ import annotations

import asyncio

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import httpx
from litestar import Litestar

from edgecache.http.app import create_app
from edgecache.settings import Settings, resolve_settings
from tests.fakes import FakeEngine
from tests.redis_server import RedisServer


@pytest.fixture
def make_settings(tmp_path: Path) -> Callable[..., Settings]:
    """Settings from the cpu profile with a temp data dir and dotted overrides; no environment leaks in."""

    def make(**overrides: Any) -> Settings:
        dotted = {k.replace("__", "."): v for k, v in overrides.items()}
        dotted.setdefault("data_dir", str(tmp_path / "data"))
        dotted.setdefault("semantic.enabled", False)  # tests of the semantic layer turn it on
        return resolve_settings("cpu", dotted, environ={})

    return make


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@asynccontextmanager
async def serve_in_process(app: Litestar, *, ready: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan running, behind an httpx client on the same event loop.

    (litestar's AsyncTestClient runs the app on a portal thread and blocks the caller's loop per request, so
    concurrent requests from one test would run one at a time; httpx's ASGI transport keeps them concurrent.)
    """
    started, stop = asyncio.Event(), asyncio.Event()

    async def run_lifespan() -> None:
        # One task enters and leaves the lifespan: anyio's cancel scopes inside it must not change task, and
        # pytest-asyncio runs an async fixture's setup and teardown in different tasks.
        async with app.lifespan():
            started.set()
            await stop.wait()

    lifespan = asyncio.create_task(run_lifespan())
    await asyncio.wait([lifespan, asyncio.create_task(started.wait())], return_when=asyncio.FIRST_COMPLETED)
    if lifespan.done():
        lifespan.result()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
            c.app = app  # type: ignore[attr-defined]
            if ready:
                await wait_ready(c)
            yield c
    finally:
        stop.set()
        await lifespan


@pytest.fixture
async def client(make_settings: Callable[..., Settings], fake_engine: FakeEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with serve_in_process(create_app(make_settings(), engine=fake_engine)) as c:
        yield c


async def wait_ready(c: httpx.AsyncClient) -> None:
    for _ in range(500):
        if (await c.get("/health")).status_code == 200:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the app never became ready")


def chat_body(content: str = "hello", *, stream: bool = False, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "fake-model", "messages": [{"role": "user", "content": content}],
                            "temperature": 0, "max_tokens": 16, "stream": stream}
    body.update(extra)
    return body


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server for the session (tests that restart it put it back on the same port)."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's Redis, emptied for this test (started again if a previous test left it down)."""
    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    redis_server.flushall()
    return redis_server.url
