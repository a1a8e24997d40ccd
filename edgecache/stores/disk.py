"""The exact result store: complete answers by request key, on disk, with a TTL per entry and LRU eviction.

Layer 1 of the request path. :class:`DiskResultStore` keeps entries in a diskcache ``Cache`` (SQLite + files) under
the data dir, so they survive restarts, with diskcache's least-recently-used eviction inside a byte budget. In
front of it sits :class:`MemoryLRU`, a small byte-bounded copy of recently used entries: a hit found there costs a
dict lookup and never leaves the event loop, which is what lets a hit run at close to the speed of a bare endpoint.
Disk reads and writes run on the store's own worker threads, because SQLite can block on its file lock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import diskcache
import msgspec

from edgecache.stores import CachedAnswer
from edgecache.stores.memory import MemoryLRU


class DiskResultStore:
    """diskcache on disk + :class:`MemoryLRU` in front. Construct, use, then :meth:`close` (safe twice)."""

    READ_SYNC_BATCH = 256

    def __init__(self, directory: Path, *, disk_bytes: int, memory_bytes: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        # LRU, not diskcache's default least-recently-stored: a hot FAQ answer must outlive a one-off.
        self._disk = diskcache.Cache(str(directory), size_limit=disk_bytes, tag_index=True,
                                     eviction_policy="least-recently-used", cull_limit=16)
        self._memory = MemoryLRU(memory_bytes)
        # One writer thread keeps SQLite writes (and stats, which must see them) in order; a reader thread lets a
        # read pass a slow write.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="result-store-write")
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="result-store-read")
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CachedAnswer)
        self._unsynced_reads: set[str] = set()
        self._closed = False

    def get_memory(self, key: str) -> CachedAnswer | None:
        """The hit path's first look: no I/O, no thread hop."""
        answer = self._memory.get(key, time.time())
        if answer is not None:
            self._note_read(key)
        return answer

    def _note_read(self, key: str) -> None:
        # A hit served from memory never reaches diskcache, whose LRU would then follow write order and evict the
        # hottest answers first. Reads are replayed to the disk in batches, on the writer thread, off the hit path.
        self._unsynced_reads.add(key)
        if len(self._unsynced_reads) >= self.READ_SYNC_BATCH:
            self._sync_reads()

    def _sync_reads(self) -> None:
        if not self._unsynced_reads:
            return
        keys, self._unsynced_reads = self._unsynced_reads, set()

        def touch() -> None:
            for key in keys:
                self._disk.get(key)  # under the LRU policy a get stamps the entry's access time

        self._writer.submit(touch)

    async def get(self, key: str) -> CachedAnswer | None:
        answer = self.get_memory(key)
        if answer is not None:
            return answer
        raw = await asyncio.get_running_loop().run_in_executor(self._reader, self._disk.get, key)
        if raw is None:
            return None
        try:
            if not isinstance(raw, bytes):
                raise msgspec.DecodeError(f"not an answer: {type(raw).__name__}")
            answer = self._decoder.decode(raw)
        except msgspec.DecodeError:
            # An entry written by an incompatible version: treat as a miss and drop it.
            await asyncio.get_running_loop().run_in_executor(self._writer, self._disk.delete, key)
            return None
        if answer.expires_at <= time.time():
            return None
        self._memory.put(key, answer, len(raw))
        return answer

    async def put(self, key: str, answer: CachedAnswer, tag: str | None = None) -> None:
        """Store ``answer`` (``tag``: its scenario, for a selective flush). The memory copy is made before the
        first await, so a request that arrives while the disk write is still running is already an exact hit."""
        raw = self._encoder.encode(answer)
        ttl = answer.expires_at - time.time()
        if ttl <= 0:
            return
        self._memory.put(key, answer, len(raw))
        self._sync_reads()  # recorded reads reach the disk before this write can make it cull
        await asyncio.get_running_loop().run_in_executor(
            self._writer, lambda: self._disk.set(key, raw, expire=ttl, tag=tag))

    async def clear(self, tag: str | None = None) -> int:
        """Drop every entry, or those stored with ``tag`` (a scenario). Returns how many went from disk."""
        # The memory copy has no tags; it is dropped whole (it refills from disk on the next reads).
        self._memory.clear()
        if tag is None:
            return await asyncio.get_running_loop().run_in_executor(self._writer, self._disk.clear)
        return await asyncio.get_running_loop().run_in_executor(self._writer, self._disk.evict, tag)

    async def stats(self) -> dict[str, int]:
        def read() -> tuple[int, int]:
            return len(self._disk), self._disk.volume()

        entries, volume = await asyncio.get_running_loop().run_in_executor(self._writer, read)
        return {"entries": entries, "bytes": volume, "budget_bytes": int(self._disk.size_limit),
                "memory_entries": len(self._memory), "memory_bytes": self._memory.bytes}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sync_reads()
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        self._disk.close()


class TenantStores:
    """One :class:`DiskResultStore` per tenant, under ``root/<tenant>``, each with its plan's byte quota.

    Separate stores make isolation structural: a tenant filling its quota evicts only its own entries, and no key
    of one tenant can be looked up in another's store.
    """

    def __init__(self, root: Path, *, quota_for: Callable[[str], int], memory_bytes: int) -> None:
        self.root = root
        self._quota_for = quota_for
        self._memory_bytes = memory_bytes
        self._stores: dict[str, DiskResultStore] = {}

    def __call__(self, tenant: str) -> DiskResultStore:
        store = self._stores.get(tenant)
        if store is None:
            store = self._stores[tenant] = DiskResultStore(
                self.root / tenant, disk_bytes=self._quota_for(tenant), memory_bytes=self._memory_bytes)
        return store

    def opened(self) -> dict[str, DiskResultStore]:
        return dict(self._stores)

    def existing_tenants(self) -> list[str]:
        """Tenants with a store on disk (opened or not), for flushes and stats."""
        on_disk = {p.name for p in self.root.iterdir() if p.is_dir()} if self.root.is_dir() else set()
        return sorted(on_disk | set(self._stores))

    def close(self) -> None:
        errors = []
        for store in self._stores.values():
            try:
                store.close()
            except Exception as exc:  # close everything, then report the first failure
                errors.append(exc)
        self._stores.clear()
        if errors:
            raise errors[0]
