"""Flushes and model changes reach every node of a fleet, through one Redis stream of events.

A flush on any node clears the shared store in Redis itself; the other nodes still hold copies in their memory
tiers and semantic indexes, and may be following flights computed before the flush. So a flush also bumps the
fleet's epoch (one counter; flight keys carry it, so no request after a flush joins a flight from before it) and is
appended to the events stream, which every node follows and applies to its own layers. A node that was cut off from
Redis reads the events it missed when the link comes back, from the last one it applied.

A model change needs no event to be correct: every key carries the model version. Nodes announce the version they
loaded, so a mixed fleet (a rolling upgrade) shows in the log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec

from edgecache.fleet.link import LinkDown, RedisLink, SkippedRecords

log = logging.getLogger("edgecache.fleet")

EVENTS = "ec:events"
EPOCH = "ec:epoch"
EVENTS_KEPT = 10_000  # roughly; a node cut off for longer than this many flushes resyncs by dropping its copies


class FleetEvent(msgspec.Struct, frozen=True, kw_only=True):
    kind: str                     # "flush" | "model"
    origin: str                   # the node that sent it
    tenant: str | None = None     # flush: None means every tenant
    scenario: str | None = None   # flush: None means every scenario
    epoch: int = 0                # flush: the epoch it started
    version: str | None = None    # model: the version the node loaded


FlushHandler = Callable[[str | None, str | None], Awaitable[None]]


class FleetEvents:
    """Publishes this node's flushes and applies everyone else's; keeps :attr:`epoch` current."""

    def __init__(self, link: RedisLink, node_id: str, on_flush: FlushHandler,
                 skips: SkippedRecords | None = None) -> None:
        self._link = link
        self.skips = skips or SkippedRecords()
        self.node_id = node_id
        self._on_flush = on_flush
        self.epoch = 0
        self._cursor: bytes | None = None  # the last event applied; None: start from now
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FleetEvent)
        self._task: asyncio.Task[None] | None = None
        self.applied = 0
        self._closing = False

    async def start(self) -> None:
        self._link.on_reconnect(self._resync)
        if self._link.up:
            await self._resync()
        self._task = asyncio.create_task(self._follow(), name="fleet-events")

    async def publish_flush(self, tenant: str | None, scenario: str | None) -> int:
        """Start a new epoch and tell every node; returns the epoch. Raises LinkDown when Redis is away."""
        client = self._link.client
        self.epoch = int(await self._link.run(client.incr(EPOCH)))
        event = FleetEvent(kind="flush", origin=self.node_id, tenant=tenant, scenario=scenario, epoch=self.epoch)
        await self._link.run(client.xadd(EVENTS, {"e": self._encoder.encode(event)}, maxlen=EVENTS_KEPT,
                                         approximate=True))
        return self.epoch

    async def announce_model(self, version: str) -> None:
        event = FleetEvent(kind="model", origin=self.node_id, version=version)
        try:
            await self._link.run(self._link.client.xadd(EVENTS, {"e": self._encoder.encode(event)},
                                                        maxlen=EVENTS_KEPT, approximate=True))
        except LinkDown:
            pass

    async def _resync(self) -> None:
        """(Re)connected: read the epoch; events missed while away are read next by the follower."""
        raw = await self._link.run(self._link.client.get(EPOCH))
        self.epoch = int(raw or 0)
        if self._cursor is None:
            # First contact: start after the newest event; older flushes were applied to Redis already, and this
            # node's own copies are empty at start.
            last = await self._link.run(self._link.client.xrevrange(EVENTS, count=1))
            self._cursor = last[0][0] if last else b"0-0"

    async def _follow(self) -> None:
        while not self._closing:
            if self._cursor is None:  # not reached Redis yet: _resync sets it
                await asyncio.sleep(0.2)
                continue
            for _, entry_id, fields in await self._link.read_after({EVENTS: self._cursor}, count=100):
                self._cursor = entry_id
                await self._apply(fields)

    async def _apply(self, fields: dict[bytes, bytes]) -> None:
        try:
            event = self._decoder.decode(fields[b"e"])
        except (KeyError, msgspec.DecodeError) as exc:
            self.skips.skip("events", exc)
            return
        if event.kind == "flush":
            self.epoch = max(self.epoch, event.epoch)
            if event.origin != self.node_id:
                log.info("flush from node %s: tenant=%s scenario=%s", event.origin, event.tenant or "*",
                         event.scenario or "*")
                try:
                    await self._on_flush(event.tenant, event.scenario)
                except Exception as exc:  # one flush that fails here must not stop the later ones
                    self.skips.skip("events", exc)
                    return
                self.applied += 1
        elif event.kind == "model" and event.origin != self.node_id:
            log.info("node %s serves model version %s", event.origin, event.version)

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])
            self._task = None
