"""Admission control in front of the engine: a cold cache must not send every request to the model at once, and no
tenant may hold the engine against the others.

At most ``max_running`` engine calls run at once in total; up to ``max_queue`` more wait for a slot. Beyond that a
call is refused at once with :class:`~edgecache.errors.Overloaded` (429 + Retry-After), which is better for everyone
than a queue whose wait outgrows the client's patience ("all misses, GPU saturated, TTFT over 3 s, then an
avalanche").

How long a call may wait is charged to its own tenant's load: a waiting call's clock runs only while its tenant has
calls running, and past ``queue_timeout_s`` of it the call gets its 429 (its tenant sent more than the engine gives
it). While its tenant has nothing running, the call waits for the turn it is owed, behind at most one call of each
other tenant per slot, and no other tenant's load makes it time out; ``turn_timeout_s`` bounds that whole wait (an
engine that stopped answering, calls longer than any client waits).

Fair by tenant, weighted by plan (``weight_of``: a tenant's plan ``weight``, 1 by default):

- Waiting calls queue per tenant, first come first served within a tenant, and a free slot goes round the tenants
  weighted by plan: to the waiting tenant with the fewest calls running for its weight, then to the one whose turn
  it is (stride scheduling: each grant moves a tenant's pass on by 1/weight, so a tenant of weight 2 is served
  twice for another's once). A tenant that sent many calls is served one for one with the others, never ahead.
- A tenant's share caps its running calls while others wait: ``ceil(max_running * weight / W)``, W the weights of
  the tenants that have calls waiting, the tenant's own included. Alone, a tenant may use every slot (nothing idles
  for a tenant that is not there); once another waits, the next free slots go to the other until each is within its
  share. Running calls are never cut for it, so a newcomer waits behind at most one call of another tenant per slot
  (the first to end), however long: its clock does not run meanwhile. How long one call may hold its slot is the
  plan's ``max_request_engine_s`` (:func:`within_engine_time`).
- The queue is shared the same way: a tenant's share of it is ``ceil(max_queue * weight / W)``. A call that finds
  the queue full while its tenant waits less than its share takes the place of the newest waiting call of the
  tenant most over its share (that one gets the 429). So one tenant's burst can neither fill the queue against the
  others nor make another tenant's call time out in it.
- A plan's ``max_concurrent_misses`` caps its tenant's running calls whatever the others do.

Only engine calls take a slot. Hits (exact, semantic, shared) never pass through here, so they never queue behind
misses. Event-loop only.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from edgecache.errors import BadRequest, EdgeCacheError, Overloaded

if TYPE_CHECKING:
    from edgecache.engines.base import Chunk


class _Waiter:
    """One call waiting for a slot: its tenant, its plan's cap on running calls, and the future a grant resolves."""

    __slots__ = ("tenant", "limit", "future")

    def __init__(self, tenant: str, limit: int | None, future: asyncio.Future[None]) -> None:
        self.tenant = tenant
        self.limit = limit
        self.future = future


class AdmissionGate:
    def __init__(self, *, max_running: int, max_queue: int, queue_timeout_s: float, retry_after_s: int,
                 turn_timeout_s: float = 600.0, weight_of: Callable[[str], float] = lambda tenant: 1.0) -> None:
        self.max_running = max_running
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.turn_timeout_s = max(turn_timeout_s, queue_timeout_s)
        self.retry_after_s = retry_after_s
        self.weight_of = weight_of  # tenant -> its plan's weight (> 0)
        self.running = 0
        self.running_by_tenant: dict[str, int] = {}
        self._queues: dict[str, deque[_Waiter]] = {}  # tenant -> its waiting calls, oldest first (none empty)
        self._queued = 0
        self._pass: dict[str, float] = {}  # tenant -> its stride pass: the lowest waiting one is served next
        self._now = 0.0                    # the pass of the last grant: a tenant back from idle starts there
        self._grants = 0
        self._last_grant: dict[str, int] = {}  # tenant -> when (in grants) it last got a slot: ties go to the older
        # Each tenant's busy clock: the seconds it has had calls running (while it has waiting ones), what a waiting
        # call's queue_timeout_s is charged against.
        self._busy_total: dict[str, float] = {}
        self._busy_since: dict[str, float] = {}  # tenant -> when its running calls went from none to one
        self.rejected = 0

    @property
    def queued(self) -> int:
        return self._queued

    def queued_of(self, tenant: str) -> int:
        """Calls of ``tenant`` waiting for a slot."""
        queue = self._queues.get(tenant)
        return len(queue) if queue is not None else 0

    def is_free(self) -> bool:
        """Whether the engine has a free slot and nothing waits for one: the only time optional engine work (an
        exploration, a label, the judge) may start, since it would otherwise take a slot from a caller."""
        return self._queued == 0 and self.running < self.max_running

    def _busy_clock(self, tenant: str) -> float:
        """Seconds ``tenant`` has had calls running since the clock began (it is dropped once the tenant neither
        runs nor waits)."""
        since = self._busy_since.get(tenant)
        running = time.monotonic() - since if since is not None else 0.0
        return self._busy_total.get(tenant, 0.0) + running

    # ---- shares ----

    def _weight(self, tenant: str) -> float:
        weight = self.weight_of(tenant)
        return weight if weight > 0 else 1.0

    def _waiting_weight(self, tenant: str) -> float:
        """W: the weights of the tenants with calls waiting, ``tenant``'s own included."""
        total = sum(self._weight(t) for t in self._queues)
        return total if tenant in self._queues else total + self._weight(tenant)

    def share(self, tenant: str) -> int:
        """The most calls ``tenant`` may start running now: its weight's share of the slots among the tenants that
        wait (all of them while it is the only one)."""
        return max(1, math.ceil(self.max_running * self._weight(tenant) / self._waiting_weight(tenant)))

    def queue_share(self, tenant: str) -> int:
        """The most calls ``tenant`` may keep waiting when the queue is full: its weight's share of the queue."""
        return math.ceil(self.max_queue * self._weight(tenant) / self._waiting_weight(tenant))

    def _may_run(self, tenant: str, limit: int | None) -> bool:
        running = self.running_by_tenant.get(tenant, 0)
        return (self.running < self.max_running and (limit is None or running < limit)
                and running < self.share(tenant))

    # ---- the queue ----

    def _enqueue(self, waiter: _Waiter) -> None:
        queue = self._queues.get(waiter.tenant)
        if queue is None:
            queue = self._queues[waiter.tenant] = deque()
            if not self.running_by_tenant.get(waiter.tenant):
                # Back from idle: it starts at the current pass, with no credit saved up while away.
                self._pass[waiter.tenant] = max(self._pass.get(waiter.tenant, 0.0), self._now)
        queue.append(waiter)
        self._queued += 1

    def _remove(self, waiter: _Waiter) -> bool:
        queue = self._queues.get(waiter.tenant)
        if queue is None:
            return False
        try:
            queue.remove(waiter)
        except ValueError:
            return False
        self._queued -= 1
        if not queue:
            del self._queues[waiter.tenant]
            if not self.running_by_tenant.get(waiter.tenant):
                self._busy_total.pop(waiter.tenant, None)
        return True

    def _make_room(self, tenant: str) -> bool:
        """The queue is full: if ``tenant`` waits less than its share, refuse the newest waiting call of the tenant
        most over its share (its caller gets the 429) and say True."""
        if self.queued_of(tenant) > self.queue_share(tenant):  # its new call counted
            return False
        over = [(len(queue) / self._weight(t), t) for t, queue in self._queues.items()
                if t != tenant and len(queue) > self.queue_share(t)]
        if not over:
            return False
        _, heaviest = max(over)
        pushed = self._queues[heaviest][-1]
        self._remove(pushed)
        pushed.future.set_exception(self._reject(f"{tenant}'s call took the place of one of {heaviest}'s, which "
                                                 f"had more than its share of the queue waiting"))
        return True

    def _reject(self, why: str) -> Overloaded:
        self.rejected += 1
        return Overloaded(f"the model is busy ({why}); retry after {self.retry_after_s} s",
                          retry_after_s=self.retry_after_s)

    def _full(self) -> Overloaded:
        return self._reject(f"{self.running} generating, {self._queued} waiting")

    def refuse_if_full(self, tenant: str, tenant_limit: int | None = None) -> None:
        """Raise Overloaded now if a call arriving at the gate would be refused: no slot for it, the queue full, and
        its tenant already waiting its share of it. The pipeline asks before any work a refused call would waste
        (embedding its prompt)."""
        if self._queued >= self.max_queue and not self._may_run(tenant, tenant_limit) and \
                self.queued_of(tenant) >= self.queue_share(tenant):
            raise self._full()

    @asynccontextmanager
    async def slot(self, tenant: str, tenant_limit: int | None = None) -> AsyncIterator[None]:
        """Hold one engine slot for ``tenant`` for the body of the ``async with``."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(tenant, tenant_limit, future)
        self._enqueue(waiter)
        self._grant()  # this call runs now if nobody who may run is ahead of it
        if not future.done() and self._queued > self.max_queue and not self._make_room(tenant):
            self._remove(waiter)
            raise self._full()
        if not future.done():
            try:
                await self._wait(future, tenant)
            except (TimeoutError, asyncio.CancelledError) as exc:
                if future.done() and not future.cancelled() and future.exception() is None:
                    self._release(tenant)  # granted just as we gave up: hand the slot on
                elif not future.done():
                    future.cancel()
                    self._remove(waiter)
                if isinstance(exc, TimeoutError):
                    raise self._reject(str(exc)) from None
                raise
        future.result()  # raises the 429 of a call whose place in the queue another tenant's call took
        try:
            yield
        finally:
            self._release(tenant)

    async def _wait(self, future: asyncio.Future[None], tenant: str) -> None:
        """Wait for ``future`` (the grant), or raise TimeoutError (its text says why) once the call has waited
        ``queue_timeout_s`` of its tenant's busy clock, or ``turn_timeout_s`` in all."""
        started, charged_from = time.monotonic(), self._busy_clock(tenant)
        while True:
            charged = self._busy_clock(tenant) - charged_from
            waited = time.monotonic() - started
            if charged >= self.queue_timeout_s:
                raise TimeoutError(f"waited {waited:.0f} s for a slot, {charged:.0f} s of it while this key's "
                                   f"tenant had its own misses running")
            if waited >= self.turn_timeout_s:
                raise TimeoutError(f"waited {waited:.0f} s for a slot")
            # The busy clock runs no faster than the wall's: the soonest either limit can be reached.
            left = min(self.queue_timeout_s - charged, self.turn_timeout_s - waited)
            try:
                await asyncio.wait_for(asyncio.shield(future), left)
                return
            except TimeoutError:
                continue

    def _release(self, tenant: str) -> None:
        self.running -= 1
        left = self.running_by_tenant.get(tenant, 1) - 1
        if left:
            self.running_by_tenant[tenant] = left
        else:
            self.running_by_tenant.pop(tenant, None)
            since = self._busy_since.pop(tenant, None)
            if tenant not in self._queues:
                # Idle: nothing to remember (it comes back at the current pass).
                self._pass.pop(tenant, None)
                self._last_grant.pop(tenant, None)
                self._busy_total.pop(tenant, None)
            elif since is not None:
                self._busy_total[tenant] = self._busy_total.get(tenant, 0.0) + time.monotonic() - since
        self._grant()

    def _grant(self) -> None:
        # Each free slot to the waiting tenant with the fewest calls running for its weight, then the lowest pass,
        # then the one served longest ago; a tenant held back by its limit or its share never blocks the others.
        while self.running < self.max_running and self._queues:
            ready = [(self.running_by_tenant.get(t, 0) / self._weight(t), self._pass.get(t, 0.0),
                      self._last_grant.get(t, -1), t)
                     for t, queue in self._queues.items() if self._may_run(t, queue[0].limit)]
            if not ready:
                return
            *_, tenant = min(ready)
            waiter = self._queues[tenant][0]
            self._remove(waiter)
            self._now = self._pass.get(tenant, self._now)
            self._pass[tenant] = self._now + 1.0 / self._weight(tenant)
            self._grants += 1
            self._last_grant[tenant] = self._grants
            self.running += 1
            if not self.running_by_tenant.get(tenant):
                self._busy_since[tenant] = time.monotonic()
            self.running_by_tenant[tenant] = self.running_by_tenant.get(tenant, 0) + 1
            waiter.future.set_result(None)


class EngineTimeExceeded(BadRequest):
    """A call ran past the engine time its tenant's plan allows one request (``max_request_engine_s``)."""

    code = "engine_time_exceeded"


async def within_engine_time(chunks: AsyncIterator[Chunk], limit_s: float | None) -> AsyncIterator[Chunk]:
    """``chunks`` (an engine call's stream, inside its slot) ended with :class:`EngineTimeExceeded`, a 400, once it
    has run ``limit_s`` seconds: the call is aborted (its stream closed) and its slot freed for the next caller.

    Refused rather than cut short with ``finish_reason: "length"``: the engine's last chunk alone carries the token
    counts and the token ends, and an answer with tool calls, logprobs or several choices comes whole at the end, so
    a cut here would have to invent counts or give nothing; and a cut made at a moment of the wall clock would be
    stored as the answer to a request that, on a quieter engine, writes more. Nothing of a refused call is cached."""
    if limit_s is None:
        async for chunk in chunks:
            yield chunk
        return
    deadline = asyncio.get_running_loop().time() + limit_s
    started = time.monotonic()
    while True:
        timeout = asyncio.timeout_at(deadline)
        try:
            async with timeout:
                chunk = await anext(chunks)
        except StopAsyncIteration:
            return
        except (TimeoutError, EdgeCacheError):
            if not timeout.expired():
                raise
            # An engine may answer the cancellation with its own error (an aborted generation): still the cap's.
            raise EngineTimeExceeded(
                f"this request ran {time.monotonic() - started:.0f} s in the engine, past the {limit_s:g} s this "
                f"key's plan allows one request; ask for fewer tokens (max_tokens x n)",
                param="max_tokens") from None
        yield chunk
