"""Layer 2 of the request path, in-flight de-duplication: identical concurrent requests share one engine call.

Backends sit side by side behind :class:`FlightTable`: :mod:`edgecache.inflight.local` (flights of this process,
the default for one box) and :mod:`edgecache.inflight.redis` (flights led through a Redis lease, shared by a fleet).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from edgecache.engines.base import Chunk


class SharedFlight(Protocol):
    """One engine call that any number of listeners follow; its producer publishes chunks, then finishes."""

    chunks: list[Chunk]

    def follow(self, batch_s: float = 0.0) -> AsyncIterator[Chunk]:
        """Every chunk from the first, live; raises the flight's error if it fails. With ``batch_s``, at most one
        delivery per ``batch_s``, the text chunks published meanwhile merged into one."""
        ...

    def publish(self, chunk: Chunk) -> None: ...

    def finish(self) -> None: ...


Producer = Callable[[SharedFlight], Awaitable[None]]


class FlightTable(Protocol):
    """Flights by request key."""

    def get(self, key: str) -> SharedFlight | None:
        """The running flight for ``key``, to follow, or None."""
        ...

    def lead(self, key: str, produce: Producer) -> SharedFlight:
        """Start a flight for ``key``; ``produce`` publishes its chunks, persists the answer, then calls ``finish()``."""
        ...

    async def drain(self, timeout_s: float) -> None:
        """Shutdown: let running flights finish within ``timeout_s``, then cancel the rest."""
        ...

    def __len__(self) -> int: ...
