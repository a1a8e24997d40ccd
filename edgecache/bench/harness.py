"""What every measurement shares: a free port, a server started (in a subprocess, or in this process behind an ASGI
client) and awaited until ready, a process's CPU time, percentiles, and where the data sets live."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO, Any

import httpx

#: The data sets the measurements read (``shared/data`` beside the checkout); never shipped with the package.
DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system) process ``pid`` has used so far (Linux). On a busy box a server's CPU time per
    request moves far less than its requests/s, so measurements report both."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank (NaN when there are none)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def edgecache_command(*args: str) -> list[str]:
    """``edgecache ARGS``: the installed command, or this interpreter's ``-m edgecache.cli.main``."""
    exe = shutil.which("edgecache")
    return [exe, *args] if exe else [sys.executable, "-m", "edgecache.cli.main", *args]


def serve_command(*args: str) -> list[str]:
    """``edgecache serve ARGS``."""
    return edgecache_command("serve", *args)


def start_server(args: Sequence[str], *, env: Mapping[str, str] | None = None, log: IO[Any] | None = None,
                 clean_env: bool = False, **popen: Any) -> subprocess.Popen:
    """``edgecache serve ARGS`` in a subprocess, its output to ``log`` (inherited when None). ``env`` is added to
    this process's environment; ``clean_env`` first drops every ``EDGECACHE_`` variable of it."""
    base = {k: v for k, v in os.environ.items() if not (clean_env and k.startswith("EDGECACHE_"))}
    return subprocess.Popen(serve_command(*args), env={**base, **(env or {})}, stdout=log,
                            stderr=subprocess.STDOUT if log is not None else None, **popen)


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Ask ``proc`` to exit (SIGTERM) and wait up to ``timeout`` seconds; then kill it and reap it."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_ready(url: str, proc: subprocess.Popen | None = None, *, path: str = "/health",
               ready: Sequence[int] = (200,), timeout: float = 300, poll_s: float = 0.2) -> None:
    """Until ``url + path`` answers one of ``ready``; SystemExit when ``proc`` exits first or ``timeout`` passes."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server for {url} exited early (rc {proc.returncode}); see its log")
        try:
            if httpx.get(url + path, timeout=2).status_code in ready:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise SystemExit(f"server at {url} did not become ready")


async def wait_healthy(client: httpx.AsyncClient, *, attempts: int = 12_000) -> None:
    """Until the app behind ``client`` says /health 200 (polled every 10 ms)."""
    for _ in range(attempts):
        if (await client.get("/health")).status_code == 200:
            return
        await asyncio.sleep(0.01)
    raise RuntimeError("the app never became ready")


@asynccontextmanager
async def serve_in_process(app: Any, *, ready: bool = True,
                           base_url: str = "http://testserver") -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan running, behind an httpx client on the same event loop (``client.app`` is the app).

    (litestar's AsyncTestClient runs the app on a portal thread and blocks the caller's loop per request, so
    concurrent requests would run one at a time; httpx's ASGI transport keeps them concurrent.)
    """
    started, stop = asyncio.Event(), asyncio.Event()

    async def run_lifespan() -> None:
        # One task enters and leaves the lifespan: anyio's cancel scopes inside it must not change task, and
        # pytest-asyncio runs an async fixture's setup and teardown in different tasks.
        async with app.lifespan():
            started.set()
            await stop.wait()

    lifespan = asyncio.create_task(run_lifespan())
    waiter = asyncio.create_task(started.wait())
    await asyncio.wait([lifespan, waiter], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if lifespan.done():
        lifespan.result()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url) as client:
            client.app = app  # type: ignore[attr-defined]
            if ready:
                await wait_healthy(client)
            yield client
    finally:
        stop.set()
        await lifespan
