"""Admission control in front of the engine: a cold cache must not send every request to the model at once.

At most ``max_running`` engine calls run at once in total, and at most the plan's limit per tenant; up to
``max_queue`` more wait for a slot for at most ``queue_timeout_s``. A free slot goes to the waiting tenant with the
fewest calls running, and among those to the one served longest ago (first come, first served within a tenant):
tenants take turns, so one tenant's burst of waiting calls is served one for one with the others', never all ahead
of them. Beyond that a call
is refused at once with :class:`~edgecache.errors.Overloaded` (429 + Retry-After), which is better for everyone
than a queue whose wait outgrows the client's patience ("all misses, GPU saturated, TTFT over 3 s, then an
avalanche").

Only engine calls take a slot. Hits (exact, semantic, shared) never pass through here, so they never queue behind
misses. Event-loop only.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from edgecache.errors import Overloaded


class AdmissionGate:
    def __init__(self, *, max_running: int, max_queue: int, queue_timeout_s: float, retry_after_s: int) -> None:
        self.max_running = max_running
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.running = 0
        self.running_by_tenant: dict[str, int] = {}
        self._waiters: deque[tuple[str, int | None, asyncio.Future[None]]] = deque()
        self.rejected = 0
        self._grants = 0
        self._last_grant: dict[str, int] = {}  # tenant -> when (in grants) it was last given a slot

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def is_free(self) -> bool:
        """Whether the engine has a free slot and nothing waits for one: the only time optional engine work (an
        exploration, a label, the judge) may start, since it would otherwise take a slot from a caller."""
        return self.queued == 0 and self.running < self.max_running

    def _may_run(self, tenant: str, tenant_limit: int | None) -> bool:
        return self.running < self.max_running and (
            tenant_limit is None or self.running_by_tenant.get(tenant, 0) < tenant_limit)

    def _take(self, tenant: str) -> None:
        self._grants += 1
        self._last_grant[tenant] = self._grants
        self.running += 1
        self.running_by_tenant[tenant] = self.running_by_tenant.get(tenant, 0) + 1

    def _reject(self, why: str) -> Overloaded:
        self.rejected += 1
        return Overloaded(f"the model is busy ({why}); retry after {self.retry_after_s} s",
                          retry_after_s=self.retry_after_s)

    def refuse_if_full(self, tenant: str, tenant_limit: int | None = None) -> None:
        """Raise Overloaded now if a call arriving at the gate would be refused: no slot for it and the queue full.
        The pipeline asks before any work a refused call would waste (embedding its prompt)."""
        if len(self._waiters) >= self.max_queue and not self._may_run(tenant, tenant_limit):
            raise self._reject(f"{self.running} generating, {len(self._waiters)} waiting")

    @asynccontextmanager
    async def slot(self, tenant: str, tenant_limit: int | None = None) -> AsyncIterator[None]:
        """Hold one engine slot for ``tenant`` for the body of the ``async with``."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (tenant, tenant_limit, future)
        self._waiters.append(entry)
        self._grant()  # in queue order: this call runs now if nobody who may run is ahead of it
        if not future.done():
            if len(self._waiters) > self.max_queue:
                self._remove(entry)
                raise self._reject(f"{self.running} generating, {len(self._waiters)} waiting")
            try:
                await asyncio.wait_for(asyncio.shield(future), self.queue_timeout_s)
            except (TimeoutError, asyncio.CancelledError) as exc:
                if future.done() and not future.cancelled():
                    self._release(tenant)  # granted just as we gave up: hand the slot on
                else:
                    future.cancel()
                    self._remove(entry)
                if isinstance(exc, TimeoutError):
                    raise self._reject(f"waited {self.queue_timeout_s:.0f} s for a slot") from None
                raise
        try:
            yield
        finally:
            self._release(tenant)

    def _remove(self, entry: tuple[str, int | None, asyncio.Future[None]]) -> None:
        try:
            self._waiters.remove(entry)
        except ValueError:
            pass

    def _release(self, tenant: str) -> None:
        self.running -= 1
        left = self.running_by_tenant.get(tenant, 1) - 1
        if left:
            self.running_by_tenant[tenant] = left
        else:
            self.running_by_tenant.pop(tenant, None)
        self._grant()

    def _grant(self) -> None:
        # Each free slot to the waiter whose tenant runs the fewest calls, then was served longest ago, then came
        # first; a waiter held back by its own tenant's limit never blocks the others.
        for entry in [e for e in self._waiters if e[2].done()]:
            self._remove(entry)
        while self.running < self.max_running:
            ready = [(self.running_by_tenant.get(tenant, 0), self._last_grant.get(tenant, -1), order,
                      (tenant, limit, future))
                     for order, (tenant, limit, future) in enumerate(self._waiters) if self._may_run(tenant, limit)]
            if not ready:
                return
            *_, entry = min(ready, key=lambda r: r[:3])
            self._remove(entry)
            self._take(entry[0])
            entry[2].set_result(None)
