"""Nearest-neighbour search over prompt vectors, one usearch index per (tenant, scenario, embedder version).

Each vector's integer key points at a result-store key (a str) and the embedded text (for the guard).

Durability: the mapping lives in SQLite (WAL) and is the source of truth; it also keeps each vector (f16 bytes), so
an index file can always be rebuilt. Index files are written to a temp file and ``os.replace``-d, so a kill at any
moment leaves either the old or the new file. On open, the index is reconciled with the mapping: keys with no
mapping row are removed, rows missing from the index (added since the last save) are re-added, and an index file
that fails to load is rebuilt from the rows. A crash therefore loses nothing committed to SQLite.

Layout under ``data_dir``::

    <embedder version>/mapping.sqlite3
    <embedder version>/<tenant>/<scenario>.usearch

Bounds per tenant (:class:`TenantBounds`, from its plan, handed to each addition): vectors per index (the oldest
go first), indexes (every distinct system prompt or ``cache_salt`` makes one, with a file; past the bound the
tenant's least recently used index goes whole), and vectors across all its indexes (past it the oldest vectors of
its least recently used index go first). A search or an addition uses an index. Only the tenant's own indexes ever
make room for it: another tenant's traffic never evicts a vector of its. A search of an index that holds nothing
creates nothing.

Everything here blocks (disk, SQLite, graph search); callers run it off the event loop. One lock serialises all
calls: a search at 1M vectors takes well under a millisecond, so finer locking would buy little.

usearch 2.26.2-2.26.6 segfault when imported before onnxruntime; the pin in pyproject.toml avoids those releases
and tests/test_import_order.py proves both orders work.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import quote

import msgspec
import numpy as np

if TYPE_CHECKING:
    from usearch.index import Index

VectorDType = Literal["f16", "i8"]
IndexId = tuple[str, str]  # (tenant, scenario)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS vectors (
    key INTEGER PRIMARY KEY AUTOINCREMENT,  -- the usearch key; AUTOINCREMENT so a key is never reused
    tenant TEXT NOT NULL,
    scenario TEXT NOT NULL,
    store_key TEXT NOT NULL,
    text TEXT NOT NULL,
    vector BLOB NOT NULL                    -- float16 bytes, to rebuild an index without re-embedding
);
CREATE INDEX IF NOT EXISTS vectors_by_index ON vectors (tenant, scenario, key);
CREATE INDEX IF NOT EXISTS vectors_by_store_key ON vectors (tenant, scenario, store_key);
"""


class TenantBounds(msgspec.Struct, frozen=True, kw_only=True):
    """What one tenant's indexes may hold (its plan); None: no bound of the tenant's own (the index's own
    ``max_vectors`` still caps each index)."""

    vectors_per_index: int | None = None
    indexes: int | None = None
    vectors: int | None = None


class TenantUsage(msgspec.Struct, frozen=True):
    """What one tenant's indexes hold: how many indexes, their vectors, and the most in one."""

    indexes: int = 0
    vectors: int = 0
    largest: int = 0


class Candidate(msgspec.Struct, frozen=True):
    """A stored prompt near the query: the caller applies threshold and guard, then reads ``store_key``."""

    similarity: float
    store_key: str
    text: str
    vector_key: int


def _path_part(name: str) -> str:
    # Tenant and scenario names come from config; quote them so none can escape the data dir ("..", "/").
    return quote(name, safe="-_").replace(".", "%2E") or "%00"


def make_index(dim: int, dtype: VectorDType = "f16", *, connectivity: int = 16, expansion_add: int = 64,
               expansion_search: int = 128) -> Index:
    """An empty usearch HNSW index as SemanticIndex builds them (the benchmarks build theirs here too)."""
    from usearch.index import Index

    # Every vector is L2-normalised before it gets here, so the inner product is the cosine without two norms
    # per distance: faster to build and search. Not for i8, whose inner product is on the integer scale (usearch
    # normalises i8 only under "cos"). Files saved under either metric load under the other: same graph, same
    # vectors.
    # expansion_add 64 (usearch's default 128) builds about 2x faster, and expansion_search 128 (was 64) wins the
    # recall back at search time: on 96k real prompt vectors, recall@1 of the exact nearest neighbour 0.987 against
    # 0.986 before (cosine, 128 / 64), a search 0.41 against 0.37 ms (scripts/bench_index_build.py --real-texts).
    return Index(ndim=dim, metric="ip" if dtype == "f16" else "cos", dtype=dtype, connectivity=connectivity,
                 expansion_add=expansion_add, expansion_search=expansion_search)


class SemanticIndex:
    """All semantic indexes of one embedder version under one data directory."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        dim: int,
        embedder_version: str,
        dtype: VectorDType = "f16",
        max_vectors: int = 100_000,
        connectivity: int = 16,
        expansion_add: int = 64,
        expansion_search: int = 128,
        damaged_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if dtype not in ("f16", "i8"):
            raise ValueError(f"dtype must be 'f16' or 'i8', not {dtype!r}")
        self.dim = dim
        self.dtype: VectorDType = dtype
        self.max_vectors = max_vectors
        self._connectivity = connectivity
        self._expansion_add = expansion_add
        self._expansion_search = expansion_search
        self._root = Path(data_dir) / _path_part(embedder_version)
        self._root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._indexes: dict[IndexId, Index] = {}
        self._dirty: set[IndexId] = set()
        self.mapping_path = self._root / "mapping.sqlite3"
        self._damaged_dir = Path(damaged_dir) if damaged_dir is not None else Path(data_dir) / "damaged"
        self.repairs: list[str] = []  # damage found at open: what was wrong, where it went, what was kept
        self._db = self._open_mapping()
        # tenant -> its indexes (by name) with their vector counts, least recently used first
        self._usage: dict[str, OrderedDict[str, int]] = self._read_usage()
        self._closed = False
        #: Told (tenant, index name) when an index is released: dropped whole (a flush, the tenant's bound on
        #: indexes) or emptied. Called on the thread that released it, under the index's lock.
        self.on_release: Callable[[str, str], None] | None = None

    # ---- public API ----

    def add(self, tenant: str, scenario: str, vector: np.ndarray, store_key: str, text: str,
            bounds: TenantBounds | None = None) -> int:
        """Store ``vector`` (L2-normalised, shape (dim,)) pointing at ``store_key``; return its vector key.

        Within the tenant's ``bounds`` (its plan) and the index's own ``max_vectors``: at an index's cap its oldest
        vectors go first (FIFO); past the tenant's bound on indexes or on vectors, its least recently used indexes
        make room (:meth:`_make_room`).
        """
        vec = self._as_vector(vector)
        with self._lock:
            self._make_room(tenant, scenario, 1, bounds)
            index = self._open(tenant, scenario)
            cur = self._db.execute(
                "INSERT INTO vectors (tenant, scenario, store_key, text, vector) VALUES (?, ?, ?, ?, ?)",
                (tenant, scenario, store_key, text, vec.astype(np.float16).tobytes()),
            )
            key = int(cur.lastrowid or 0)
            index.add(key, vec)
            self._dirty.add((tenant, scenario))
            self._counted(tenant, scenario, 1)
            return key

    def add_many(self, tenant: str, scenario: str, vectors: np.ndarray, store_keys: Sequence[str],
                 texts: Sequence[str], bounds: TenantBounds | None = None, threads: int = 0) -> list[int]:
        """:meth:`add` for many vectors (shape (n, dim)) at once: one SQLite transaction for the rows and one
        usearch call that inserts on ``threads`` threads (0: all cores). This is how a warmup or an import builds
        an index in minutes instead of hours: per-vector adds pay a commit and a single-threaded insert each.
        Returns the vector keys, in order. Within the bounds only the newest are kept (as :meth:`add`)."""
        vecs = np.asarray(vectors, dtype=np.float32).reshape(len(store_keys), -1)
        if vecs.shape[1] != self.dim or len(texts) != len(store_keys):
            raise ValueError(f"expected {len(store_keys)} vectors of {self.dim} values and as many texts")
        cap = self._index_cap(bounds)
        if bounds is not None and bounds.vectors is not None:
            cap = min(cap, bounds.vectors)
        skip = max(0, len(store_keys) - cap)  # the oldest of this batch would be evicted by its own newest
        vecs, store_keys, texts = vecs[skip:], list(store_keys)[skip:], list(texts)[skip:]
        if not store_keys:
            return []
        with self._lock:
            self._make_room(tenant, scenario, len(store_keys), bounds)
            index = self._open(tenant, scenario)
            blobs = vecs.astype(np.float16)
            self._db.execute("BEGIN IMMEDIATE")
            try:
                # AUTOINCREMENT keys, assigned here explicitly so the batch is one executemany: the next key is past
                # both the sequence (never reuse a removed key) and the current maximum.
                row = self._db.execute("SELECT MAX(COALESCE((SELECT seq FROM sqlite_sequence WHERE name='vectors'),"
                                       " 0), COALESCE((SELECT MAX(key) FROM vectors), 0))").fetchone()
                first = int(row[0]) + 1
                keys = list(range(first, first + len(store_keys)))
                self._db.executemany(
                    "INSERT INTO vectors (key, tenant, scenario, store_key, text, vector) VALUES (?, ?, ?, ?, ?, ?)",
                    [(key, tenant, scenario, store_key, text, blob.tobytes())
                     for key, store_key, text, blob in zip(keys, store_keys, texts, blobs)])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            index.add(np.array(keys, dtype=np.uint64), vecs, threads=threads)
            self._dirty.add((tenant, scenario))
            self._counted(tenant, scenario, len(keys))
            return keys

    def search(self, tenant: str, scenario: str, vector: np.ndarray, k: int = 4) -> list[Candidate]:
        """The ``k`` nearest stored prompts of this tenant and scenario, most similar first."""
        vec = self._as_vector(vector)
        with self._lock:
            used = self._usage.get(tenant)
            if used is None or scenario not in used:
                return []  # nothing there: no index is opened (or kept in memory) for it
            used.move_to_end(scenario)
            index = self._open(tenant, scenario)
            if len(index) == 0:
                return []
            matches = index.search(vec, min(k, len(index)))
            keys = [int(key) for key in matches.keys]
            # f16 inner products of unit vectors stray past 1 by a few 1e-5: clipped so a similarity stays a cosine.
            sims = {int(key): min(1.0, max(-1.0, 1.0 - float(dist)))
                    for key, dist in zip(matches.keys, matches.distances)}
            rows = self._db.execute(
                f"SELECT key, store_key, text FROM vectors WHERE key IN ({','.join('?' * len(keys))})", keys
            ).fetchall()
        found = {key: (store_key, text) for key, store_key, text in rows}
        return [
            Candidate(similarity=sims[key], store_key=found[key][0], text=found[key][1], vector_key=key)
            for key in keys
            if key in found
        ]

    def vectors_of(self, tenant: str, scenario: str, store_keys: Iterable[str]) -> dict[str, np.ndarray]:
        """The vectors (as kept: float16, read as float32) of those of ``store_keys`` this index holds, by store key
        (the newest where one key has several)."""
        wanted = set(store_keys)
        with self._lock:
            rows = self._db.execute("SELECT store_key, vector FROM vectors WHERE tenant=? AND scenario=? ORDER BY key",
                                    (tenant, scenario)).fetchall()
        return {store_key: np.frombuffer(blob, dtype=np.float16).astype(np.float32)
                for store_key, blob in rows if store_key in wanted}

    def remove(self, tenant: str, scenario: str, vector_keys: Iterable[int]) -> int:
        """Remove vectors (e.g. their result-store entry expired); return how many existed."""
        with self._lock:
            return self._remove_keys(tenant, scenario, list(vector_keys))

    def remove_store_key(self, tenant: str, scenario: str, store_key: str) -> int:
        """Remove every vector pointing at ``store_key``; return how many there were."""
        with self._lock:
            keys = [
                row[0]
                for row in self._db.execute(
                    "SELECT key FROM vectors WHERE tenant=? AND scenario=? AND store_key=?",
                    (tenant, scenario, store_key),
                )
            ]
            return self._remove_keys(tenant, scenario, keys)

    def drop(self, tenant: str | None = None, scenario: str | None = None) -> None:
        """Flush: forget every index of ``tenant`` (and ``scenario``); ``None`` matches all."""
        with self._lock:
            for tenant_, scenario_ in self._known_ids():
                if tenant not in (None, tenant_) or scenario not in (None, scenario_):
                    continue
                self._drop_index(tenant_, scenario_)

    def usage(self, tenant: str) -> TenantUsage:
        """What ``tenant``'s indexes hold now (its own figures only)."""
        with self._lock:
            counts = list(self._usage.get(tenant, {}).values())
        return TenantUsage(len(counts), sum(counts), max(counts, default=0))

    def save(self) -> None:
        """Write every changed index to disk atomically (temp file + os.replace)."""
        with self._lock:
            for index_id in sorted(self._dirty):
                path = self._index_path(*index_id)
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(path.name + ".tmp")
                self._indexes[index_id].save(str(tmp))
                os.replace(tmp, path)
            self._dirty.clear()

    def sizes(self) -> dict[IndexId, int]:
        """Vectors per (tenant, scenario), from the mapping (the source of truth)."""
        with self._lock:
            rows = self._db.execute("SELECT tenant, scenario, COUNT(*) FROM vectors GROUP BY tenant, scenario")
            return {(tenant, scenario): count for tenant, scenario, count in rows}

    def close(self) -> None:
        """Save and release; safe to call twice."""
        with self._lock:
            if self._closed:
                return
            try:
                self.save()
            finally:
                self._closed = True
                self._indexes.clear()
                self._db.close()

    # ---- internals ----

    def _connect(self) -> sqlite3.Connection:
        from edgecache.health import quick_check

        db = sqlite3.connect(self.mapping_path, check_same_thread=False, isolation_level=None)
        try:
            # WAL + NORMAL: a commit survives a process kill (not necessarily a power cut), without an fsync per add.
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            # quick_check reads every page (a 1M-vector mapping in about a second) but skips the slow index
            # cross-checks: enough to find a truncated or overwritten file before it fails a request.
            verdict = quick_check(self.mapping_path)
            if verdict != "ok":
                raise sqlite3.DatabaseError(f"database disk image is malformed: {verdict}")
            db.executescript(_SCHEMA)
        except BaseException:
            db.close()
            raise
        return db

    def _open_mapping(self) -> sqlite3.Connection:
        """Open the mapping, checked. A damaged one (not a database, failing quick_check, a directory in its place,
        or emptied while index files still hold vectors) is moved aside with the index files under
        ``damaged_dir``, and a new mapping starts with every row that can still be read from the old one. A full
        disk or another I/O error propagates: that is not damage, and moving files would not help."""
        from edgecache.data_dir import move_aside, salvage_rows
        from edgecache.health import fault_kind

        path = self.mapping_path
        if path.is_dir():
            problem = "a directory stands where the mapping file should be"
        elif path.is_file() and path.stat().st_size == 0 and any(self._root.rglob("*.usearch")):
            problem = "the mapping is empty (0 bytes) while index files still hold vectors"
        else:
            try:
                return self._connect()
            except sqlite3.DatabaseError as exc:
                if fault_kind(exc) != "damaged":
                    raise
                problem = str(exc)
        lost = self._vectors_in_index_files()
        moved = move_aside(self._root, self._damaged_dir)
        self._root.mkdir(parents=True, exist_ok=True)
        self._connect().close()  # a new, empty mapping (its schema), filled below before it serves
        kept = salvage_rows(moved / path.name, path, "vectors", "tenant, scenario, store_key, text, vector")
        db = self._connect()
        report = (f"semantic mapping {path} was damaged ({problem}); moved it and its index files to {moved}, "
                  f"kept {kept} vectors readable from it")
        if kept == 0 and lost:
            report += f"; {lost} vectors in the index files had no readable mapping (prompt and answer key) and " \
                      "were dropped: their answers stay in the result store, and paraphrases are learnt again"
        self.repairs.append(report)
        return db

    def _vectors_in_index_files(self) -> int:
        total = 0
        for path in self._root.rglob("*.usearch"):
            index = self._new_index()
            try:
                index.load(str(path))
            except (RuntimeError, ValueError, OSError):
                continue
            total += len(index)
        return total

    def _as_vector(self, vector: np.ndarray) -> np.ndarray:
        vec = np.asarray(vector, dtype=np.float32).reshape(-1)
        if vec.shape != (self.dim,):
            raise ValueError(f"vector has {vec.size} values, the index expects {self.dim}")
        return vec

    def _index_path(self, tenant: str, scenario: str) -> Path:
        return self._root / _path_part(tenant) / f"{_path_part(scenario)}.usearch"

    def _known_ids(self) -> set[IndexId]:
        rows = self._db.execute("SELECT DISTINCT tenant, scenario FROM vectors").fetchall()
        return {(t, s) for t, s in rows} | set(self._indexes)

    def _new_index(self) -> Index:
        return make_index(self.dim, self.dtype, connectivity=self._connectivity, expansion_add=self._expansion_add,
                          expansion_search=self._expansion_search)

    def _open(self, tenant: str, scenario: str) -> Index:
        """The in-memory index, loaded and reconciled with the mapping on first use."""
        if self._closed:
            raise RuntimeError("SemanticIndex is closed")
        index_id = (tenant, scenario)
        index = self._indexes.get(index_id)
        if index is not None:
            return index
        index = self._new_index()
        path = self._index_path(tenant, scenario)
        if path.exists():
            try:
                index.load(str(path))
            except (RuntimeError, ValueError, OSError):
                # Unreadable (should not happen with os.replace, but disks lie): rebuild from the mapping below.
                index = self._new_index()
        rows = self._db.execute("SELECT key FROM vectors WHERE tenant=? AND scenario=?", index_id).fetchall()
        wanted = {row[0] for row in rows}
        # All keys in one call: iterating index.keys asks for them one offset at a time, each a scan (quadratic:
        # 18 s for the first lookup after a restart at 50k vectors, hours at 1M).
        present = set(np.asarray(index.keys, dtype=np.uint64).tolist()) if len(index) else set()
        stale = present - wanted
        if stale:
            index.remove(np.fromiter(stale, dtype=np.uint64))
        missing = sorted(wanted - present)
        for start in range(0, len(missing), 4096):
            chunk = missing[start : start + 4096]
            got = self._db.execute(
                f"SELECT key, vector FROM vectors WHERE key IN ({','.join('?' * len(chunk))})", chunk
            ).fetchall()
            keys = np.array([key for key, _ in got], dtype=np.uint64)
            vecs = np.stack([np.frombuffer(blob, dtype=np.float16) for _, blob in got]).astype(np.float32)
            index.add(keys, vecs)
        self._indexes[index_id] = index
        if stale or missing:
            self._dirty.add(index_id)
        return index

    def _remove_keys(self, tenant: str, scenario: str, keys: list[int]) -> int:
        if not keys:
            return 0
        index = self._open(tenant, scenario)
        removed = 0
        for start in range(0, len(keys), 500):
            chunk = keys[start : start + 500]
            cur = self._db.execute(
                f"DELETE FROM vectors WHERE tenant=? AND scenario=? AND key IN ({','.join('?' * len(chunk))})",
                [tenant, scenario, *chunk],
            )
            removed += cur.rowcount
            index.remove(np.array(chunk, dtype=np.uint64))
        self._dirty.add((tenant, scenario))
        self._counted(tenant, scenario, -removed)
        return removed

    def _drop_index(self, tenant: str, scenario: str) -> None:
        """Forget one index: its rows, its memory and its file."""
        self._db.execute("DELETE FROM vectors WHERE tenant=? AND scenario=?", (tenant, scenario))
        self._release_index(tenant, scenario)

    def _release_index(self, tenant: str, scenario: str) -> None:
        """An index that holds nothing (any more): out of memory, its file gone, no longer one of the tenant's."""
        self._indexes.pop((tenant, scenario), None)
        self._dirty.discard((tenant, scenario))
        self._index_path(tenant, scenario).unlink(missing_ok=True)
        used = self._usage.get(tenant)
        if used is not None:
            used.pop(scenario, None)
            if not used:
                del self._usage[tenant]
        if self.on_release is not None:
            self.on_release(tenant, scenario)

    def _read_usage(self) -> dict[str, OrderedDict[str, int]]:
        """Each tenant's indexes and their sizes from the mapping, the most recently added to last."""
        usage: dict[str, OrderedDict[str, int]] = {}
        rows = self._db.execute("SELECT tenant, scenario, COUNT(*), MAX(key) FROM vectors GROUP BY tenant, scenario "
                                "ORDER BY MAX(key)")
        for tenant, scenario, count, _ in rows:
            usage.setdefault(tenant, OrderedDict())[scenario] = count
        return usage

    def _counted(self, tenant: str, scenario: str, change: int) -> None:
        """``change`` vectors more (an addition: the index is now the tenant's most recently used) or fewer (its
        place stays) in an index; one left empty is released (:meth:`_release_index`), so emptied indexes never
        pile up in memory."""
        used = self._usage.setdefault(tenant, OrderedDict())
        count = used.get(scenario, 0) + change
        if count <= 0:
            self._release_index(tenant, scenario)
            return
        used[scenario] = count
        if change > 0:
            used.move_to_end(scenario)

    def _index_cap(self, bounds: TenantBounds | None) -> int:
        per_index = bounds.vectors_per_index if bounds is not None else None
        return min(per_index, self.max_vectors) if per_index is not None else self.max_vectors

    def _make_room(self, tenant: str, scenario: str, incoming: int, bounds: TenantBounds | None) -> None:
        """Before ``incoming`` vectors join ``tenant``'s index ``scenario``: its oldest vectors go past the index's
        cap; past the tenant's bound on indexes, its least recently used other indexes go whole; past its bound on
        vectors, the oldest vectors of its least recently used indexes (this one last). Only this tenant's."""
        overflow = self._usage.get(tenant, {}).get(scenario, 0) + incoming - self._index_cap(bounds)
        if overflow > 0:
            self._remove_oldest(tenant, scenario, overflow)
        if bounds is None:
            return
        used = self._usage.get(tenant, OrderedDict())
        if bounds.indexes is not None and scenario not in used:
            for name in list(used)[:max(0, len(used) + 1 - bounds.indexes)]:
                self._drop_index(tenant, name)
        if bounds.vectors is not None:
            used = self._usage.get(tenant, OrderedDict())
            excess = sum(used.values()) + incoming - bounds.vectors
            for name in [n for n in used if n != scenario] + [scenario]:
                if excess <= 0:
                    break
                held = used.get(name, 0)
                if held and held <= excess and name != scenario:
                    self._drop_index(tenant, name)
                    excess -= held
                elif held:
                    excess -= self._remove_oldest(tenant, name, min(held, excess))

    def _remove_oldest(self, tenant: str, scenario: str, count: int) -> int:
        oldest = [row[0] for row in self._db.execute(
            "SELECT key FROM vectors WHERE tenant=? AND scenario=? ORDER BY key LIMIT ?", (tenant, scenario, count))]
        return self._remove_keys(tenant, scenario, oldest)
