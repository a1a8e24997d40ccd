"""The exact result store: complete answers by request key, on disk, with a TTL per entry and LRU eviction.

Layer 1 of the request path. :class:`DiskResultStore` keeps entries in a diskcache ``Cache`` (SQLite + files) under
the data dir, so they survive restarts, with diskcache's least-recently-used eviction inside a byte budget. In
front of it sits a :class:`~edgecache.stores.memory.MemoryTier`, a small byte-bounded copy of recently used entries:
a hit found there costs a dict lookup and never leaves the event loop, which is what lets a hit run at close to the
speed of a bare endpoint; its reads are replayed to diskcache's access times in batches, on the writer thread. Disk
reads and writes run on the store's own worker threads, because SQLite can block on its file lock.

Faults. The store is checked when it opens (SQLite's ``quick_check``): a damaged ``cache.db`` (truncated,
overwritten, a directory in its place) is moved into the data dir's ``damaged/`` folder, a new one is created and
every row still readable from the old one is copied in; the path is logged and counted. While running, a storage
error never fails a request: a read that fails is a miss, a write that fails (a full disk) is skipped, each
counted and logged once per interval by :class:`~edgecache.health.StorageFaults`, and /health shows the store
degraded until a write succeeds again. A store that cannot open at all (a full disk at start) serves from memory
and tries to open again every :attr:`DiskResultStore.REOPEN_INTERVAL_S`.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TypeVar

import diskcache
import msgspec

from edgecache.data_dir import move_aside, salvage_rows
from edgecache.errors import StorageUnavailable
from edgecache.health import STORAGE_ERRORS, StorageFaults, fault_kind, quick_check
from edgecache.stores import CachedAnswer, unsound
from edgecache.stores.memory import MemoryTier

log = logging.getLogger("edgecache")
T = TypeVar("T")
COMPONENT = "results"
DB_NAME = "cache.db"  # diskcache's file


class DiskResultStore:
    """diskcache on disk + :class:`MemoryTier` in front. Construct, use, then :meth:`close` (safe twice)."""

    REOPEN_INTERVAL_S = 5.0
    READ_BATCH = 256  # disk reads of get_many per SQLite transaction

    def __init__(self, directory: Path, *, disk_bytes: int, memory_bytes: int, faults: StorageFaults | None = None,
                 damaged_dir: Path | None = None) -> None:
        self.directory = directory
        self._disk_bytes = disk_bytes
        self._faults = faults
        self._damaged_dir = damaged_dir if damaged_dir is not None else directory.parent / "damaged"
        self._memory = MemoryTier(memory_bytes, self._replay_reads)
        # One writer thread keeps SQLite writes (and stats, which must see them) in order; a reader thread lets a
        # read pass a slow write.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="result-store-write")
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="result-store-read")
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CachedAnswer)
        self._closed = False
        self.dropped = 0  # entries read that could not be served (undecodable or unsound), dropped
        # The writes waiting for the writer thread, which takes them all at once (see put). The lock is held only
        # to add a write or to take the batch.
        self._batch: _WriteBatch | None = None
        self._batch_lock = threading.Lock()
        self._writing: set[asyncio.Future[bool]] = set()
        self.repairs: list[str] = []  # damage found at open: what, where it went, what was kept
        self._disk: diskcache.Cache | None = None
        self._next_open = 0.0
        self._try_open()

    # ---- opening, checked ----

    def _try_open(self) -> bool:
        """Open the disk store unless open; False (the fault recorded) when the disk refuses. Without ``faults``
        the error propagates, as it always did."""
        if self._disk is not None:
            return True
        if time.monotonic() < self._next_open:
            return False
        try:
            self._disk = self._open_checked()
        except STORAGE_ERRORS as exc:
            if self._faults is None:
                raise
            self._next_open = time.monotonic() + self.REOPEN_INTERVAL_S
            self._faults.record(COMPONENT, exc, action="store not open, serving misses; retrying",
                                path=self.directory)
            return False
        if self._faults is not None:
            self._faults.recovered(COMPONENT)  # it opened: a fault from an earlier try is over
        for report in self.repairs:
            if self._faults is not None:
                self._faults.repaired(COMPONENT, report)
            else:
                log.error("%s", report)
        return True

    def _open(self) -> diskcache.Cache:
        self.directory.mkdir(parents=True, exist_ok=True)
        db = self.directory / DB_NAME
        if db.is_file():
            # quick_check reads every page but skips the slow index cross-checks: it finds a truncated or
            # overwritten file at open instead of failing the requests that touch it.
            verdict = quick_check(db)
            if verdict != "ok":
                raise sqlite3.DatabaseError(f"database disk image is malformed: {verdict}")
        # LRU, not diskcache's default least-recently-stored: a hot FAQ answer must outlive a one-off.
        return diskcache.Cache(str(self.directory), size_limit=self._disk_bytes, tag_index=True,
                               eviction_policy="least-recently-used", cull_limit=16)

    def _open_checked(self) -> diskcache.Cache:
        db = self.directory / DB_NAME
        if db.is_dir():
            problem = "a directory stands where the database file should be"
        else:
            try:
                return self._open()
            except sqlite3.DatabaseError as exc:
                if fault_kind(exc) != "damaged":
                    raise
                problem = str(exc)
        moved = move_aside(db, self._damaged_dir, db.with_name(DB_NAME + "-wal"), db.with_name(DB_NAME + "-shm"))
        self._open().close()  # a new, empty store (its schema), filled below before it serves
        kept = salvage_rows(moved, db, "Cache", "key, raw, store_time, expire_time, access_time, access_count, "
                            "tag, size, mode, filename, value")
        self.repairs.append(f"result store {db} was damaged ({problem}); moved it to {moved} and rebuilt it "
                            f"with the {kept} entries still readable")
        return self._open()

    # ---- storage calls: a failure is a fault to count, never a failed request ----

    async def _on_disk(self, executor: ThreadPoolExecutor, action: str, fallback: T, write: bool,
                       fn: Callable[[diskcache.Cache], T], *, joins_batch: bool = False) -> T:
        if executor is self._writer and not joins_batch:
            self._close_batch()
        if not self._try_open():
            return fallback
        disk = self._disk
        assert disk is not None
        try:
            result = await asyncio.get_running_loop().run_in_executor(executor, fn, disk)
        except STORAGE_ERRORS as exc:
            if self._faults is None:
                raise
            self._faults.record(COMPONENT, exc, action=action, path=self.directory / DB_NAME)
            return fallback
        if write and self._faults is not None:
            self._faults.recovered(COMPONENT)
        return result

    def get_memory(self, key: str) -> CachedAnswer | None:
        return self._memory.get(key)

    def forget_memory(self) -> None:
        self._memory.forget()

    def _replay_reads(self, keys: set[str]) -> bool:
        # On the writer thread: it runs before any write asked after it, so a write's cull sees the reads. It does
        # not close the open batch of puts (a put replays the reads before it joins one): the puts already in that
        # batch may cull before these reads land, which costs only recency, and batching survives a mix of hits
        # and misses.
        if self._disk is None:
            return False
        disk = self._disk

        def touch() -> None:
            try:
                for key in keys:
                    disk.get(key)  # under the LRU policy a get stamps the entry's access time
            except STORAGE_ERRORS:
                pass  # only recency is lost; the next write reports the disk's state

        self._writer.submit(touch)
        return True

    async def get(self, key: str) -> CachedAnswer | None:
        answer = self.get_memory(key)
        if answer is not None:
            return answer
        raw = await self._on_disk(self._reader, "read answered as a miss", None, False,
                                  lambda disk: disk.get(key))
        if raw is None:
            return None
        answer = self._decode(raw)
        if answer is None:
            await self._drop_unreadable([key])
            return None
        if answer.expires_at <= time.time():
            return None
        self._memory.put(key, answer, len(raw))
        return answer

    def _decode(self, raw: object) -> CachedAnswer | None:
        """The answer in an entry read from disk; None when it cannot be served (written by an incompatible version,
        or damaged)."""
        try:
            if not isinstance(raw, bytes):
                raise msgspec.DecodeError(f"not an answer: {type(raw).__name__}")
            answer = self._decoder.decode(raw)
            if (why := unsound(answer)) is not None:
                raise msgspec.DecodeError(why)
        except msgspec.DecodeError:
            return None
        return answer

    async def _drop_unreadable(self, keys: Sequence[str]) -> None:
        """Entries :meth:`_decode` refused: misses, dropped from disk and counted."""
        self.dropped += len(keys)

        def drop(disk: diskcache.Cache) -> bool:
            for key in keys:
                disk.delete(key)
            return True

        await self._on_disk(self._writer, "damaged entries kept", False, True, drop)

    async def put(self, key: str, answer: CachedAnswer, tag: str | None = None) -> bool:
        """Store ``answer`` (``tag``: its scenario, for a selective flush); False when it could not reach the
        disk (counted as a fault; the memory copy still serves). The memory copy is made before the first await,
        so a request that arrives while the disk write is still running is already an exact hit."""
        raw = self._encoder.encode(answer)
        ttl = answer.expires_at - time.time()
        if ttl <= 0:
            return False
        self._memory.put(key, answer, len(raw))
        self._memory.replay_reads()  # recorded reads reach the disk before this write can make it cull
        # Group commit: puts that come while the writer thread is busy go in one transaction when it is free.
        # Each SQLite transaction (its lock, its commit) cost as much as the write in it, once per miss. A batch
        # is open until its job starts on the writer thread or another write job is asked for, so every write
        # keeps its order: a delete or a flush runs after the puts asked before it, and before those asked after.
        with self._batch_lock:
            batch = self._batch
            if batch is None:
                batch = self._batch = _WriteBatch()
                # The batch's outcome is the task that writes it (started before any other put can join).
                batch.outcome = asyncio.ensure_future(self._on_disk(
                    self._writer, "writes skipped", False, True, partial(self._write_batch, batch), joins_batch=True))
                self._writing.add(batch.outcome)  # held until done (the loop keeps only a weak reference to a task)
                batch.outcome.add_done_callback(partial(self._written, batch))
            batch.rows.append((key, raw, answer.expires_at, tag))
        # Shielded: one caller leaving must not cancel the write its batch's other callers wait on.
        return await asyncio.shield(batch.outcome)

    def _close_batch(self, batch: _WriteBatch | None = None) -> None:
        """The next put starts a new batch (``batch``: only if that one is still open)."""
        with self._batch_lock:
            if batch is None or self._batch is batch:
                self._batch = None

    def _write_batch(self, batch: _WriteBatch, disk: diskcache.Cache) -> bool:
        self._close_batch(batch)
        return _set_rows(disk, batch.rows)

    def _written(self, batch: _WriteBatch, outcome: asyncio.Future[bool]) -> None:
        self._writing.discard(outcome)
        self._close_batch(batch)  # a store that was not open never ran the batch's job: the next put starts anew

    async def put_many(self, items: Sequence[tuple[str, CachedAnswer, str | None]]) -> bool:
        """:meth:`put` for many ``(key, answer, tag)`` in one SQLite transaction (a warmup: one commit, not one
        per line). The memory copy is not filled: a bulk load would only evict the answers traffic is using."""
        now = time.time()
        rows = [(key, self._encoder.encode(answer), answer.expires_at, tag)
                for key, answer, tag in items if answer.expires_at > now]
        if not rows:
            return True
        self._memory.replay_reads()
        return await self._on_disk(self._writer, f"{len(rows)} writes skipped", False, True,
                                   partial(_set_rows, rows=rows))

    async def get_many(self, keys: Sequence[str]) -> list[CachedAnswer | None]:
        """:meth:`get` of many keys: the memory copy's, else the disk's, read and decoded in one pass on the reader
        thread (a warmup's look at what is already answered). The memory copy is neither filled nor noted."""
        now = time.time()
        found = [self._memory.peek(key, now) for key in keys]
        wanted = [i for i, answer in enumerate(found) if answer is None]
        if not wanted:
            return found

        def read(disk: diskcache.Cache) -> list[CachedAnswer | bool | None]:
            # Per key: its answer, None when absent, False when unreadable. Under the LRU policy each get stamps
            # its entry's access time, a transaction of its own: READ_BATCH of them share one, and the writer
            # thread gets its turn between batches.
            out: list[CachedAnswer | bool | None] = []
            for start in range(0, len(wanted), self.READ_BATCH):
                with disk.transact():
                    raws = [disk.get(keys[i]) for i in wanted[start:start + self.READ_BATCH]]
                for raw in raws:
                    answer = None if raw is None else self._decode(raw)
                    out.append(False if raw is not None and answer is None else answer)
            return out

        read_back = await self._on_disk(self._reader, "reads answered as misses", [None] * len(wanted), False, read)
        unreadable = []
        for i, answer in zip(wanted, read_back):
            if answer is False:
                unreadable.append(keys[i])
            elif isinstance(answer, CachedAnswer) and answer.expires_at > now:
                found[i] = answer
        if unreadable:
            await self._drop_unreadable(unreadable)
        return found

    async def delete(self, key: str) -> bool:
        """Drop one answer, from memory and disk; True when the disk held it (False too when the disk failed:
        counted as a fault)."""
        self._memory.pop(key)
        return await self._on_disk(self._writer, "delete skipped", False, True, lambda disk: bool(disk.delete(key)))

    async def clear(self, tag: str | None = None) -> int:
        """Drop every entry, or those stored with ``tag`` (a scenario). Returns how many went from disk."""
        self._memory.forget()
        if not self._try_open():
            raise StorageUnavailable(f"the result store {self.directory} is not open (see /health); nothing on "
                                     "disk was flushed")
        disk = self._disk
        assert disk is not None
        loop = asyncio.get_running_loop()
        self._close_batch()
        try:
            if tag is None:
                return await loop.run_in_executor(self._writer, disk.clear)
            return await loop.run_in_executor(self._writer, disk.evict, tag)
        except STORAGE_ERRORS as exc:
            if self._faults is not None:
                self._faults.record(COMPONENT, exc, action="flush failed", path=self.directory / DB_NAME)
            raise StorageUnavailable(f"the result store {self.directory} could not be flushed: {exc}") from exc

    async def stats(self) -> dict[str, int]:
        def read(disk: diskcache.Cache) -> tuple[int, int, int]:
            return len(disk), disk.volume(), int(disk.size_limit)

        entries, volume, budget = await self._on_disk(self._writer, "stats not read", (0, 0, self._disk_bytes),
                                                      False, read)
        return {"entries": entries, "bytes": volume, "budget_bytes": budget, "dropped_unreadable": self.dropped,
                **self._memory.stats()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._memory.replay_reads()
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        if self._disk is not None:
            self._disk.close()


def _set_rows(disk: diskcache.Cache, rows: Sequence[tuple[str, bytes, float, str | None]]) -> bool:
    """``(key, encoded answer, expires_at, tag)`` rows in one SQLite transaction, each with the lifetime it has left
    when it is written (one that has none left by then is skipped)."""
    now = time.time()
    with disk.transact():
        for key, raw, expires_at, tag in rows:
            if expires_at > now:
                disk.set(key, raw, expire=expires_at - now, tag=tag)
    return True


class _WriteBatch:
    """Writes that go to disk in one transaction, and the task that writes them (False: the disk refused them,
    counted)."""

    outcome: asyncio.Future[bool]

    def __init__(self) -> None:
        self.rows: list[tuple[str, bytes, float, str | None]] = []


class TenantStores:
    """One :class:`DiskResultStore` per tenant, under ``root/<tenant>``, each with its plan's byte quota.

    Separate stores make isolation structural: a tenant filling its quota evicts only its own entries, and no key
    of one tenant can be looked up in another's store.
    """

    def __init__(self, root: Path, *, quota_for: Callable[[str], int], memory_bytes: int,
                 faults: StorageFaults | None = None, damaged_dir: Path | None = None) -> None:
        self.root = root
        self._quota_for = quota_for
        self._memory_bytes = memory_bytes
        self._faults = faults
        self._damaged_dir = damaged_dir
        self._stores: dict[str, DiskResultStore] = {}

    def __call__(self, tenant: str) -> DiskResultStore:
        store = self._stores.get(tenant)
        if store is None:
            store = self._stores[tenant] = DiskResultStore(
                self.root / tenant, disk_bytes=self._quota_for(tenant), memory_bytes=self._memory_bytes,
                faults=self._faults, damaged_dir=self._damaged_dir)
        return store

    def opened(self) -> dict[str, DiskResultStore]:
        return dict(self._stores)

    def existing_tenants(self) -> list[str]:
        """Tenants with a store on disk (opened or not), for flushes and stats."""
        on_disk = {p.name for p in self.root.iterdir() if p.is_dir()} if self.root.is_dir() else set()
        return sorted(on_disk | set(self._stores))

    async def known_tenants(self) -> list[str]:
        """Every tenant with a store: on one box, its directory already knows them all."""
        return self.existing_tenants()

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
