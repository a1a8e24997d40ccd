"""The semantic learner's labels across a fleet: what one node learns about a shared answer, every node learns.

Each node decides its own semantic lookups (``semantic.decision = "learner"``), but the answers and their vectors
are the fleet's. A label is a verdict on a shared answer: the answer cached for ``store_key`` did, or did not, serve
a query at ``similarity``. That verdict holds on every node. So each label this node's learner is taught is
appended to one Redis stream, ``ec:labels``, and every other node teaches it to its own learner. Without it a fleet
of N nodes pays N explorations to learn what one node already knew, and an answer demoted for serving wrong answers
on one node is still served by the others.

Best effort, like a label on one box. A label lost to a Redis outage or a full queue costs what it would have
taught, never correctness: the learner's bound holds for what it was taught. The stream is capped. A node starts
from the stream's end, since what it learned before a restart comes back from its own decision log; a node cut off
resumes from its last read, or from the oldest label left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from edgecache.fleet.link import LinkDown, RedisLink, SkippedRecords

log = logging.getLogger("edgecache.fleet")

LABELS = "ec:labels"
LABELS_KEPT = 100_000  # roughly: labels come at the rate of misses and explorations, a few per second at most
QUEUE_MAX = 10_000


class SharedTeaching(msgspec.Struct, frozen=True, array_like=True):
    """What a tenant's grouped warmup lines taught (:mod:`edgecache.semantic.teaching`): answer classes (store keys)
    and labels ``(store key, similarity, right?, the query's nearest?)``."""

    classes: list[list[str]]
    labels: list[tuple[str, float, bool, bool]]
    #: As :class:`edgecache.semantic.teaching.Taught` has them (empty from a node that does not send them).
    namespace: str = ""
    groups: list[str] = []
    variants: list[str] = []


class SharedLabel(msgspec.Struct, frozen=True, array_like=True):
    """One learner label, as :meth:`edgecache.semantic.cache.SemanticCache.learn` is taught it, or (``taught``) one
    teaching of a tenant's groups, which every node teaches its learner and keeps as its own."""

    origin: str                 # the node that got the label
    tenant: str
    scenario: str
    store_key: str              # the cached answer the label is about
    similarity: float           # of the query it was (or was not) right for
    good: bool | None           # None: compared, and no labeler could tell (taught as wrong)
    answer_key: str | None      # the answer cached for that query, linked to store_key's class when good
    taught: SharedTeaching | None = None  # a teaching: the fields above are then empty


class LabelFeed:
    """Publishes this node's learner labels and hands everyone else's to ``on_label``."""

    def __init__(self, link: RedisLink, node_id: str, on_label: Callable[[SharedLabel], None],
                 skips: SkippedRecords | None = None) -> None:
        self._link = link
        self.skips = skips or SkippedRecords()
        self.node_id = node_id
        self._on_label = on_label
        self._queue: asyncio.Queue[SharedLabel] = asyncio.Queue(QUEUE_MAX)
        self._cursor: bytes | None = None  # the last label read; None: start from the stream's end
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(SharedLabel)
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self.published = 0
        self.applied = 0
        self.dropped = 0

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._publish(), name="label-publish"),
                       asyncio.create_task(self._follow(), name="label-follow")]

    def publish(self, tenant: str, scenario: str, store_key: str, similarity: float, good: bool | None,
                answer_key: str | None) -> None:
        """Queue a label this node's learner was taught, for the fleet (on the event loop; never blocks)."""
        label = SharedLabel(origin=self.node_id, tenant=tenant, scenario=scenario, store_key=store_key,
                            similarity=similarity, good=good, answer_key=answer_key)
        try:
            self._queue.put_nowait(label)
        except asyncio.QueueFull:
            self.dropped += 1

    def publish_taught(self, tenant: str, scenario: str, taught: SharedTeaching) -> None:
        """Queue what a tenant's groups taught this node, for the fleet (on the event loop; never blocks)."""
        label = SharedLabel(origin=self.node_id, tenant=tenant, scenario=scenario, store_key="", similarity=0.0,
                            good=None, answer_key=None, taught=taught)
        try:
            self._queue.put_nowait(label)
        except asyncio.QueueFull:
            self.dropped += 1

    def state(self) -> dict[str, int]:
        """Labels sent to the fleet, taken from it, and lost (Redis away, or the queue full)."""
        return {"published": self.published, "applied": self.applied, "dropped": self.dropped}

    async def _publish(self) -> None:
        while not self._closing:
            label = await self._queue.get()
            if not self._link.up:
                self.dropped += 1
                continue
            try:
                await self._link.run(self._link.client.xadd(LABELS, {"l": self._encoder.encode(label)},
                                                            maxlen=LABELS_KEPT, approximate=True))
                self.published += 1
            except LinkDown:
                self.dropped += 1

    async def _follow(self) -> None:
        while not self._closing:
            if self._cursor is None:
                if not await self._start_at_the_end():
                    await asyncio.sleep(0.2)
                continue
            for _, entry_id, fields in await self._link.read_after({LABELS: self._cursor}, count=512):
                self._cursor = entry_id
                self._apply(fields)

    async def _start_at_the_end(self) -> bool:
        """Set the cursor after the newest label (what this node learned before comes from its own log)."""
        if not self._link.up:
            return False
        try:
            last = await self._link.run(self._link.client.xrevrange(LABELS, count=1))
        except LinkDown:
            return False
        self._cursor = last[0][0] if last else b"0-0"
        return True

    def _apply(self, fields: dict[bytes, bytes]) -> None:
        try:
            label = self._decoder.decode(fields[b"l"])
        except (KeyError, msgspec.DecodeError) as exc:
            self.skips.skip("labels", exc)
            return
        if label.origin != self.node_id:
            try:
                self._on_label(label)
            except Exception as exc:  # one label that cannot be taught must not stop the follower for all the others
                self.skips.skip("labels", exc)
                return
            self.applied += 1

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        self._tasks = []
