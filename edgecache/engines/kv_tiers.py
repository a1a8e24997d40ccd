"""The CPU engine's prefix states in two tiers: RAM, and a disk tier under the data dir that outlives a restart.

A *state* is one sequence's KV cells after a prompt prefix (llama.cpp's ``llama_state_seq_get_data``: the KV only,
~23 KB a token for SmolLM2 in f16, no logits) with the prefix's token ids. A prompt is served by the state that
shares the longest prefix with it, whichever tier holds it; a disk hit is read back, checked and promoted to RAM.

What a state is keyed by. Its *salt* (the tenant, or ``tenant:cache_salt``): a lookup only ever sees its own salt's
states, and a file's header names its salt, checked again when it loads. Its *context*: an id of everything the KV
depends on (the weights' fingerprint, ``n_ctx``, the KV cache types, flash attention, the llama.cpp build), which
names the directory the files live in; llama.cpp checks only shapes when a state loads, so a state made for another
model file or context is never even listed. And its tokens.

Budgets, least recently used first out. RAM and disk each have a box-wide byte budget, and each tenant a share of
both (its plan's ``prefix_cache_share``), whatever salts it sends. A state pushed out of RAM stays on disk when the
disk tier holds it; one pushed out of both is gone. States a client asked to keep (``keep_s``: an Anthropic
``cache_control`` breakpoint's ttl, OpenAI's ``prompt_cache_retention``) go after the others, until their ttl ends.

Writes. Every state is written to disk on a writer thread (never on the request path; a state that asked for RAM only
is not): to a temporary file, with a CRC-32 of its tokens and KV in the header, fsynced, then renamed into place, so
a ``kill -9`` mid-write leaves a temporary file (removed at the next start) and never a state that loads torn. A file
that fails its checks when read is dropped and counted. A failed write (a full disk) leaves the state in RAM only,
is reported as a storage fault (``/health`` degraded), and the next write that succeeds clears it.

A new state whose tokens extend an older one of the same salt supersedes it (restoring the longer state serves every
prefix of it), so an agent session keeps one state, its latest turn's, not one per turn. A state made at a client's
breakpoint (``anchor``) is never superseded: it is what other sessions sharing that prefix load.

Thread-safety: the engine's thread looks up and puts, the writer thread writes, the event loop reads figures; one
lock guards the maps and counters (never held during file I/O).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import shutil
import threading
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec
import numpy as np

log = logging.getLogger("edgecache")

Tier = Literal["ram", "disk"]
TIERS: tuple[Tier, ...] = ("ram", "disk")
#: Why an engine call found less of its prompt cached than it once could have: no state of that prefix was ever
#: made (or it was flushed), or one was and the RAM tier (with no disk copy) or the disk tier pushed it out.
NEVER_SEEN, EVICTED_RAM, EVICTED_DISK = "never_seen", "evicted_ram", "evicted_disk"
KV_MISS_REASONS = (NEVER_SEEN, EVICTED_RAM, EVICTED_DISK)

#: The fault component the disk tier reports under (/health, edgecache_storage_failures_total).
COMPONENT = "kv_disk"
_MAGIC = b"EDGEKV\x00\x01"
_FORMAT = 1
_SUFFIX = ".kv"
_GHOSTS_PER_SALT = 64


class Faults(Protocol):
    """Where the disk tier reports (:class:`edgecache.health.StorageFaults` is one)."""

    def record(self, component: str, exc: BaseException, *, action: str, path: object = None) -> Any: ...

    def recovered(self, component: str) -> None: ...


def common_prefix(a: Any, b: Any) -> int:
    """How many leading tokens two token sequences share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def _name(text: str | bytes) -> str:
    """A file-system-safe name for a salt, a tenant or a context."""
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return hashlib.blake2b(raw, digest_size=12).hexdigest()


def tenant_of(salt: str) -> str:
    """The tenant a salt belongs to (a caller's ``cache_salt`` namespaces within its tenant: ``tenant:salt``)."""
    return salt.split(":", 1)[0] or "default"


class _Header(msgspec.Struct, frozen=True):
    format: int
    context: str
    salt: str
    tokens: int
    size: int
    crc: int
    keep_until: float = 0.0
    keep_s: float = 0.0
    anchor: bool = False


class StateEntry:
    """One saved prefix state: in RAM (``data``), on disk (``on_disk``), or on its way there (``writing``, its bytes
    in ``pending`` until the write is done, so a state pushed out of RAM meanwhile is still read from memory)."""

    __slots__ = ("anchor", "data", "disk_size", "dropped", "id", "keep_s", "keep_until", "on_disk", "pending",
                 "ram_size", "salt", "tenant", "tokens", "wants_disk", "writing")

    def __init__(self, salt: str, tokens: np.ndarray, *, keep_s: float = 0.0, keep_until: float = 0.0,
                 anchor: bool = False) -> None:
        self.salt, self.tenant, self.tokens = salt, tenant_of(salt), tokens
        self.id = _name(salt.encode("utf-8") + b"\x00" + tokens.astype(np.int32).tobytes())
        self.data: bytearray | None = None
        self.pending: bytearray | None = None  # the bytes on their way to disk (held by the write until it is done)
        self.ram_size = 0
        self.disk_size = 0
        self.on_disk = False
        self.writing = False
        self.wants_disk = True
        self.dropped = False
        self.keep_s, self.keep_until, self.anchor = keep_s, keep_until, anchor

    def held(self) -> bytearray | None:
        """Its bytes, where memory still holds them."""
        return self.data if self.data is not None else self.pending

    def pinned(self, now: float) -> bool:
        return self.keep_until > now


class Found:
    """A lookup's answer: the state, how many of the prompt's tokens it holds, and the tier it is in."""

    __slots__ = ("entry", "length", "tier")

    def __init__(self, entry: StateEntry, length: int, tier: Tier) -> None:
        self.entry, self.length, self.tier = entry, length, tier


class TieredPrefixCache:
    """Prefix states in RAM and on disk, within box-wide and per-tenant byte budgets (see the module)."""

    def __init__(self, *, ram_bytes: int, disk_bytes: int = 0, root: Path | None = None, context: str = "",
                 share_for: Callable[[str], float] | None = None, faults: Faults | None = None,
                 clock: Callable[[], float] = time.time, max_pending_bytes: int | None = None) -> None:
        self.ram_budget = int(ram_bytes)
        self.disk_budget = int(disk_bytes) if root is not None else 0
        self.context = context
        self._dir = root / _name(context) if root is not None and self.disk_budget else None
        self._root = root
        self.share_for = share_for or (lambda tenant: 1.0)
        self.faults = faults
        self._clock = clock
        self._lock = threading.Lock()
        self._by_salt: dict[str, dict[str, StateEntry]] = {}
        self._ram: OrderedDict[str, StateEntry] = OrderedDict()   # least recently used first
        self._disk: OrderedDict[str, StateEntry] = OrderedDict()  # on disk or being written, LRU first
        self._ram_by_tenant: dict[str, int] = {}
        self._disk_by_tenant: dict[str, int] = {}
        self._ghosts: dict[str, deque[tuple[np.ndarray, str]]] = {}
        self._foreign: list[tuple[float, Path, int]] = []  # other contexts' directories: (mtime, path, bytes)
        self._pending_bytes = 0
        self._pending = 0
        self._max_pending = max_pending_bytes if max_pending_bytes is not None else max(ram_bytes, 64 << 20)
        self.lookups = 0
        self.hits: dict[Tier, int] = {"ram": 0, "disk": 0}
        self.hit_tokens: dict[Tier, int] = {"ram": 0, "disk": 0}
        self.evictions: dict[Tier, int] = {"ram": 0, "disk": 0}
        self.writes = 0
        self.write_failures = 0
        self.writes_skipped = 0
        self.damaged = 0
        self._jobs: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        if self._dir is not None:
            try:
                self._open()
            except OSError as exc:  # a data dir that cannot hold the tier: RAM only, said on /health
                self._dir, self.disk_budget = None, 0
                self._by_salt.clear()
                self._disk.clear()
                self._disk_by_tenant.clear()
                if self.faults is not None:
                    self.faults.record(COMPONENT, exc, action="the disk tier is off; prefix states stay in RAM",
                                       path=root)
                else:
                    log.warning("prefix cache: the disk tier is off (%s): prefix states stay in RAM", exc)
        if self._dir is not None:
            self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
            self._writer.start()

    # ---- looking up ----------------------------------------------------------------------------------------

    def best(self, salt: str, tokens: list[int] | np.ndarray) -> Found | None:
        """The state of ``salt`` sharing the longest prefix with ``tokens`` (RAM first among equals), or None."""
        with self._lock:
            self.lookups += 1
            best: Found | None = None
            for entry in (self._by_salt.get(salt) or {}).values():
                n = common_prefix(entry.tokens, tokens)
                if n == 0:
                    continue
                tier: Tier = "ram" if entry.held() is not None else "disk"
                if best is None or n > best.length or (n == best.length and tier == "ram" and best.tier == "disk"):
                    best = Found(entry, n, tier)
            return best

    def miss_reason(self, salt: str, tokens: list[int] | np.ndarray, cached: int, *, min_tokens: int) -> str | None:
        """Why a call that found ``cached`` tokens could have found more: a state that held at least ``min_tokens``
        more of the prompt was evicted (from RAM with no disk copy, or from disk), or, with nothing cached at all,
        no such state was made. None when nothing better was lost."""
        with self._lock:
            lost, reason = cached, None
            for ghost, why in self._ghosts.get(salt, ()):
                n = common_prefix(ghost, tokens)
                if n >= lost + min_tokens:
                    lost, reason = n, why
        if reason is None and cached == 0 and len(tokens) >= min_tokens:
            return NEVER_SEEN
        return reason

    def load(self, found: Found) -> bytearray | None:
        """The state's KV bytes, read from disk (checked, then promoted to RAM) when it is not in RAM; a hit is
        counted in the tier it came from. None when the file is gone or fails its checks (dropped and counted)."""
        entry, now = found.entry, self._clock()
        with self._lock:
            data = entry.held()
            if data is not None:
                if entry.data is None:
                    self._to_ram(entry, data, now)  # pushed out of RAM while its write was under way
                else:
                    self._ram.move_to_end(entry.id)
                self._touch(entry, now)
                self.hits["ram"] += 1
                self.hit_tokens["ram"] += found.length
                return data
        data = self._read(entry)
        if data is None:
            return None
        with self._lock:
            if entry.dropped:
                return data  # flushed meanwhile: serve this once, keep nothing
            self.hits["disk"] += 1
            self.hit_tokens["disk"] += found.length
            self._touch(entry, now)
            self._to_ram(entry, data, now)
        self._jobs.put(("touch", entry))
        return data

    def _touch(self, entry: StateEntry, now: float) -> None:
        """A read refreshes what the client asked to keep, and the state's place in the disk tier's LRU."""
        if entry.keep_s:
            entry.keep_until = max(entry.keep_until, now + entry.keep_s)
        if entry.id in self._disk:
            self._disk.move_to_end(entry.id)

    def keep(self, entry: StateEntry, keep_s: float, *, disk: bool = False) -> None:
        """A client asked to keep a prefix this state holds: keep the state at least ``keep_s`` from now (``disk``:
        on the disk tier too, written now if it is in RAM only)."""
        with self._lock:
            now = self._clock()
            entry.keep_s = max(entry.keep_s, keep_s)
            entry.keep_until = max(entry.keep_until, now + keep_s)
            if not disk or entry.dropped or entry.on_disk or entry.writing or self._dir is None:
                return
            data = entry.held()
            if data is None:
                return
            entry.wants_disk = True
            self._write_later(entry, data, now)

    def _write_later(self, entry: StateEntry, data: bytearray, now: float) -> bool:
        """Reserve the state's room on disk and queue its write (lock held); False when it fits no budget or the
        disk is too far behind."""
        if not self._reserve_disk(entry, len(data) + entry.tokens.nbytes, now):
            entry.wants_disk = False
            return False
        if self._pending_bytes + len(data) > self._max_pending:
            self.writes_skipped += 1  # the disk is behind: this one stays in RAM only
            self._release_disk(entry)
            return False
        entry.writing, entry.pending = True, data
        self._pending_bytes += len(data)
        self._pending += 1
        self._jobs.put(("write", (entry, data)))
        return True

    # ---- saving --------------------------------------------------------------------------------------------

    def put(self, salt: str, tokens: np.ndarray, data: bytearray, *, keep_s: float = 0.0, disk: bool = True,
            anchor: bool = False) -> StateEntry | None:
        """Save a state (``disk``: also write it to the disk tier). It supersedes the states of its salt that it
        extends (not those made at a breakpoint). None when it fits neither tier's budget for its tenant."""
        now = self._clock()
        entry = StateEntry(salt, tokens, keep_s=keep_s, keep_until=now + keep_s if keep_s else 0.0, anchor=anchor)
        entry.wants_disk = disk and self._dir is not None
        with self._lock:
            entries = self._by_salt.setdefault(salt, {})
            old = entries.get(entry.id)
            if old is not None:  # the same prefix again: keep the longer pin, replace the bytes
                entry.keep_s, entry.keep_until = max(old.keep_s, keep_s), max(old.keep_until, entry.keep_until)
                entry.anchor = old.anchor or anchor
                if old.on_disk or old.writing:
                    self._to_ram(old, data, now)
                    old.keep_s, old.keep_until, old.anchor = entry.keep_s, entry.keep_until, entry.anchor
                    return old
                self._drop(old)
            for other in list(entries.values()):
                if other.anchor or len(other.tokens) > len(tokens):
                    continue
                if (other.on_disk or other.writing) and not entry.wants_disk:
                    continue  # the new one stays in RAM only: the older disk copy still outlives a restart
                if common_prefix(other.tokens, tokens) == len(other.tokens):
                    entry.keep_s = max(entry.keep_s, other.keep_s)
                    entry.keep_until = max(entry.keep_until, other.keep_until)
                    self._drop(other)
            entries[entry.id] = entry
            in_ram = self._to_ram(entry, data, now)
            on_disk = entry.wants_disk and self._write_later(entry, data, now)
            if not in_ram and not on_disk:
                del entries[entry.id]
                entry.dropped = True
                return None
        return entry

    def _to_ram(self, entry: StateEntry, data: bytearray, now: float) -> bool:
        """Hold ``data`` in RAM within the budgets (lock held); False when it is larger than the tenant's share."""
        size = len(data) + entry.tokens.nbytes
        share = int(self.ram_budget * min(1.0, self.share_for(entry.tenant)))
        if size > share:
            return False
        if entry.data is not None:
            self._ram_by_tenant[entry.tenant] -= entry.ram_size
        entry.data, entry.ram_size = data, size
        self._ram[entry.id] = entry
        self._ram.move_to_end(entry.id)
        self._ram_by_tenant[entry.tenant] = self._ram_by_tenant.get(entry.tenant, 0) + size
        while self._ram_by_tenant[entry.tenant] > share:
            self._evict_ram(self._victim(self._ram, now, entry.tenant, keep=entry))
        while sum(self._ram_by_tenant.values()) > self.ram_budget:
            self._evict_ram(self._victim(self._ram, now, None, keep=entry))
        return True

    def _reserve_disk(self, entry: StateEntry, size: int, now: float) -> bool:
        share = int(self.disk_budget * min(1.0, self.share_for(entry.tenant)))
        if size > share:
            return False
        entry.disk_size = size
        self._disk[entry.id] = entry
        self._disk_by_tenant[entry.tenant] = self._disk_by_tenant.get(entry.tenant, 0) + size
        while self._disk_by_tenant[entry.tenant] > share:
            self._evict_disk(self._victim(self._disk, now, entry.tenant, keep=entry))
        while sum(self._disk_by_tenant.values()) + self._foreign_bytes() > self.disk_budget:
            if self._foreign:
                self._drop_foreign()
            else:
                self._evict_disk(self._victim(self._disk, now, None, keep=entry))
        return True

    @staticmethod
    def _victim(order: OrderedDict[str, StateEntry], now: float, tenant: str | None, *,
                keep: StateEntry) -> StateEntry:
        """The least recently used state (of ``tenant``, or anyone's) that nobody asked to keep; failing that, the
        least recently used kept one. Never ``keep``, which is what made room necessary."""
        fallback = None
        for entry in order.values():
            if entry is keep or (tenant is not None and entry.tenant != tenant):
                continue
            if not entry.pinned(now):
                return entry
            fallback = fallback or entry
        assert fallback is not None, "a budget holds more than its states"
        return fallback

    def _evict_ram(self, entry: StateEntry) -> None:
        self.evictions["ram"] += 1
        self._release_ram(entry)
        if not (entry.on_disk or entry.writing):
            self._ghost(entry, EVICTED_RAM)
            self._forget(entry)

    def _evict_disk(self, entry: StateEntry) -> None:
        self.evictions["disk"] += 1
        self._release_disk(entry)
        self._jobs.put(("unlink", entry))
        if entry.data is None:
            self._ghost(entry, EVICTED_DISK)
            self._forget(entry)

    def _release_ram(self, entry: StateEntry) -> None:
        if entry.data is not None:
            self._ram_by_tenant[entry.tenant] -= entry.ram_size
            entry.data, entry.ram_size = None, 0
            self._ram.pop(entry.id, None)

    def _release_disk(self, entry: StateEntry) -> None:
        if self._disk.pop(entry.id, None) is not None:
            self._disk_by_tenant[entry.tenant] -= entry.disk_size
        entry.on_disk = entry.wants_disk = False

    def _forget(self, entry: StateEntry) -> None:
        entry.dropped = True
        entries = self._by_salt.get(entry.salt)
        if entries is not None and entries.get(entry.id) is entry:
            del entries[entry.id]
            if not entries:
                del self._by_salt[entry.salt]

    def _drop(self, entry: StateEntry) -> None:
        """Superseded or flushed: out of both tiers, no ghost."""
        self._release_ram(entry)
        if entry.id in self._disk:
            self._release_disk(entry)
            self._jobs.put(("unlink", entry))
        self._forget(entry)

    def _ghost(self, entry: StateEntry, reason: str) -> None:
        ghosts = self._ghosts.setdefault(entry.salt, deque(maxlen=_GHOSTS_PER_SALT))
        ghosts.append((entry.tokens, reason))

    # ---- flushing ------------------------------------------------------------------------------------------

    def drop_tenant(self, tenant: str | None) -> int:
        """Drop a tenant's states (every salt of it; None: everyone's) from both tiers; returns how many."""
        with self._lock:
            doomed = [e for entries in self._by_salt.values() for e in entries.values()
                      if tenant is None or e.tenant == tenant]
            for entry in doomed:
                self._release_ram(entry)
                if self._disk.pop(entry.id, None) is not None:
                    self._disk_by_tenant[entry.tenant] -= entry.disk_size
                entry.on_disk = entry.wants_disk = False
                self._forget(entry)
            for salt in [s for s in self._ghosts if tenant is None or tenant_of(s) == tenant]:
                del self._ghosts[salt]
        if self._dir is not None:  # at once, not queued: a crash right after a flush must not bring them back
            targets = [self._dir] if tenant is None else [self._dir / _name(tenant)]
            for path in targets:
                shutil.rmtree(path, ignore_errors=True)
        return len(doomed)

    def close(self) -> None:
        """Finish the writes under way (they are what a restart finds), then stop the writer."""
        if self._writer is not None:
            self._jobs.put(None)
            self._writer.join()
            self._writer = None

    def drain(self) -> None:
        """Wait until every write queued so far is done (tests, and a benchmark before it restarts a server)."""
        if self._writer is not None:
            done = threading.Event()
            self._jobs.put(("mark", done))
            done.wait()

    # ---- figures -------------------------------------------------------------------------------------------

    def usage(self) -> dict[str, dict[Tier, int]]:
        """Each tenant's bytes in RAM and on disk."""
        with self._lock:
            tenants = set(self._ram_by_tenant) | set(self._disk_by_tenant)
            return {t: {"ram": self._ram_by_tenant.get(t, 0), "disk": self._disk_by_tenant.get(t, 0)}
                    for t in sorted(tenants) if self._ram_by_tenant.get(t, 0) or self._disk_by_tenant.get(t, 0)}

    def figures(self) -> dict[str, float | int]:
        with self._lock:
            ram = sum(self._ram_by_tenant.values())
            disk = sum(self._disk_by_tenant.values())
            return {"prefix_cache_entries": sum(len(e) for e in self._by_salt.values()),
                    "prefix_cache_bytes": ram, "prefix_cache_ram_bytes": ram,
                    "prefix_cache_ram_budget_bytes": self.ram_budget,
                    "prefix_cache_ram_entries": len(self._ram),
                    "prefix_cache_disk_bytes": disk, "prefix_cache_disk_budget_bytes": self.disk_budget,
                    "prefix_cache_disk_entries": len(self._disk),
                    "prefix_cache_lookups": self.lookups,
                    "prefix_cache_hits": self.hits["ram"] + self.hits["disk"],
                    "prefix_cache_hits_ram": self.hits["ram"], "prefix_cache_hits_disk": self.hits["disk"],
                    "prefix_cache_hit_tokens_ram": self.hit_tokens["ram"],
                    "prefix_cache_hit_tokens_disk": self.hit_tokens["disk"],
                    "prefix_cache_evictions_ram": self.evictions["ram"],
                    "prefix_cache_evictions_disk": self.evictions["disk"],
                    "prefix_cache_disk_writes": self.writes, "prefix_cache_disk_write_failures": self.write_failures,
                    "prefix_cache_disk_writes_skipped": self.writes_skipped,
                    "prefix_cache_disk_writes_pending": self._pending,
                    "prefix_cache_disk_damaged": self.damaged,
                    "kv_usage_ratio": ram / self.ram_budget if self.ram_budget else 0.0}

    # ---- the disk tier -------------------------------------------------------------------------------------

    def _path(self, entry: StateEntry) -> Path:
        assert self._dir is not None
        return self._dir / _name(entry.tenant) / (entry.id + _SUFFIX)

    def _open(self) -> None:
        """Rebuild the index from the files of this context (headers only; no KV is read), least recently used
        first; remove temporary files a crash left; count other contexts' directories against the budget."""
        assert self._dir is not None and self._root is not None
        self._dir.mkdir(parents=True, exist_ok=True)
        for other in self._root.iterdir():
            if other.is_dir() and other != self._dir:
                files = [p for p in other.rglob("*") if p.is_file()]
                size = sum(p.stat().st_size for p in files)
                mtime = max((p.stat().st_mtime for p in files), default=0.0)
                self._foreign.append((mtime, other, size))
        self._foreign.sort()
        found: list[tuple[float, StateEntry]] = []
        for path in self._dir.glob("*/*"):
            if path.name.endswith(_SUFFIX):
                entry = self._index(path)
                if entry is not None:
                    found.append((path.stat().st_mtime, entry))
            else:
                path.unlink(missing_ok=True)  # a write a crash cut short
        now = self._clock()
        for _, entry in sorted(found, key=lambda f: f[0]):
            entries = self._by_salt.setdefault(entry.salt, {})
            entries[entry.id] = entry
            self._disk[entry.id] = entry
            self._disk_by_tenant[entry.tenant] = self._disk_by_tenant.get(entry.tenant, 0) + entry.disk_size
        while self._disk and sum(self._disk_by_tenant.values()) + self._foreign_bytes() > self.disk_budget:
            if self._foreign:
                self._drop_foreign()
            else:
                victim = self._victim(self._disk, now, None, keep=None)  # type: ignore[arg-type]
                self._release_disk(victim)
                self._path(victim).unlink(missing_ok=True)
                self._forget(victim)
        if found:
            log.info("prefix cache: %d states on disk (%.0f MiB) for this model and context", len(self._disk),
                     sum(self._disk_by_tenant.values()) / 2**20)

    def _foreign_bytes(self) -> int:
        return sum(size for _, _, size in self._foreign)

    def _drop_foreign(self) -> None:
        _, path, _ = self._foreign.pop(0)
        log.info("prefix cache: removing %s, states of another model or context, to stay within the disk budget",
                 path)
        shutil.rmtree(path, ignore_errors=True)

    def _index(self, path: Path) -> StateEntry | None:
        try:
            with path.open("rb") as f:
                header, tokens = self._read_head(f)
            size = path.stat().st_size
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            self._damaged(path, exc)
            return None
        if header.context != self.context or size != self._file_size(header):
            self._damaged(path, ValueError("its header does not match its context or its size"))
            return None
        entry = StateEntry(header.salt, tokens, keep_s=header.keep_s, keep_until=header.keep_until,
                           anchor=header.anchor)
        if path.name != entry.id + _SUFFIX or path.parent.name != _name(entry.tenant):
            self._damaged(path, ValueError("its name does not match its salt and tokens"))
            return None
        entry.on_disk, entry.disk_size = True, size
        return entry

    @staticmethod
    def _read_head(f: Any) -> tuple[_Header, np.ndarray]:
        magic = f.read(len(_MAGIC))
        if magic != _MAGIC:
            raise ValueError("not a prefix state file")
        length = int.from_bytes(f.read(4), "little")
        header = msgspec.msgpack.decode(f.read(length), type=_Header)
        if header.format != _FORMAT:
            raise ValueError(f"format {header.format}, not {_FORMAT}")
        raw = f.read(4 * header.tokens)
        if len(raw) != 4 * header.tokens:
            raise ValueError("cut short")
        return header, np.frombuffer(raw, dtype=np.int32).astype(np.intc)

    @staticmethod
    def _file_size(header: _Header) -> int:
        head = len(msgspec.msgpack.encode(header))
        return len(_MAGIC) + 4 + head + 4 * header.tokens + header.size

    def _read(self, entry: StateEntry) -> bytearray | None:
        path = self._path(entry)
        try:
            with path.open("rb") as f:
                header, tokens = self._read_head(f)
                if header.context != self.context or header.salt != entry.salt or \
                        not np.array_equal(tokens, entry.tokens):
                    raise ValueError("its header names another context, salt or prefix")
                data = bytearray(header.size)
                if f.readinto(data) != header.size or f.read(1):
                    raise ValueError("its size is not the header's")
            if zlib.crc32(data, zlib.crc32(tokens.astype(np.int32).tobytes())) != header.crc:
                raise ValueError("its checksum does not match")
        except FileNotFoundError as exc:
            self._lost(entry, exc)
            return None
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            self._damaged(path, exc)
            self._lost(entry, None)
            return None
        return data

    def _lost(self, entry: StateEntry, exc: BaseException | None) -> None:
        with self._lock:
            self._release_disk(entry)
            if entry.data is None:
                self._forget(entry)
        if exc is not None and self.faults is not None:
            self.faults.record(COMPONENT, exc, action="state dropped", path=self._path(entry))

    def _damaged(self, path: Path, exc: BaseException) -> None:
        self.damaged += 1
        log.warning("prefix cache: dropping damaged state %s: %s", path, exc)
        path.unlink(missing_ok=True)

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            kind, arg = job
            try:
                if kind == "write":
                    self._write(*arg)
                elif kind == "unlink":
                    self._path(arg).unlink(missing_ok=True)
                elif kind == "touch":
                    os.utime(self._path(arg))
                elif kind == "mark":
                    arg.set()
            except FileNotFoundError:
                pass  # dropped or flushed meanwhile
            except Exception:  # the writer must outlive any one job
                log.exception("prefix cache: the disk writer failed on a %s", kind)

    def _write(self, entry: StateEntry, data: bytearray) -> None:
        path = self._path(entry)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        try:
            with self._lock:
                wanted = entry.wants_disk and not entry.dropped
            if wanted:
                tokens = entry.tokens.astype(np.int32).tobytes()
                header = _Header(format=_FORMAT, context=self.context, salt=entry.salt, tokens=len(entry.tokens),
                                 size=len(data), crc=zlib.crc32(data, zlib.crc32(tokens)), keep_until=entry.keep_until,
                                 keep_s=entry.keep_s, anchor=entry.anchor)
                head = msgspec.msgpack.encode(header)
                path.parent.mkdir(parents=True, exist_ok=True)
                with tmp.open("wb") as f:
                    for part in (_MAGIC, len(head).to_bytes(4, "little"), head, tokens, data):
                        f.write(part)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._pending_bytes -= len(data)
                self._pending -= 1
                entry.writing, entry.pending = False, None
                if entry.dropped:  # flushed while it was written (its directory went): nothing failed
                    return
                self.write_failures += 1
                self._release_disk(entry)
                if entry.data is None:
                    self._forget(entry)
            if self.faults is not None:
                self.faults.record(COMPONENT, exc, action="state kept in RAM only", path=path)
            return
        with self._lock:
            self._pending_bytes -= len(data)
            self._pending -= 1
            entry.writing, entry.pending = False, None
            if not wanted:
                return
            if entry.wants_disk and not entry.dropped:
                entry.on_disk = True
                self.writes += 1
                keep = True
            else:
                keep = False
        if not keep:  # evicted or flushed while it was written
            path.unlink(missing_ok=True)
        elif self.faults is not None:
            self.faults.recovered(COMPONENT)

    def entries(self) -> Iterator[StateEntry]:
        with self._lock:
            return iter([e for entries in self._by_salt.values() for e in entries.values()])
