"""What ``/health`` reports: the worst of named component checks, and the storage faults that feed them.

Each layer registers a check on :class:`HealthChecks` (the engine, the result stores, the semantic layer; a later
backend such as a shared store adds its own). A check is a cheap callable returning :class:`Health`; ``/health``
runs them all and reports the worst, with every component's status and reason, so an operator reads *why* in one
place. Severity, least to worst: ``ready`` < ``degraded`` (serving, but a part is missing: 200) < ``loading`` <
``failed`` (503: do not route traffic here).

:class:`StorageFaults` is where the stores report a failed disk operation. It counts it in
``edgecache_storage_failures_total{component,kind}``, logs it once per interval per (component, kind) (a full disk
must not write a traceback per request, which would fill the disk further), and marks the component degraded until
an operation of that component succeeds again: the disk's state is learnt from real traffic, so /health recovers
by itself when space returns.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import msgspec
from prometheus_client import Counter

log = logging.getLogger("edgecache")

Status = Literal["ready", "degraded", "loading", "failed"]
SEVERITY: dict[Status, int] = {"ready": 0, "degraded": 1, "loading": 2, "failed": 3}
FaultKind = Literal["disk_full", "damaged", "io"]


class Health(msgspec.Struct, frozen=True):
    status: Status
    reason: str = ""

    @property
    def serving(self) -> bool:
        """Whether traffic should come here (``ready`` or ``degraded``)."""
        return SEVERITY[self.status] <= SEVERITY["degraded"]


READY = Health("ready")


class HealthChecks:
    """Named component checks; :meth:`report` gives the worst status and each component's."""

    def __init__(self) -> None:
        self._checks: dict[str, Callable[[], Health]] = {}

    def register(self, name: str, check: Callable[[], Health]) -> None:
        self._checks[name] = check

    def report(self) -> tuple[Health, dict[str, Health]]:
        components = {name: check() for name, check in self._checks.items()}
        worst = max(components.values(), key=lambda h: SEVERITY[h.status], default=READY)
        if worst.status == "ready":
            return READY, components
        reasons = "; ".join(f"{name}: {h.reason}" for name, h in components.items()
                            if h.status != "ready" and h.reason)
        return Health(worst.status, reasons), components


def fault_kind(exc: BaseException) -> FaultKind:
    """What a storage error means for an operator: a full disk, a damaged file, or another I/O failure."""
    text = str(exc).lower()
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "disk_full"
    if "disk is full" in text or "no space left" in text:
        return "disk_full"
    if isinstance(exc, sqlite3.DatabaseError) and ("malformed" in text or "not a database" in text
                                                   or "corrupt" in text):
        return "damaged"
    return "io"


# The errors a store may meet on its files; anything else is a bug and must surface as one.
STORAGE_ERRORS: tuple[type[BaseException], ...] = (OSError, sqlite3.Error)


class StorageFaults:
    """Failed storage operations by component: counted, logged once per interval, shown on /health until the
    component's next success."""

    def __init__(self, counter: Counter, *, log_interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._counter = counter
        self._log_interval_s = log_interval_s
        self._clock = clock
        self._last_logged: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}
        self._failing: dict[str, str] = {}  # component -> reason, until its next success

    def record(self, component: str, exc: BaseException, *, action: str, path: object = None) -> FaultKind:
        """Count and (at most once per interval) log a failed ``action`` (e.g. "write skipped") of ``component``."""
        kind = fault_kind(exc)
        self._counter.labels(component, kind).inc()
        where = f" ({path})" if path is not None else ""
        reason = f"{kind.replace('_', ' ')}{where}: {exc}"
        self._failing[component] = reason
        key = (component, kind)
        now = self._clock()
        last = self._last_logged.get(key)
        if last is None or now - last >= self._log_interval_s:
            suppressed = self._suppressed.pop(key, 0)
            more = f" (and {suppressed} more since the last report)" if suppressed else ""
            log.warning("%s: %s, %s%s", component, reason, action, more)
            self._last_logged[key] = now
        else:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
        return kind

    def repaired(self, component: str, report: str) -> None:
        """Damage found and repaired at open (a file moved aside, the store rebuilt): counted, logged every time
        (it is rare and the operator must see the path), and shown on /health until the component's next success."""
        self._counter.labels(component, "damaged").inc()
        self._failing[component] = report
        log.error("%s: %s", component, report)

    def recovered(self, component: str) -> None:
        """An operation of ``component`` succeeded: it is healthy again."""
        if self._failing.pop(component, None) is not None:
            log.info("%s: storage works again", component)

    def check(self, component: str) -> Callable[[], Health]:
        """A health check for ``component``: degraded while its last storage operation failed."""
        def check() -> Health:
            reason = self._failing.get(component)
            return READY if reason is None else Health("degraded", reason)

        return check


def quick_check(path: Path) -> str:
    """SQLite's ``PRAGMA quick_check`` of the database at ``path``: "ok", or what is wrong. A file that cannot be
    read as a database at all (truncated mid-page: "disk I/O error"; overwritten: "not a database") is reported as
    damage too; a full disk is raised as itself."""
    con = sqlite3.connect(path)
    try:
        return str(con.execute("PRAGMA quick_check").fetchone()[0])
    except sqlite3.DatabaseError as exc:
        if fault_kind(exc) == "disk_full":
            raise
        return f"unreadable: {exc}"
    finally:
        con.close()
