"""The data directory's own rules: one server at a time, and damaged files moved aside rather than deleted.

:class:`DataDirLock` holds an ``flock`` on ``<data dir>/.lock`` for as long as a server (or an offline warmup) uses
the directory. Two processes writing one diskcache and one semantic mapping would each keep an in-memory view the
other invalidates; refusing the second one with a clear message is the only safe answer. ``flock`` is released by
the kernel when the process dies, so a ``kill -9`` never leaves a stale lock behind.

:func:`move_aside` moves a damaged file (or directory) into ``<data dir>/damaged/`` with a timestamp, so the store
can be rebuilt in its place and the operator can still inspect (or restore) what was there.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
import time
from pathlib import Path

from edgecache.settings import SettingsError

LOCK_NAME = ".lock"
DAMAGED_DIR = "damaged"


class DataDirBusy(SettingsError):
    """Another process holds the data directory."""


class DataDirLock:
    """An exclusive, non-blocking lock on a data directory. :meth:`acquire`, then :meth:`release` (safe twice)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self.path = self.data_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> DataDirLock:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise DataDirBusy(f"the data dir {self.data_dir} is in use by another EdgeCache process (pid {holder}); "
                              "stop it first, or give this one another --data-dir") from None
        try:  # who holds it, for the next one's message; best effort (a full disk has no room for it)
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
        except OSError:
            pass
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        finally:
            os.close(fd)  # closing the descriptor drops the flock

    def __enter__(self) -> DataDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def ensure_free(data_dir: Path) -> None:
    """Raise :class:`DataDirBusy` when another process holds ``data_dir`` (a check before a slow start-up; the
    lock itself is taken by the server's lifespan)."""
    DataDirLock(data_dir).acquire().release()


def move_aside(path: Path, into: Path, *related: Path) -> Path:
    """Move ``path`` (and ``related`` files, e.g. SQLite's ``-wal``/``-shm``, when they exist) into the folder
    ``into`` (the data dir's ``damaged/``) under a timestamped name; return where ``path`` went."""
    path = Path(path)
    into.mkdir(parents=True, exist_ok=True)
    stem = f"{time.strftime('%Y%m%dT%H%M%S')}-" + "_".join(path.resolve().parts[-3:])
    moved = into / stem
    n = 1
    while moved.exists() or any(moved.with_name(moved.name + Path(e).name.removeprefix(path.name)).exists()
                                for e in related):
        moved = into / f"{stem}.{n}"
        n += 1
    shutil.move(str(path), str(moved))
    for extra in related:
        if Path(extra).exists():
            shutil.move(str(extra), str(moved.with_name(moved.name + Path(extra).name.removeprefix(path.name))))
    return moved


def salvage_rows(old_db: Path, new_db: Path, table: str, columns: str) -> int:
    """Copy every row of ``table`` still readable from a damaged SQLite file into ``new_db`` (same schema, rowids
    kept). Rows are read in rowid order; at a damaged page the read skips ahead (1, 2, 4, ... rowids) until it
    finds readable rows again, so one bad page costs the rows on it, not the rest of the file. Returns how many
    rows came through."""
    if not Path(old_db).is_file() or Path(old_db).stat().st_size == 0:
        return 0
    try:
        old = sqlite3.connect(f"file:{old_db}?mode=ro", uri=True)
    except sqlite3.Error:
        return 0
    new = sqlite3.connect(new_db, isolation_level=None)
    width = columns.count(",") + 2
    insert = f"INSERT OR IGNORE INTO {table} (rowid, {columns}) VALUES ({', '.join('?' * width)})"
    kept, last, skip = 0, -(1 << 62), 1

    def write(rows: list[tuple[object, ...]]) -> None:
        nonlocal kept
        if rows:
            new.execute("BEGIN")
            new.executemany(insert, rows)
            new.execute("COMMIT")
            kept += len(rows)
            rows.clear()

    try:
        while skip < (1 << 40):
            batch: list[tuple[object, ...]] = []
            try:
                for row in old.execute(f"SELECT rowid, {columns} FROM {table} WHERE rowid > ? ORDER BY rowid",
                                       (last,)):
                    batch.append(row)
                    last, skip = row[0], 1
                    if len(batch) >= 1000:
                        write(batch)
                write(batch)
                break  # read to the end
            except sqlite3.DatabaseError:
                write(batch)
                if last == -(1 << 62):
                    break  # not even the first row: the table's root is gone
                last += skip  # past the damaged page, probably
                skip *= 2
    finally:
        old.close()
        new.close()
    return kept
