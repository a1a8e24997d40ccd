"""The memory tier in front of every result store backend: recently used answers, bounded by bytes, and the reads
they served, replayed to the backend."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from edgecache.stores import CachedAnswer


class MemoryLRU:
    """Byte-bounded LRU of recently used answers, on the event loop thread only (no locks needed)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, tuple[CachedAnswer, int]] = OrderedDict()

    def get(self, key: str, now: float) -> CachedAnswer | None:
        item = self._entries.get(key)
        if item is None:
            return None
        answer = item[0]
        if answer.expires_at <= now:
            self.pop(key)
            return None
        self._entries.move_to_end(key)
        return answer

    def put(self, key: str, answer: CachedAnswer, size: int) -> None:
        if size > self.max_bytes:
            return
        self.pop(key)
        self._entries[key] = (answer, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, old_size) = self._entries.popitem(last=False)
            self.bytes -= old_size

    def pop(self, key: str) -> None:
        item = self._entries.pop(key, None)
        if item is not None:
            self.bytes -= item[1]

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)


class MemoryTier:
    """A result store's memory tier: the :class:`MemoryLRU` in front of its backend, and the reads it served.

    Both backends hold one (composition: the backend owns the storage, this owns what sits in front of it). A hit
    served here never reaches the backend, whose own LRU (diskcache's access time, Redis' per-tenant sorted set)
    would then follow write order and evict the hottest answers first. So each read is noted and the reads are
    replayed to the backend in batches of :attr:`READ_SYNC_BATCH`, off the hit path, and before each write (which
    may make the backend evict).
    """

    READ_SYNC_BATCH = 256

    def __init__(self, max_bytes: int, replay: Callable[[set[str]], bool]) -> None:
        """``replay`` hands a batch of read keys to the backend without blocking the event loop; it returns False
        when the backend cannot take them now (a disk not open, Redis away), and they wait for the next batch."""
        self._lru = MemoryLRU(max_bytes)
        self._replay = replay
        self._unsynced_reads: set[str] = set()

    def get(self, key: str) -> CachedAnswer | None:
        """The hit path's first look: no I/O, no thread hop. A hit is noted for the backend's LRU."""
        answer = self._lru.get(key, time.time())
        if answer is not None:
            self._unsynced_reads.add(key)
            if len(self._unsynced_reads) >= self.READ_SYNC_BATCH:
                self.replay_reads()
        return answer

    def peek(self, key: str, now: float) -> CachedAnswer | None:
        """The live copy of ``key``, if here, without noting a read (a warmup's look, not traffic's)."""
        return self._lru.get(key, now)

    def put(self, key: str, answer: CachedAnswer, size: int) -> None:
        self._lru.put(key, answer, size)

    def pop(self, key: str) -> None:
        """Drop the copy of one answer (the backend drops its own)."""
        self._lru.pop(key)

    def replay_reads(self) -> None:
        """Hand the noted reads to the backend now (before a write, at close); kept when it cannot take them."""
        if self._unsynced_reads and self._replay(self._unsynced_reads):
            self._unsynced_reads = set()

    def forget(self) -> None:
        """Drop every copy (a flush, here or on another node). The copies have no tags, so a scenario flush drops
        them all too; they refill from the backend on the next reads. Noted reads stay: replaying one whose entry
        is gone touches nothing."""
        self._lru.clear()

    def stats(self) -> dict[str, int]:
        return {"memory_entries": len(self._lru), "memory_bytes": self._lru.bytes}
