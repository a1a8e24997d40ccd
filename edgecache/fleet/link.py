"""The connection to the fleet's Redis: one client, its health, and reconnection by itself.

Every Redis backend (result store, flights, events, vectors) talks through one :class:`RedisLink`. While Redis is
unreachable the link says so (:attr:`RedisLink.up` is False) and the backends skip Redis at once instead of waiting
a timeout per request: a node keeps serving from its memory tier and its engine. A monitor task pings Redis and
flips the link back up when it answers, then runs the callbacks registered with :meth:`on_reconnect` (for example
the event follower re-reads what it missed).

The URL may name one Redis or any node of a Redis Cluster: at first contact the link asks (``INFO cluster``) and,
for a cluster, swaps its client for a cluster client that routes each command to the primary holding its key's
slot. The backends do not tell the two apart, because every command they send touches one slot: each key of a
tenant starts with the tenant's hash tag (:func:`tenant_prefix`), so its scripts and bookkeeping share a slot; the
other keys are read and written one at a time; and the streams are read through :meth:`RedisLink.xread` and
:meth:`RedisLink.read_after`, which never put two slots in one command. On a cluster the link is up while every
primary answers: a primary lost makes the node serve on its own, as a single Redis lost does, until the cluster
has failed over.

``redis`` is imported here and only here (and in the backends that need this link), lazily: a single box with
``store.backend = "disk"`` never imports it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

log = logging.getLogger("edgecache.fleet")


def tenant_part(tenant: str) -> str:
    """A tenant's name as one Redis key segment: ``:``, braces and other separators quoted, so no name reaches
    another's keys or hash tag."""
    return quote(tenant, safe="-_.")


def tenant_prefix(tenant: str) -> str:
    """The start of every key of a tenant (results, their bookkeeping, stored responses, vector stream):
    ``ec:{<tenant>}:``. The braces are the tenant's hash tag: on a cluster all its keys hash to one slot, so the
    scripts that touch several of them run there."""
    return f"ec:{{{tenant_part(tenant)}}}:"


class LinkScript:
    """A Lua script run through the link's client, whichever it is (one Redis, or a cluster: there the primary
    holding its first key's slot). Called like redis-py's scripts: ``await script(keys=[...], args=[...])``, or
    with ``client=`` a pipeline to queue it there."""

    def __init__(self, link: RedisLink, text: str) -> None:
        self._link = link
        self._script = link.client.register_script(text)  # its SHA, and its loading when Redis lacks it

    def __call__(self, keys: list[str], args: list[Any] | tuple[Any, ...] = (), client: Any = None) -> Any:
        target = client if client is not None else self._link.client
        if client is not None and self._link.cluster:
            # A cluster pipeline cannot load a script a primary lacks (a replica promoted since has none): send
            # the text, which Redis compiles once and caches. (Awaiting redis-py's cluster pipeline would empty
            # its queue: the awaitable returned is not the pipeline's.)
            target.eval(self._script.script, len(keys), *keys, *args)
            return _queued(target)
        return self._script(keys=keys, args=args, client=target)


async def _queued(pipeline: Any) -> Any:
    return pipeline


class RedisLink:
    """One Redis client for the whole node, with an up/down state the request path can read for free."""

    def __init__(self, url: str, *, timeout_s: float, check_interval_s: float = 1.0,
                 on_state: Callable[[bool], None] | None = None) -> None:
        import redis.asyncio
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import RedisClusterException, RedisError

        self.url = url
        self.timeout_s = timeout_s
        self.check_interval_s = check_interval_s
        # No client-side retries: a failed command marks the link down at once and the monitor decides when it
        # is back, so a request never waits out several connection attempts.
        self._options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                                         "retry": Retry(NoBackoff(), 0)}
        # A Redis until first contact says it is a cluster node, then a RedisCluster (see _detect); the backends
        # call what both have.
        self.client: Any = redis.asyncio.Redis.from_url(url, retry_on_timeout=False, **self._options)
        self.cluster = False
        self.primaries = 1
        self._detected = False
        # A cluster with no reachable node, or a slot no primary covers, is a RedisClusterException (not a
        # RedisError): Redis away all the same.
        self.errors: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError,
                                                        asyncio.TimeoutError)
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

    def script(self, text: str) -> LinkScript:
        return LinkScript(self, text)

    def slot(self, key: str) -> int:
        """The cluster hash slot of ``key`` (its hash tag's, when it has one)."""
        from redis.crc import key_slot

        return int(key_slot(key.encode()))

    async def xread(self, cursors: dict[str, bytes | str], *, count: int,
                    block_ms: int | None = None) -> list[tuple[str, Any, dict[bytes, bytes]]]:
        """XREAD of streams in one slot (one stream, or a tenant's): entries after each cursor, as ``(stream, id,
        fields)``. On a cluster it goes straight to the primary holding the slot. Raises :class:`LinkDown`."""
        if self.cluster:
            pieces: list[Any] = ["XREAD", "COUNT", count]
            if block_ms is not None:
                pieces += ["BLOCK", block_ms]
            pieces += ["STREAMS", *cursors, *cursors.values()]
            client: Any = self.client
            node = client.get_node_from_key(next(iter(cursors)))
            batch = await self.run(client.execute_command(*pieces, target_nodes=node))
        else:
            batch = await self.run(self.client.xread(cursors, count=count, block=block_ms))
        return [(stream.decode() if isinstance(stream, bytes) else stream, entry_id, fields)
                for stream, entries in batch or () for entry_id, fields in entries]

    async def read_after(self, cursors: dict[str, bytes | str],
                         count: int) -> list[tuple[str, Any, dict[bytes, bytes]]]:
        """The followers' one read: entries of each stream after its cursor (the last id read), as ``(stream, id,
        fields)``, waiting up to :attr:`block_ms` for the first. While Redis is away: a short pause, then nothing
        (the caller's loop comes back, and reads on once the link is up).

        One Redis reads every stream in one blocking XREAD. A cluster allows one slot per command: streams in
        one slot are read that way too, and streams over several slots with one XREAD per slot, sent together
        and not blocking, then a pause of :attr:`block_ms` when none had anything (a poll)."""
        if not self.up:
            await asyncio.sleep(0.2)
            return []
        by_slot: dict[int, dict[str, bytes | str]] = {}
        for stream, cursor in cursors.items():
            by_slot.setdefault(self.slot(stream) if self.cluster else 0, {})[stream] = cursor
        try:
            if len(by_slot) <= 1:
                return await self.xread(cursors, count=count, block_ms=self.block_ms)
            batches = await asyncio.gather(*(self.xread(group, count=count) for group in by_slot.values()))
        except LinkDown:
            return []
        entries = [entry for batch in batches for entry in batch]
        if not entries:
            await asyncio.sleep(self.block_ms / 1000)
        return entries

    def state(self) -> dict[str, Any]:
        """For /health: up or down, since when, and why; one Redis or a cluster (with its primaries)."""
        out: dict[str, Any] = {"up": self.up, "url": redact(self.url), "disconnects": self.disconnects}
        if self._detected:
            out["mode"] = "cluster" if self.cluster else "single"
            if self.cluster:
                out["primaries"] = self.primaries
        if not self.up:
            out["error"] = self.error
            if self.down_since is not None:
                out["down_s"] = round(time.time() - self.down_since, 1)
        return out

    async def _check(self) -> None:
        try:
            if not self._detected:
                await self._detect()
            if self.cluster:
                await self._check_cluster()
            else:
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

    async def _detect(self) -> None:
        """First contact: one Redis, or a node of a cluster (then the cluster client takes over from here)."""
        import redis.asyncio.cluster

        info = await self.client.info("cluster")
        if int(info.get("cluster_enabled", 0)) == 1:
            plain = self.client
            self.client = redis.asyncio.cluster.RedisCluster.from_url(self.url, **self._options)
            self.cluster = True
            await plain.aclose()
        self._detected = True

    async def _check_cluster(self) -> None:
        """Up while every primary answers. While down, the slot map is read again from any node each time, so a
        failover (a replica promoted in place of a lost primary) brings the link back up."""
        if not self.up:
            await self._fresh_cluster_client()
        client: Any = self.client
        primaries = self._primaries()
        await asyncio.gather(*(client.execute_command("PING", target_nodes=node) for node in primaries))
        self.primaries = len(primaries)

    async def _fresh_cluster_client(self) -> None:
        """A new cluster client, its nodes and slots read from any node this one knew (the URL's may be the one
        lost). The old client is closed first, so the commands still pending on it fail while the link is down."""
        import redis.asyncio.cluster

        old: Any = self.client
        known = [redis.asyncio.cluster.ClusterNode(node.host, node.port)
                 for node in old.nodes_manager.startup_nodes.values()]
        await _close_cluster_client(old)
        fresh = redis.asyncio.cluster.RedisCluster.from_url(self.url, startup_nodes=known, **self._options)
        self.client = fresh
        await fresh.initialize()

    def _primaries(self) -> list[Any]:
        """The cluster's primaries, as its slot map names them (redis-py's own list of primaries keeps a replica
        promoted by a failover as a replica)."""
        slots = self.client.nodes_manager.slots_cache.values()  # type: ignore[union-attr]
        return list({nodes[0].name: nodes[0] for nodes in slots}.values())

    async def scan(self, match: str) -> list[str]:
        """Every key matching ``match``: on a cluster, a SCAN on each primary. Raises :class:`LinkDown`."""
        found: list[str] = []
        try:
            if self.cluster:
                for node in self._primaries():
                    found += [k async for k in self.client.scan_iter(match=match, count=500, target_nodes=node)]
            else:
                found = [k async for k in self.client.scan_iter(match=match, count=500)]
        except self.errors as exc:
            _reraise_cancellation(exc)
            self.failed(exc)
            raise LinkDown(self.error or "redis unreachable") from exc
        return [k.decode() if isinstance(k, bytes) else str(k) for k in found]

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
        if self.cluster:
            await _close_cluster_client(self.client)
        else:
            await self.client.aclose()


async def _close_cluster_client(client: Any) -> None:
    """Close a cluster client's connections, those of the nodes its slot map holds included (after a failover
    redis-py's map holds node objects of its own, which its ``aclose`` leaves open)."""
    nodes = {id(node): node for nodes in client.nodes_manager.slots_cache.values() for node in nodes}
    await client.aclose()
    await asyncio.gather(*(node.disconnect() for node in nodes.values()))


def _reraise_cancellation(exc: BaseException) -> None:
    """redis-py can turn a cancellation that lands inside a command into a ConnectionError ("Connection closed by
    server"). A cancelled task (a client that left, a shutdown) is not Redis failing: let it stop instead of
    marking the link down."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError() from exc


class SkippedRecords:
    """Fleet records a feed could not decode or apply: each is skipped (the feed goes on with the next), counted by
    feed, and logged once per feed and kind of failure, so one bad record never stops a feed and a stream of them
    never floods the log. ``on_skip(feed)``: the runtime's counter (``edgecache_fleet_records_skipped_total``)."""

    #: A node whose feeds skipped records this recently says so on /health.
    RECENT_S = 300.0

    def __init__(self, on_skip: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.counts: dict[str, int] = {}
        self._on_skip = on_skip
        self._clock = clock
        self._logged: set[tuple[str, str]] = set()
        self._last: dict[str, float] = {}

    def skip(self, feed: str, why: BaseException | str) -> None:
        self.counts[feed] = self.counts.get(feed, 0) + 1
        self._last[feed] = self._clock()
        kind = why if isinstance(why, str) else type(why).__name__
        if (feed, kind) not in self._logged:
            self._logged.add((feed, kind))
            log.warning("fleet %s feed: skipped a record it could not use (%s); later ones of this kind are counted "
                        "in edgecache_fleet_records_skipped_total, not logged", feed, why)
        if self._on_skip is not None:
            self._on_skip(feed)

    def recent(self) -> dict[str, int]:
        """The feeds that skipped records within :attr:`RECENT_S`, with their counts since start."""
        now = self._clock()
        return {feed: self.counts[feed] for feed, at in self._last.items() if now - at <= self.RECENT_S}


class LinkDown(Exception):
    """Redis did not answer; the caller falls back to what this node has on its own."""


def redact(url: str) -> str:
    """The URL without its password, for logs and /health."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
