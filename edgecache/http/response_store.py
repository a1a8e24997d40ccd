"""Stored responses (the Responses API's ``store``): each response a tenant created, kept for
``GET /v1/responses/{id}``, ``input_items`` and a follow-up's ``previous_response_id``.

:class:`StoredResponse` is what is kept; :class:`ResponseStore` is where, as encoded records, one per (tenant,
response id): a tenant's id is never found by another tenant, because every read, write and delete names the tenant.
Each tenant's records are bounded in bytes (``store.responses_bytes``; the oldest go first past it) and each lives
``store.responses_ttl_s``. Two stores keep that promise: :class:`SqliteResponseStore`, one SQLite file under the data
dir (one box), and :class:`~edgecache.fleet.responses.RedisResponseStore`, Redis (a fleet, ``store.backend =
"redis"``: a response created on one node is read, continued and deleted on any). The Redis store replaces the file
rather than fronting it: a copy on the node that created a response would still serve it after another node deleted
it. :func:`open_response_store` picks one.

Both keep the same contract. ``put`` never blocks the event loop (a stored answer is the hit path, and under load one
write per response cost more than the hit itself): records are written in batches by the store's own writer, and a
record waiting for its batch is served from memory, so a client reading its response straight after creating it
finds it. A failed write is logged and the response is simply not kept (the answer was served already); a failed read
is a 503 (:class:`~edgecache.errors.StorageUnavailable`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgspec

from edgecache.errors import StorageUnavailable
from edgecache.http.request_surface import ChatMessageIn
from edgecache.settings import Settings

if TYPE_CHECKING:
    from edgecache.fleet import Fleet

log = logging.getLogger("edgecache")

DB_NAME = "responses.db"
# Rows looked at per eviction step: the oldest of a tenant that is over its bound.
_EVICT_BATCH = 64
# Rows written by one INSERT statement (6 values each, well under SQLite's 32766 variables since 3.32).
_ROWS_PER_INSERT = 500
_COLUMNS = 6  # the responses table's (tenant, id, created, expires, size, record)


class StoredResponse(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One stored response: ``body`` is the Response object as served (JSON), ``input_items`` the request's own
    input items (a JSON array, for ``input_items``), ``history`` the conversation before it (every message but the
    instructions) and ``said`` its output as the assistant's message: :attr:`conversation`, what a follow-up
    continues. A record written before ``said`` was a field has its output last in ``history``."""

    body: bytes
    input_items: bytes
    history: tuple[ChatMessageIn, ...]
    created_at: float
    expires_at: float
    said: ChatMessageIn | None = None

    @property
    def conversation(self) -> tuple[ChatMessageIn, ...]:
        return self.history if self.said is None else (*self.history, self.said)


class ResponseStore(Protocol):
    """Encoded :class:`StoredResponse` records, one per (tenant, response id), bounded per tenant in bytes
    (``tenant_bytes``) and in time (``ttl_s``). ``get`` and ``delete`` raise
    :class:`~edgecache.errors.StorageUnavailable` when the store cannot be read; ``put`` never raises."""

    tenant_bytes: int
    ttl_s: float

    def put(self, tenant: str, response_id: str, record: bytes, created_at: float, expires_at: float) -> None:
        """Keep ``record`` (written with the next batch; never blocks). The caller gives only records within
        ``tenant_bytes`` (:func:`keeps`): a bigger one would evict everything the tenant has and still not fit."""

    async def get(self, tenant: str, response_id: str) -> bytes | None:
        """The tenant's record, or None (never stored, expired, evicted, deleted, or another tenant's)."""

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Drop the tenant's record; False when there was none."""

    async def tenant_usage(self, tenant: str) -> tuple[int, int]:
        """(records, bytes) the tenant's stored responses hold, once written."""

    async def flushed(self) -> None:
        """Wait until every record put so far is written (or its write failed)."""

    async def close(self) -> None:
        """Write what is pending, then release the store. Safe twice."""


def keeps(store: ResponseStore, tenant: str, response_id: str, record: bytes) -> bool:
    """Whether ``record`` fits the tenant's bound, the one rule both stores rely on; a response too big to keep is
    served all the same, and logged."""
    if len(record) <= store.tenant_bytes:
        return True
    log.warning("stored responses: %s of tenant %s not kept: %d bytes, over the tenant's %d", response_id, tenant,
                len(record), store.tenant_bytes)
    return False


def open_response_store(settings: Settings, fleet: Fleet | None) -> ResponseStore:
    """Redis for a fleet (every node reads what any node stored), else the SQLite file under the data dir."""
    bound, ttl_s = settings.store.responses_bytes, settings.store.responses_ttl_s
    if fleet is not None:
        from edgecache.fleet.responses import RedisResponseStore

        return RedisResponseStore(fleet.link, tenant_bytes=bound, ttl_s=ttl_s)
    return SqliteResponseStore(settings.data_path / "responses", tenant_bytes=bound, ttl_s=ttl_s)


#: A record waiting for its batch: the encoded record, when it was created, when it expires.
Pending = tuple[bytes, float, float]


_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    tenant TEXT NOT NULL, id TEXT NOT NULL, created REAL NOT NULL, expires REAL NOT NULL, size INTEGER NOT NULL,
    record BLOB NOT NULL, PRIMARY KEY (tenant, id));
CREATE INDEX IF NOT EXISTS responses_age ON responses (tenant, created);
CREATE INDEX IF NOT EXISTS responses_expiry ON responses (expires);
CREATE TABLE IF NOT EXISTS tenant_bytes (tenant TEXT PRIMARY KEY, bytes INTEGER NOT NULL);
"""


@functools.lru_cache(maxsize=16)
def _insert(rows: int) -> str:
    """An INSERT of ``rows`` rows into ``responses``."""
    row = "(" + ", ".join("?" * _COLUMNS) + ")"
    return "INSERT INTO responses VALUES " + ", ".join([row] * rows)


class SqliteResponseStore:
    """Stored responses in one SQLite file under the data dir (a :class:`ResponseStore`): rows written by one
    thread, in batches gathered over :attr:`BATCH_S` (one transaction each)."""

    # How long a batch gathers responses before it is written. Each transaction costs about as much as a dozen
    # rows, and the writer thread's turns take the GIL from the hit path: at 0.05 s a stored Responses hit cost
    # ~15 us more CPU than at 0.25 s (scripts/bench_hitpath.py's stored rows). What a crash can lose is at most
    # this much of the latest responses; until written they are read from memory.
    BATCH_S = 0.25
    PURGE_INTERVAL_S = 60.0  # expired rows are deleted at most this often (reads skip them meanwhile)

    def __init__(self, directory: Path, *, tenant_bytes: int, ttl_s: float) -> None:
        self.directory = directory
        self.tenant_bytes = tenant_bytes
        self.ttl_s = ttl_s
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="response-store")
        self._db: sqlite3.Connection | None = None
        # Responses waiting for the writer, readable meanwhile; a batch is scheduled while this is not empty.
        self._pending: dict[tuple[str, str], Pending] = {}
        self._lock = threading.Lock()
        self._scheduled = False
        self._closed = False
        self._purged_at = 0.0

    # ---- the event loop's side ----

    def put(self, tenant: str, response_id: str, record: bytes, created_at: float, expires_at: float) -> None:
        """Keep ``record``; never blocks. Written with the next batch."""
        if self._closed:
            return
        with self._lock:
            self._pending[(tenant, response_id)] = (record, created_at, expires_at)
            if self._scheduled:
                return
            self._scheduled = True
        asyncio.get_running_loop().call_later(self.BATCH_S, self._submit_batch)

    def _submit_batch(self) -> None:
        if not self._closed:
            self._thread.submit(self._write_pending)

    async def get(self, tenant: str, response_id: str) -> bytes | None:
        with self._lock:
            pending = self._pending.get((tenant, response_id))
        if pending is not None:
            record, _, expires_at = pending
            return record if expires_at > time.time() else None
        return await self._run(self._read, tenant, response_id)

    async def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            pending = self._pending.pop((tenant, response_id), None) is not None
        # On the writer thread, after any batch that holds the record already.
        return await self._run(self._delete, tenant, response_id) or pending

    async def tenant_usage(self, tenant: str) -> tuple[int, int]:
        """(rows, bytes) the tenant's stored responses hold on disk (once written)."""
        return await self._run(self._usage, tenant)

    async def flushed(self) -> None:
        """Write every response put so far, and wait until it is written (tests)."""
        await self._run(self._write_pending)

    async def close(self) -> None:
        """Write what is pending, then close the file. Safe twice."""
        if self._closed:
            return
        self._closed = True
        self._thread.submit(self._write_pending)
        self._thread.submit(self._close_db)
        await asyncio.to_thread(self._thread.shutdown, wait=True)

    async def _run(self, fn, *args):  # type: ignore[no-untyped-def]
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)
        except (sqlite3.Error, OSError) as exc:
            raise StorageUnavailable(f"the stored responses could not be read: {exc}") from exc

    # ---- the writer thread's side ----

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.directory / DB_NAME, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            self._db = db
        return self._db

    def _write_pending(self) -> None:
        with self._lock:
            batch = dict(self._pending)
            self._scheduled = False
        if not batch:
            return
        try:
            self._write(batch)
        except (sqlite3.Error, OSError) as exc:
            log.warning("stored responses: %d not kept (%s)", len(batch), exc)
        finally:
            with self._lock:
                for key, record in batch.items():
                    if self._pending.get(key) is record:
                        del self._pending[key]

    def _write(self, batch: dict[tuple[str, str], Pending]) -> None:
        db = self._connection()
        now = time.time()
        db.execute("BEGIN IMMEDIATE")
        try:
            if now - self._purged_at >= self.PURGE_INTERVAL_S:
                self._drop_expired(db, now)
                self._purged_at = now
            values: list[object] = []
            added: dict[str, int] = {}
            for (tenant, response_id), (blob, created_at, expires_at) in batch.items():
                values += (tenant, response_id, created_at, expires_at, len(blob), blob)
                added[tenant] = added.get(tenant, 0) + len(blob)
            # Response ids are new (a random per-process prefix and a counter): plain inserts, many rows to a
            # statement. This thread takes the GIL back after every statement it runs (the sqlite3 module lets go
            # of it while SQLite works), and with the event loop busy each take waits for the loop's thread to
            # let go: with a statement per row (executemany) a stored Responses hit cost the server ~12 us more
            # CPU (323 against 311 us a hit under wrk, side by side).
            step = _ROWS_PER_INSERT * _COLUMNS
            for start in range(0, len(values), step):
                chunk = values[start:start + step]
                db.execute(_insert(len(chunk) // _COLUMNS), chunk)
            for tenant, size in added.items():
                self._add_bytes(db, tenant, size)
                self._evict(db, tenant)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _add_bytes(self, db: sqlite3.Connection, tenant: str, size: int) -> None:
        db.execute("INSERT INTO tenant_bytes VALUES (?, ?) ON CONFLICT(tenant) DO UPDATE SET bytes = bytes + ?",
                   (tenant, size, size))

    def _remove(self, db: sqlite3.Connection, tenant: str, response_id: str) -> bool:
        row = db.execute("DELETE FROM responses WHERE tenant = ? AND id = ? RETURNING size",
                         (tenant, response_id)).fetchone()
        if row is None:
            return False
        self._add_bytes(db, tenant, -row[0])
        return True

    def _evict(self, db: sqlite3.Connection, tenant: str) -> None:
        """The tenant's oldest rows go until its rows fit its bound."""
        (used,) = db.execute("SELECT bytes FROM tenant_bytes WHERE tenant = ?", (tenant,)).fetchone()
        while used > self.tenant_bytes:
            rows = db.execute("SELECT id, size FROM responses WHERE tenant = ? ORDER BY created LIMIT ?",
                              (tenant, _EVICT_BATCH)).fetchall()
            for response_id, size in rows:
                if used <= self.tenant_bytes:
                    break
                db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id))
                self._add_bytes(db, tenant, -size)
                used -= size

    def _drop_expired(self, db: sqlite3.Connection, now: float) -> None:
        for tenant, size in db.execute("DELETE FROM responses WHERE expires <= ? RETURNING tenant, size",
                                       (now,)).fetchall():
            self._add_bytes(db, tenant, -size)

    def _read(self, tenant: str, response_id: str) -> bytes | None:
        row = self._connection().execute("SELECT record FROM responses WHERE tenant = ? AND id = ? AND expires > ?",
                                         (tenant, response_id, time.time())).fetchone()
        return bytes(row[0]) if row is not None else None

    def _delete(self, tenant: str, response_id: str) -> bool:
        db = self._connection()
        db.execute("BEGIN IMMEDIATE")
        try:
            found = self._remove(db, tenant, response_id)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return found

    def _usage(self, tenant: str) -> tuple[int, int]:
        rows, used = self._connection().execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses WHERE tenant = ?", (tenant,)).fetchone()
        return int(rows), int(used)

    def _close_db(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
