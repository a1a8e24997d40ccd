"""The Responses API's stored responses in the fleet's Redis: a response created on one node is read, listed,
continued (``previous_response_id``) and deleted on any node.

One key per (tenant, response id), ``ec:{<tenant>}:resp:r:<id>``, holding the encoded record with a TTL of
``store.responses_ttl_s``: Redis drops an expired response by itself. The tenant is in every key, as its
hash tag (:func:`~edgecache.fleet.link.tenant_prefix`: on a cluster a tenant's records and their bookkeeping share
one slot, where the scripts below run), and every read, write and delete names the tenant, so one tenant's id never
finds another's response. Each tenant's byte bound (``store.responses_bytes``) is ours, not Redis'
``maxmemory`` (one pool for everybody): a sorted set of the tenant's records by creation time, a hash of their sizes
and a byte counter, kept by Lua scripts, so a write and the eviction of the tenant's oldest records past the bound
are one atomic step whichever node writes. A record Redis expired leaves its bookkeeping behind; each write drops
what it finds of that at the oldest end (where expired records gather), and the bookkeeping keys themselves expire
with the newest record.

Writes never block the request: ``put`` queues the record and one writer task sends the queue to Redis in one
pipelined round trip per batch (at once when idle, so another node finds a response a moment after it was served;
under load the batches grow). A record waiting for its write is served from memory on this node. While Redis is away
(:class:`~edgecache.fleet.link.RedisLink`), writes are dropped with a log line (the answer was served already) and
reads and deletes are a 503 (:class:`~edgecache.errors.StorageUnavailable`): the store is the fleet's, and this node
alone cannot tell whether a response exists.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from edgecache.errors import StorageUnavailable
from edgecache.fleet.link import LinkDown, RedisLink, tenant_prefix

log = logging.getLogger("edgecache.fleet")

# Bookkeeping of expired records dropped per write at most (they gather at the oldest end).
PRUNE_PER_WRITE = 32

# One record's bookkeeping dropped (its size off the byte counter, its place in the age order), for an eviction,
# a delete and a prune alike.
_FORGET = """
local function forget(member, age, sizes, bytes)
  local size = redis.call('HGET', sizes, member)
  if size then redis.call('DECRBY', bytes, size) end
  redis.call('ZREM', age, member)
  redis.call('HDEL', sizes, member)
end
"""

# KEYS: record, age zset, sizes hash, byte counter. ARGV: record, ttl ms, created ms, bound bytes, prune count.
# Returns how many of the tenant's records were evicted.
_PUT = """
for _, member in ipairs(redis.call('ZRANGE', KEYS[2], 0, tonumber(ARGV[5]) - 1)) do
  if redis.call('EXISTS', member) == 1 then break end
  forget(member, KEYS[2], KEYS[3], KEYS[4])
end
local old = redis.call('HGET', KEYS[3], KEYS[1])
if old then redis.call('DECRBY', KEYS[4], old) end
local size = string.len(ARGV[1])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], KEYS[1])
redis.call('HSET', KEYS[3], KEYS[1], size)
local total = redis.call('INCRBY', KEYS[4], size)
local evicted = 0
while total > tonumber(ARGV[4]) do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
  if #oldest == 0 then break end
  redis.call('DEL', oldest[1])
  forget(oldest[1], KEYS[2], KEYS[3], KEYS[4])
  total = tonumber(redis.call('GET', KEYS[4]) or 0)
  evicted = evicted + 1
end
for i = 2, 4 do
  if redis.call('PTTL', KEYS[i]) < tonumber(ARGV[2]) then redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
end
return evicted
"""

# KEYS: record, age zset, sizes hash, byte counter. Returns 1 when the record was there.
_DELETE = """
local dropped = redis.call('DEL', KEYS[1])
forget(KEYS[1], KEYS[2], KEYS[3], KEYS[4])
return dropped
"""

# KEYS: age zset, sizes hash, byte counter. Drops the bookkeeping of every expired record, then returns
# {records, bytes}.
_USAGE = """
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if redis.call('EXISTS', member) == 0 then forget(member, KEYS[1], KEYS[2], KEYS[3]) end
end
return {redis.call('ZCARD', KEYS[1]), tonumber(redis.call('GET', KEYS[3]) or 0)}
"""


class RedisResponseStore:
    """Stored responses in the fleet's Redis (a :class:`~edgecache.http.response_store.ResponseStore`)."""

    def __init__(self, link: RedisLink, *, tenant_bytes: int, ttl_s: float) -> None:
        self._link = link
        self.tenant_bytes = tenant_bytes
        self.ttl_s = ttl_s
        self._put = link.script(_FORGET + _PUT)
        self._delete = link.script(_FORGET + _DELETE)
        self._usage = link.script(_FORGET + _USAGE)
        # Records not yet sent, and the batch being sent: both readable here until Redis has them.
        self._queued: dict[tuple[str, str], tuple[bytes, float, float]] = {}
        self._sending: dict[tuple[str, str], tuple[bytes, float, float]] = {}
        self._sent = asyncio.Event()  # set when the batch in ``_sending`` has been written (or failed)
        self._writer: asyncio.Task[None] | None = None
        self._closed = False
        self.evicted = 0
        self.dropped = 0

    def keys(self, tenant: str, response_id: str) -> list[str]:
        """The record's key and its tenant's bookkeeping: age order, sizes, byte counter."""
        base = tenant_prefix(tenant) + "resp:"
        return [f"{base}r:{response_id}", base + "age", base + "sizes", base + "bytes"]

    # ---- writes ----

    def put(self, tenant: str, response_id: str, record: bytes, created_at: float, expires_at: float) -> None:
        if self._closed:
            return
        self._queued[(tenant, response_id)] = (record, created_at, expires_at)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_queued(), name="response-store")

    async def _write_queued(self) -> None:
        # No await between the queue's last check and the task's end: a put either lands in a batch of this task
        # or finds it done and starts the next.
        while self._queued:
            batch, self._queued = self._queued, {}
            self._sending, self._sent = batch, asyncio.Event()
            try:
                await self._write(batch)
            except LinkDown as exc:
                self.dropped += len(batch)
                log.warning("stored responses: %d not kept (the fleet's Redis: %s)", len(batch), exc)
            finally:
                self._sending = {}
                self._sent.set()

    async def _write(self, batch: dict[tuple[str, str], tuple[bytes, float, float]]) -> None:
        if not self._link.up:
            raise LinkDown(self._link.error or "redis unreachable")
        now = time.time()
        pipe = self._link.client.pipeline(transaction=False)
        for (tenant, response_id), (record, created_at, expires_at) in batch.items():
            ttl_ms = int((expires_at - now) * 1000)
            if ttl_ms > 0:  # queued on the pipeline (no round trip until execute)
                await self._put(keys=self.keys(tenant, response_id),
                                args=[record, ttl_ms, int(created_at * 1000), self.tenant_bytes, PRUNE_PER_WRITE],
                                client=pipe)
        self.evicted += sum(int(n) for n in await self._link.run(pipe.execute()))

    async def flushed(self) -> None:
        while self._writer is not None and not self._writer.done():
            await asyncio.wait([self._writer])

    async def close(self) -> None:
        """Send what is queued (the link is the node's, closed after this)."""
        self._closed = True
        await self.flushed()

    # ---- reads ----

    def _waiting(self, tenant: str, response_id: str) -> bytes | None:
        pending = self._queued.get((tenant, response_id)) or self._sending.get((tenant, response_id))
        if pending is None:
            return None
        record, _, expires_at = pending
        return record if expires_at > time.time() else None

    async def get(self, tenant: str, response_id: str) -> bytes | None:
        waiting = self._waiting(tenant, response_id)
        if waiting is not None:
            return waiting
        raw = await self._command(self._link.client.get(self.keys(tenant, response_id)[0]))
        return bytes(raw) if raw is not None else None

    async def delete(self, tenant: str, response_id: str) -> bool:
        queued = self._queued.pop((tenant, response_id), None) is not None
        if (tenant, response_id) in self._sending:
            # Its batch first (not the writer's later ones): on another connection this delete could overtake it.
            await self._sent.wait()
        if queued and not self._link.up:
            return True  # never reached Redis: dropping it here is the whole delete
        dropped = await self._command(self._delete(keys=self.keys(tenant, response_id)))
        return queued or bool(dropped)

    async def tenant_usage(self, tenant: str) -> tuple[int, int]:
        records, used = await self._command(self._usage(keys=self.keys(tenant, "")[1:]))
        return int(records), int(used)

    async def _command(self, command: Coroutine[Any, Any, Any]) -> Any:
        """One read or delete: a 503 (never a wait) while the link is down, and when the command fails."""
        if not self._link.up:
            command.close()  # the coroutine is never awaited: say so to Python, not as a warning
            raise StorageUnavailable(f"the stored responses are in the fleet's Redis, which is unreachable "
                                     f"({self._link.error}); retry when /health shows redis up")
        try:
            return await self._link.run(command)
        except LinkDown as exc:
            raise StorageUnavailable(f"the stored responses could not be read from the fleet's Redis: {exc}") \
                from exc
