"""Past one box: what a node shares with the rest of its fleet through one Redis.

:class:`Fleet` is this node's membership: the link (:mod:`edgecache.fleet.link`), the flush and model events
(:mod:`edgecache.fleet.events`), the shared semantic vectors (:mod:`edgecache.fleet.vectors`) and the semantic
learner's labels (:mod:`edgecache.fleet.labels`). The Responses API's stored responses are the fleet's too
(:mod:`edgecache.fleet.responses`, opened by the HTTP front on this node's link). The shared layers' backends live
with their layers:
:mod:`edgecache.stores.redis` and :mod:`edgecache.inflight.redis`. Built only when ``store.backend = "redis"``; a
single box never imports any of it (nor the redis client).
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from edgecache.fleet.events import FleetEvents, FlushHandler
from edgecache.fleet.labels import LabelFeed, SharedLabel
from edgecache.fleet.link import RedisLink, SkippedRecords
from edgecache.fleet.vectors import SharedIndex, VectorFeed
from edgecache.health import READY, Health
from edgecache.settings import Settings


class Fleet:
    """The Redis link and the event follower of one node; started by the runtime's lifespan, closed last."""

    def __init__(self, settings: Settings, on_flush: FlushHandler,
                 on_link_state: Callable[[bool], None] | None = None,
                 on_skip: Callable[[str], None] | None = None) -> None:
        assert settings.store.redis_url is not None  # the settings refuse redis without a URL
        self.node_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.link = RedisLink(settings.store.redis_url, timeout_s=settings.store.redis_timeout_s,
                              on_state=on_link_state)
        # Records the feeds could not use: skipped and counted (``on_skip(feed)``), shown on /health while recent.
        self.skips = SkippedRecords(on_skip)
        self.events = FleetEvents(self.link, self.node_id, on_flush, self.skips)
        self.vectors: VectorFeed | None = None
        self.labels: LabelFeed | None = None

    async def start(self) -> None:
        await self.link.start()
        await self.events.start()

    def health(self) -> dict[str, Any]:
        """The /health detail: this node, the fleet's epoch, the link's state, and the learner's labels shared."""
        labels = {"labels": self.labels.state()} if self.labels is not None else {}
        skipped = {"skipped": dict(self.skips.counts)} if self.skips.counts else {}
        return {"node": self.node_id, "epoch": self.events.epoch, **self.link.state(), **labels, **skipped}

    def health_check(self) -> Health:
        """Redis away is ``degraded``, never ``failed``: the node still serves from its memory tier and engine."""
        if self.link.up:
            skipped = self.skips.recent()
            if skipped:
                return Health("degraded", "fleet records skipped as unreadable in the last "
                              f"{SkippedRecords.RECENT_S:.0f} s: " + ", ".join(f"{feed} {n} since start"
                                                                        for feed, n in sorted(skipped.items())))
            return READY
        return Health("degraded", f"redis unreachable ({self.link.error}); serving from this node's memory tier "
                                  "and engine, reconnecting")

    async def share_vectors(self, local_index: Any, *, embedder_version: str, cursor_file: Path,
                            cap_for: Callable[[str], Any],  # tenant -> its bounds, handed to each add
                            index_thread: Callable[[Callable[[], None]], Awaitable[object]]) -> SharedIndex:
        """Wrap the node's semantic index so its additions reach the fleet, and start applying the fleet's (on
        ``index_thread``, the semantic cache's own index thread)."""
        if self.vectors is not None:
            await self.vectors.close()
        self.vectors = VectorFeed(self.link, self.node_id, embedder_version=embedder_version,
                                  local_index=local_index, cursor_file=cursor_file, cap_for=cap_for,
                                  index_thread=index_thread, skips=self.skips)
        self.vectors.start()
        return SharedIndex(local_index, self.vectors)

    def share_labels(self, on_label: Callable[[SharedLabel], None]) -> LabelFeed:
        """Start sharing the semantic learner's labels: this node's go to the fleet, the others' to ``on_label``."""
        if self.labels is None:
            self.labels = LabelFeed(self.link, self.node_id, on_label, self.skips)
            self.labels.start()
        return self.labels

    async def close(self) -> None:
        if self.labels is not None:
            await self.labels.close()
        if self.vectors is not None:
            await self.vectors.close()
        await self.events.close()
        await self.link.close()
