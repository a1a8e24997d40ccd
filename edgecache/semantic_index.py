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

Everything here blocks (disk, SQLite, graph search); callers run it off the event loop. One lock serialises all
calls: a search at 1M vectors takes well under a millisecond, so finer locking would buy little.

usearch 2.26.2-2.26.6 segfault when imported before onnxruntime; the pin in docs/notes/semantic.md avoids those releases
and tests/test_import_order.py proves both orders work.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterable
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


class Candidate(msgspec.Struct, frozen=True):
    """A stored prompt near the query: the caller applies threshold and guard, then reads ``store_key``."""

    similarity: float
    store_key: str
    text: str
    vector_key: int


def _path_part(name: str) -> str:
    # Tenant and scenario names come from config; quote them so none can escape the data dir ("..", "/").
    return quote(name, safe="-_").replace(".", "%2E") or "%00"


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
        expansion_search: int = 64,
    ) -> None:
        if dtype not in ("f16", "i8"):
            raise ValueError(f"dtype must be 'f16' or 'i8', not {dtype!r}")
        self.dim = dim
        self.dtype: VectorDType = dtype
        self.max_vectors = max_vectors
        self._connectivity = connectivity
        self._expansion_search = expansion_search
        self._root = Path(data_dir) / _path_part(embedder_version)
        self._root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._indexes: dict[IndexId, Index] = {}
        self._dirty: set[IndexId] = set()
        self._db = sqlite3.connect(self._root / "mapping.sqlite3", check_same_thread=False, isolation_level=None)
        # WAL + NORMAL: a commit survives a process kill (not necessarily a power cut), without an fsync per add.
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._closed = False

    # ---- public API ----

    def add(self, tenant: str, scenario: str, vector: np.ndarray, store_key: str, text: str,
            max_vectors: int | None = None) -> int:
        """Store ``vector`` (L2-normalised, shape (dim,)) pointing at ``store_key``; return its vector key.

        At the cap (``max_vectors``, e.g. the tenant's plan, else the index's own), the oldest vectors of that
        index are removed first (FIFO).
        """
        vec = self._as_vector(vector)
        cap = min(max_vectors, self.max_vectors) if max_vectors is not None else self.max_vectors
        with self._lock:
            index = self._open(tenant, scenario)
            overflow = len(index) + 1 - cap
            if overflow > 0:
                oldest = [
                    row[0]
                    for row in self._db.execute(
                        "SELECT key FROM vectors WHERE tenant=? AND scenario=? ORDER BY key LIMIT ?",
                        (tenant, scenario, overflow),
                    )
                ]
                self._remove_keys(tenant, scenario, oldest)
            cur = self._db.execute(
                "INSERT INTO vectors (tenant, scenario, store_key, text, vector) VALUES (?, ?, ?, ?, ?)",
                (tenant, scenario, store_key, text, vec.astype(np.float16).tobytes()),
            )
            key = int(cur.lastrowid or 0)
            index.add(key, vec)
            self._dirty.add((tenant, scenario))
            return key

    def search(self, tenant: str, scenario: str, vector: np.ndarray, k: int = 4) -> list[Candidate]:
        """The ``k`` nearest stored prompts of this tenant and scenario, most similar first."""
        vec = self._as_vector(vector)
        with self._lock:
            index = self._open(tenant, scenario)
            if len(index) == 0:
                return []
            matches = index.search(vec, min(k, len(index)))
            keys = [int(key) for key in matches.keys]
            sims = {int(key): 1.0 - float(dist) for key, dist in zip(matches.keys, matches.distances)}
            rows = self._db.execute(
                f"SELECT key, store_key, text FROM vectors WHERE key IN ({','.join('?' * len(keys))})", keys
            ).fetchall()
        found = {key: (store_key, text) for key, store_key, text in rows}
        return [
            Candidate(similarity=sims[key], store_key=found[key][0], text=found[key][1], vector_key=key)
            for key in keys
            if key in found
        ]

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
                self._db.execute("DELETE FROM vectors WHERE tenant=? AND scenario=?", (tenant_, scenario_))
                self._indexes.pop((tenant_, scenario_), None)
                self._dirty.discard((tenant_, scenario_))
                self._index_path(tenant_, scenario_).unlink(missing_ok=True)

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
        from usearch.index import Index

        return Index(
            ndim=self.dim,
            metric="cos",
            dtype=self.dtype,
            connectivity=self._connectivity,
            expansion_search=self._expansion_search,
        )

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
        present = {int(k) for k in index.keys} if len(index) else set()
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
        return removed
