"""Stored responses (the Responses API's ``store``): each response a tenant created, kept under the data dir for
``GET /v1/responses/{id}``, ``input_items`` and a follow-up's ``previous_response_id``.

One SQLite file, one row per (tenant, response id): a tenant's id is never found by another tenant, because every
read, write and delete names the tenant. Each tenant's rows are bounded in bytes (``store.responses_bytes``; the
oldest go first past it) and each row lives ``store.responses_ttl_s``. Rows are written by one thread, in batches
gathered over :attr:`ResponseStore.BATCH_S` (one transaction each): ``put`` never blocks the event loop (a stored
answer is the hit path, and under load one transaction per response cost more than the hit itself), and a response
waiting for its batch is served from memory, so a client reading its response straight after creating it finds it. A failed write is
logged and the response is simply not kept (the answer was served already); a failed read is a 503.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from edgecache.errors import StorageUnavailable
from edgecache.http.request_surface import ChatMessageIn

log = logging.getLogger("edgecache")

DB_NAME = "responses.db"
# Rows looked at per eviction step: the oldest of a tenant that is over its bound.
_EVICT_BATCH = 64


class StoredResponse(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One stored response: ``body`` is the Response object as served (JSON), ``input_items`` the request's own
    input items (a JSON array, for ``input_items``), ``history`` the conversation a follow-up continues (every message
    but the instructions, this response's output last)."""

    body: bytes
    input_items: bytes
    history: tuple[ChatMessageIn, ...]
    created_at: float
    expires_at: float


_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    tenant TEXT NOT NULL, id TEXT NOT NULL, created REAL NOT NULL, expires REAL NOT NULL, size INTEGER NOT NULL,
    record BLOB NOT NULL, PRIMARY KEY (tenant, id));
CREATE INDEX IF NOT EXISTS responses_age ON responses (tenant, created);
CREATE INDEX IF NOT EXISTS responses_expiry ON responses (expires);
CREATE TABLE IF NOT EXISTS tenant_bytes (tenant TEXT PRIMARY KEY, bytes INTEGER NOT NULL);
"""


class ResponseStore:
    """Stored responses, per tenant, bounded in bytes (``tenant_bytes``) and in time (``ttl_s``)."""

    BATCH_S = 0.05           # how long a batch gathers responses before it is written
    PURGE_INTERVAL_S = 60.0  # expired rows are deleted at most this often (reads skip them meanwhile)

    def __init__(self, directory: Path, *, tenant_bytes: int, ttl_s: float) -> None:
        self.directory = directory
        self.tenant_bytes = tenant_bytes
        self.ttl_s = ttl_s
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="response-store")
        self._db: sqlite3.Connection | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(StoredResponse)
        # Responses waiting for the writer, readable meanwhile; a batch is scheduled while this is not empty.
        self._pending: dict[tuple[str, str], StoredResponse] = {}
        self._lock = threading.Lock()
        self._scheduled = False
        self._closed = False
        self._purged_at = 0.0

    # ---- the event loop's side ----

    def put(self, tenant: str, response_id: str, record: StoredResponse) -> None:
        """Keep ``record``; never blocks. Written with the next batch."""
        if self._closed:
            return
        with self._lock:
            self._pending[(tenant, response_id)] = record
            if self._scheduled:
                return
            self._scheduled = True
        asyncio.get_running_loop().call_later(self.BATCH_S, self._submit_batch)

    def _submit_batch(self) -> None:
        if not self._closed:
            self._thread.submit(self._write_pending)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            record = self._pending.get((tenant, response_id))
        if record is not None:
            return record if record.expires_at > time.time() else None
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

    def close(self) -> None:
        """Write what is pending, then close the file. Safe twice."""
        if self._closed:
            return
        self._closed = True
        self._thread.submit(self._write_pending)
        self._thread.submit(self._close_db)
        self._thread.shutdown(wait=True)

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

    def _write(self, batch: dict[tuple[str, str], StoredResponse]) -> None:
        db = self._connection()
        now = time.time()
        db.execute("BEGIN IMMEDIATE")
        try:
            if now - self._purged_at >= self.PURGE_INTERVAL_S:
                self._drop_expired(db, now)
                self._purged_at = now
            rows, added = [], {}
            for (tenant, response_id), record in batch.items():
                blob = self._encoder.encode(record)
                if len(blob) > self.tenant_bytes:
                    log.warning("stored responses: %s of tenant %s not kept: %d bytes, over the tenant's %d",
                                response_id, tenant, len(blob), self.tenant_bytes)
                    continue
                rows.append((tenant, response_id, record.created_at, record.expires_at, len(blob), blob))
                added[tenant] = added.get(tenant, 0) + len(blob)
            # Response ids are new (a random per-process prefix and a counter): plain inserts, in one statement.
            db.executemany("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?)", rows)
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

    def _read(self, tenant: str, response_id: str) -> StoredResponse | None:
        row = self._connection().execute("SELECT record FROM responses WHERE tenant = ? AND id = ? AND expires > ?",
                                         (tenant, response_id, time.time())).fetchone()
        return self._decoder.decode(row[0]) if row is not None else None

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
