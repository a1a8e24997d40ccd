from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

# The app served in process and awaited until ready: the benchmarks' harness, which the tests share.
from edgecache.bench.harness import serve_in_process
from edgecache.bench.harness import wait_healthy as wait_ready  # noqa: F401 (tests import it from here)
from edgecache.http.app import create_app
from edgecache.settings import Settings, resolve_settings
from tests.fakes import FakeEngine
from tests.real_server import Server
from edgecache.bench.redis_servers import RedisCluster, RedisServer


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


@pytest.fixture
async def client(make_settings: Callable[..., Settings], fake_engine: FakeEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with serve_in_process(create_app(make_settings(), engine=fake_engine)) as c:
        yield c


def chat_body(content: str = "hello", *, stream: bool = False, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "fake-model", "messages": [{"role": "user", "content": content}],
                            "temperature": 0, "max_tokens": 16, "stream": stream}
    body.update(extra)
    return body


async def until(condition: Callable[[], bool], what: str = "the condition", *, patience_s: float = 120.0) -> None:
    """Until ``condition`` holds: an event the test waits on, never a speed it assumes (the bound is only there so
    a lost event fails the test, naming ``what``, instead of hanging it)."""
    deadline = time.monotonic() + patience_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} never held in {patience_s:g} s")
        await asyncio.sleep(0.01)


#: Set by .ci/run: there a service the tests need and cannot find is a failure. Elsewhere (a fresh box after the
#: README's install) such tests skip, saying what to install.
SERVICES_REQUIRED = os.environ.get("TESTS_REQUIRE_SERVICES") == "1"


def require_binary(name: str, install: str) -> str:
    """The path of ``name``; or the test skips (fails under TESTS_REQUIRE_SERVICES=1), saying how to install it."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed here ({install})"
        if SERVICES_REQUIRED:
            pytest.fail(message + "; TESTS_REQUIRE_SERVICES=1 makes that a failure")
        pytest.skip(message)
    return path


REDIS_INSTALL = "Debian/Ubuntu: apt-get install redis-server redis-tools"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server for the session (tests that restart it put it back on the same port)."""
    require_binary("redis-server", REDIS_INSTALL)
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's Redis, emptied for this test (started again if a previous test left it down)."""
    return redis_server.fresh()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """One real Redis Cluster (three primaries) for the session."""
    require_binary("redis-server", REDIS_INSTALL)
    require_binary("redis-cli", REDIS_INSTALL)
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.kill()


@pytest.fixture(params=["single", "cluster"])
def fleet_redis_url(request: pytest.FixtureRequest) -> str:
    """For a test that must hold on one Redis and on a Redis Cluster alike: it runs on each, emptied for it (the
    URL of the session's Redis, or of one node of the session's cluster)."""
    if request.param == "single":
        return str(request.getfixturevalue("redis_url"))
    cluster: RedisCluster = request.getfixturevalue("redis_cluster")
    cluster.flushall()
    return cluster.url


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real `edgecache serve --profile cpu` (llama.cpp and SmolLM2) for one test module, the semantic layer off:
    the API modules test exact hits and what each API says, so a near question must reach the engine. A module that
    needs another server (flags, the semantic layer) defines its own ``server``."""
    srv = Server(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]) / "data",
                 env={"EDGECACHE_SEMANTIC__ENABLED": "false"}).start()
    yield srv
    srv.stop()


@contextmanager
def front_server(data_dir: Path, upstream_url: str, *extra: str) -> Iterator[Server]:
    """A real `edgecache serve --upstream URL` (``extra``: more flags) for the block, with the semantic layer off so
    that a miss at the front is a call to the upstream; stopped when the block ends."""
    front = Server(data_dir, "--upstream", upstream_url, *extra, env={"EDGECACHE_SEMANTIC__ENABLED": "false"})
    try:
        yield front.start()
    finally:
        if front.proc is not None:
            front.stop()
