"""The connection to the fleet's Redis: one client, its health, and reconnection by itself.

Every Redis backend (result store, flights, events, vectors) talks through one :class:`RedisLink`. While Redis is
unreachable the link says so (:attr:`RedisLink.up` is False) and the backends skip Redis at once instead of waiting
a timeout per request: a node keeps serving from its memory tier and its engine. A monitor task pings Redis and
flips the link back up when it answers, then runs the callbacks registered with :meth:`on_reconnect` (for example
the event follower re-reads what it missed).

``redis`` is imported here and only here (and in the backends that need this link), lazily: a single box with
``store.backend = "disk"`` never imports it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:
    from redis.asyncio import Redis

log = logging.getLogger("edgecache.fleet")


def tenant_part(tenant: str) -> str:
    """A tenant's name as one Redis key segment: ``:`` and other separators quoted, so no name reaches another's
    keys. Every backend that names keys by tenant (the store, the vector streams) uses this one spelling."""
    return quote(tenant, safe="-_.")


class RedisLink:
    """One Redis client for the whole node, with an up/down state the request path can read for free."""

    def __init__(self, url: str, *, timeout_s: float, check_interval_s: float = 1.0,
                 on_state: Callable[[bool], None] | None = None) -> None:
        import redis.asyncio
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import RedisError

        self.url = url
        self.timeout_s = timeout_s
        self.check_interval_s = check_interval_s
        # No client-side retries: a failed command marks the link down at once and the monitor decides when it
        # is back, so a request never waits out several connection attempts.
        self.client: Redis = redis.asyncio.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False)
        self.errors: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError)
        self.up = False
        self.error: str | None = "not connected yet"
        self.down_since: float | None = time.time()
        self.disconnects = 0
        self._on_state = on_state
        self._reconnect_callbacks: list[Callable[[], Awaitable[None]]] = []
        self._monitor: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def block_ms(self) -> int:
        """How long a blocking read (XREAD BLOCK) may wait: well inside the socket timeout, or it would count as
        Redis being down."""
        return max(20, min(1000, int(self.timeout_s * 500)))

    async def start(self) -> None:
        """Try once (a node whose Redis is down still starts), then keep watching."""
        await self._check()
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._watch(), name="redis-link")

    def on_reconnect(self, callback: Callable[[], Awaitable[None]]) -> None:
        self._reconnect_callbacks.append(callback)

    def failed(self, exc: BaseException) -> None:
        """A command failed: mark the link down until the monitor gets an answer again."""
        reason = f"{type(exc).__name__}: {exc}"
        if self.up:
            self.disconnects += 1
            self.down_since = time.time()
            log.warning("redis %s unreachable (%s); serving from this node's memory tier and engine", self.url,
                        reason)
            self._set(False)
        self.error = reason

    async def run(self, command: Awaitable[Any]) -> Any:
        """Await a Redis command; a connection failure marks the link down and is raised as :class:`LinkDown`."""
        try:
            return await command
        except self.errors as exc:
            _reraise_cancellation(exc)
            self.failed(exc)
            raise LinkDown(self.error or "redis unreachable") from exc

    async def read_after(self, cursors: dict[str, bytes | str],
                         count: int) -> list[tuple[str, Any, dict[bytes, bytes]]]:
        """The followers' one read: entries of each stream after its cursor (the last id read), as ``(stream, id,
        fields)``, waiting up to :attr:`block_ms` for the first. While Redis is away: a short pause, then nothing
        (the caller's loop comes back, and reads on once the link is up)."""
        if not self.up:
            await asyncio.sleep(0.2)
            return []
        try:
            batch = await self.run(self.client.xread(cursors, count=count, block=self.block_ms))
        except LinkDown:
            return []
        return [(stream.decode() if isinstance(stream, bytes) else stream, entry_id, fields)
                for stream, entries in batch or () for entry_id, fields in entries]

    def state(self) -> dict[str, Any]:
        """For /health: up or down, since when, and why."""
        out: dict[str, Any] = {"up": self.up, "url": redact(self.url), "disconnects": self.disconnects}
        if not self.up:
            out["error"] = self.error
            if self.down_since is not None:
                out["down_s"] = round(time.time() - self.down_since, 1)
        return out

    async def _check(self) -> None:
        try:
            await self.client.ping()
        except self.errors as exc:
            _reraise_cancellation(exc)
            self.failed(exc)
            return
        if not self.up:
            was_down = self.down_since is not None and self.disconnects > 0
            self.error, self.down_since = None, None
            self._set(True)
            log.info("redis %s %s", redact(self.url), "reconnected" if was_down else "connected")
            for callback in self._reconnect_callbacks:
                try:
                    await callback()
                except self.errors as exc:
                    self.failed(exc)
                    return

    async def _watch(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.check_interval_s)
            await self._check()

    def _set(self, up: bool) -> None:
        self.up = up
        if self._on_state is not None:
            self._on_state(up)

    async def close(self) -> None:
        self._closing = True
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.wait([self._monitor])
            self._monitor = None
        await self.client.aclose()


def _reraise_cancellation(exc: BaseException) -> None:
    """redis-py can turn a cancellation that lands inside a command into a ConnectionError ("Connection closed by
    server"). A cancelled task (a client that left, a shutdown) is not Redis failing: let it stop instead of
    marking the link down."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError() from exc


class LinkDown(Exception):
    """Redis did not answer; the caller falls back to what this node has on its own."""


def redact(url: str) -> str:
    """The URL without its password, for logs and /health."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
