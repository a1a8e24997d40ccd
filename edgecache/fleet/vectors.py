"""The semantic layer across a fleet: every node keeps its own usearch index, fed by the others' additions.

A vector added on one node (its answer was just stored in the shared store) is appended to a Redis stream of its
tenant, ``ec:{<tenant>}:v:<embedder version>`` (in the tenant's hash slot on a cluster), with the prompt's text and
the vector itself (float16); a set, ``ec:v:<embedder version>:streams``, names every tenant's stream. Every node
follows every tenant's stream and adds what others added to its own index, so a paraphrase first answered on node A
is a semantic hit on node B a moment later. On one Redis a node reads every stream in one blocking XREAD; on a
cluster, where one command reads one slot, one XREAD per tenant's slot, sent together, polled while they are quiet
(:meth:`~edgecache.fleet.link.RedisLink.read_after`). Each node keeps its read position per stream in a file beside its
indexes and, after a restart, replays the streams from there; applying a record twice is harmless (a vector for a
store key replaces the one before).

Removals are not broadcast. The shared store is the truth: a node whose vector points at an answer that expired
or was flushed finds the store entry gone on its next hit, drops the vector itself and treats it as a miss (the
same path a single box takes), so a stale vector costs one lookup and never serves a stale answer. A flush reaches
every node's indexes through the flush event (:mod:`edgecache.fleet.events`).

Vectors from another embedder are never mixed in: the stream name carries the embedder version.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from edgecache.fleet.link import LinkDown, RedisLink, SkippedRecords, tenant_prefix

log = logging.getLogger("edgecache.fleet")

STREAM_KEPT = 200_000  # records per tenant stream, roughly: a node away for longer rebuilds from new traffic
QUEUE_MAX = 10_000
BULK_PIPELINE = 1_000  # records per Redis round trip when a warmup's batch is published
BULK_WAIT_S = 60.0     # longest a warmup batch waits for Redis (each round trip is bounded by the link's timeout)


class VectorRecord(msgspec.Struct, frozen=True, array_like=True):
    origin: str
    tenant: str
    index: str       # the index within the tenant (scenario + namespace)
    store_key: str
    text: str
    vector: bytes    # float16


class SharedIndex:
    """A :class:`~edgecache.semantic.index.SemanticIndex` whose additions also go to the fleet's streams.

    Everything but the additions (``add``, and ``add_many``, a warmup's) is the local index's own (reads,
    removals, drops, saves): :meth:`__getattr__` passes them through, so the semantic cache cannot tell the two
    apart. An addition left to :meth:`__getattr__` would silently stay on this node, as a warmup's once did.
    """

    def __init__(self, local: Any, feed: VectorFeed) -> None:
        self.local = local
        self._feed = feed

    def add(self, tenant: str, scenario: str, vector: np.ndarray, store_key: str, text: str,
            bounds: Any = None) -> int:
        key = self.local.add(tenant, scenario, vector, store_key, text, bounds)
        self._feed.published_from_thread(VectorRecord(
            origin=self._feed.node_id, tenant=tenant, index=scenario, store_key=store_key, text=text,
            vector=np.asarray(vector, dtype=np.float16).tobytes()))
        return key

    def add_many(self, tenant: str, scenario: str, vectors: np.ndarray, store_keys: Sequence[str],
                 texts: Sequence[str], bounds: Any = None, threads: int = 0) -> list[int]:
        keys = self.local.add_many(tenant, scenario, vectors, store_keys, texts, bounds, threads)
        halves = np.asarray(vectors, dtype=np.float16).reshape(len(store_keys), -1)
        self._feed.published_many_from_thread([
            VectorRecord(origin=self._feed.node_id, tenant=tenant, index=scenario, store_key=store_key, text=text,
                         vector=vector.tobytes())
            for store_key, text, vector in zip(store_keys, texts, halves)])
        return list(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)


class VectorFeed:
    """Publishes this node's additions and applies everyone else's to the local index."""

    def __init__(self, link: RedisLink, node_id: str, *, embedder_version: str, local_index: Any,
                 cursor_file: Path, cap_for: Any,
                 index_thread: Callable[[Callable[[], None]], Awaitable[object]],
                 skips: SkippedRecords | None = None) -> None:
        self._link = link
        self.skips = skips or SkippedRecords()
        self.node_id = node_id
        self._embedder_version = embedder_version
        self._registry = f"ec:v:{embedder_version}:streams"
        self._index = local_index
        self._cap_for = cap_for
        # The semantic cache's own index thread: every index call runs there, in order with lookups and adds.
        self._index_thread = index_thread
        self._cursor_file = cursor_file
        self._cursors: dict[str, str] = self._load_cursors()
        self._queue: asyncio.Queue[VectorRecord] = asyncio.Queue(QUEUE_MAX)
        self._loop = asyncio.get_running_loop()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(VectorRecord)
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self.applied = 0
        self.dropped = 0

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._publish(), name="vector-publish"),
                       asyncio.create_task(self._follow(), name="vector-follow")]

    def published_from_thread(self, record: VectorRecord) -> None:
        """Called on the index thread: hand the record to the event loop."""
        self._loop.call_soon_threadsafe(self._enqueue, record)

    def published_many_from_thread(self, records: list[VectorRecord]) -> None:
        """Called on the index thread with a warmup's batch: published before the call returns, so a warmup of
        100k lines is neither held in memory nor dropped by the single additions' queue. Waiting here holds the
        index thread the way the batch's own insert did; Redis away drops the batch (the others compute)."""
        future = asyncio.run_coroutine_threadsafe(self._publish_many(records), self._loop)
        try:
            future.result(timeout=BULK_WAIT_S)
        except TimeoutError:
            future.cancel()
            self.dropped += len(records)

    async def _publish_many(self, records: list[VectorRecord]) -> None:
        for start in range(0, len(records), BULK_PIPELINE):
            part = records[start:start + BULK_PIPELINE]
            if not self._link.up:
                self.dropped += len(part)
                continue
            pipe = self._link.client.pipeline(transaction=False)
            for record in part:
                pipe.xadd(self.stream(record.tenant), {"r": self._encoder.encode(record)},
                          maxlen=STREAM_KEPT, approximate=True)
            pipe.sadd(self._registry, *{self.stream(record.tenant) for record in part})
            try:
                await self._link.run(pipe.execute())
            except LinkDown:
                self.dropped += len(part)

    def stream(self, tenant: str) -> str:
        """The tenant's stream of vectors from this embedder."""
        return f"{tenant_prefix(tenant)}v:{self._embedder_version}"

    def _enqueue(self, record: VectorRecord) -> None:
        try:
            self._queue.put_nowait(record)
        except asyncio.QueueFull:
            self.dropped += 1  # Redis is slow or away: the others will compute this one themselves

    async def _publish(self) -> None:
        while not self._closing:
            record = await self._queue.get()
            if not self._link.up:
                self.dropped += 1
                continue
            stream = self.stream(record.tenant)
            pipe = self._link.client.pipeline(transaction=False)
            pipe.xadd(stream, {"r": self._encoder.encode(record)}, maxlen=STREAM_KEPT, approximate=True)
            pipe.sadd(self._registry, stream)
            try:
                await self._link.run(pipe.execute())
            except LinkDown:
                self.dropped += 1

    async def _follow(self) -> None:
        while not self._closing:
            if not self._link.up:
                await asyncio.sleep(0.2)
                continue
            try:  # the link's client as it is now (a cluster's, once first contact found one)
                streams = sorted(s.decode() for s in await self._link.run(self._link.client.smembers(self._registry)))
            except LinkDown:
                continue
            if not streams:
                await asyncio.sleep(self._link.block_ms / 1000)
                continue
            entries = await self._link.read_after({s: self._cursors.get(s, "0-0") for s in streams}, count=512)
            if entries:
                await self._apply(entries)

    async def _apply(self, entries: list[tuple[str, Any, dict[bytes, bytes]]]) -> None:
        records: list[VectorRecord] = []
        for stream, entry_id, fields in entries:
            self._cursors[stream] = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            try:
                record = self._decoder.decode(fields[b"r"])
            except (KeyError, msgspec.DecodeError) as exc:
                self.skips.skip("vectors", exc)
                continue
            if record.origin != self.node_id:
                records.append(record)
        failed: list[BaseException | str] = []

        def apply() -> int:
            applied = 0
            for record in records:
                if len(record.vector) != 2 * self._index.dim:
                    failed.append(f"a vector of {len(record.vector)} bytes, not {2 * self._index.dim}")
                    continue
                try:
                    vector = np.frombuffer(record.vector, dtype=np.float16).astype(np.float32)
                    self._index.remove_store_key(record.tenant, record.index, record.store_key)
                    self._index.add(record.tenant, record.index, vector, record.store_key, record.text,
                                    self._cap_for(record.tenant))
                except (ValueError, TypeError, KeyError) as exc:  # one record; the feed goes on
                    failed.append(exc)
                    continue
                applied += 1
            self._save_cursors()
            return applied

        applied = await self._index_thread(apply)
        for why in failed:
            self.skips.skip("vectors", why)
        self.applied += int(applied)  # type: ignore[call-overload]

    def _load_cursors(self) -> dict[str, str]:
        try:
            raw = msgspec.json.decode(self._cursor_file.read_bytes(), type=dict[str, str])
        except (OSError, msgspec.DecodeError):
            return {}
        return raw

    def _save_cursors(self) -> None:
        # Written after the records it covers are committed to the index's SQLite: a kill in between replays
        # them, which is harmless.
        tmp = self._cursor_file.with_name(self._cursor_file.name + ".tmp")
        try:
            tmp.write_bytes(msgspec.json.encode(self._cursors))
            os.replace(tmp, self._cursor_file)
        except OSError as exc:
            log.warning("could not save the vector stream positions (%s); a restart replays more", exc)

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        self._tasks = []
