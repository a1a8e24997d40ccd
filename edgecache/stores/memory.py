"""The memory tier in front of every result store backend: recently used answers, bounded by bytes."""

from __future__ import annotations

from collections import OrderedDict

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
