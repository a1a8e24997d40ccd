"""The exact result store in Redis, shared by every node of a fleet.

Keys carry the tenant and the model version (``ec:{<tenant>}:r:<model version>:<request key>``; a tenant's
bookkeeping lives under ``ec:{<tenant>}:t:``, the braces its hash tag, so on a Redis Cluster an entry and its
tenant's bookkeeping share one slot and the scripts below run there) and each has a TTL, so Redis drops an expired
answer by itself. Redis' own ``maxmemory`` eviction is one pool for everybody, so the
per-tenant byte quota is ours: each tenant has a sorted set of its entries by last access, a hash of their sizes
and a byte counter, and a Lua script evicts the tenant's least recently used entries when a write takes it over its
quota (atomically, whichever node writes). A scenario tag is kept per entry so a scenario flush finds its entries.

As on a single box, a :class:`~edgecache.stores.memory.MemoryTier` sits in front: a hot hit is a dict lookup on the
event loop and never reaches Redis. Its reads are replayed to Redis' access order in batches, off the hit path.
Another node's flush reaches this one as an event (:mod:`edgecache.fleet.events`), which clears the memory copy.

While Redis is down (:class:`~edgecache.fleet.link.RedisLink`), reads and writes go to the memory tier alone: a
node keeps serving what it holds and what its engine computes. A flush cannot reach the fleet then, so it fails.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from urllib.parse import unquote

import msgspec

from edgecache.errors import NotReady
from edgecache.fleet.link import LinkDown, RedisLink, tenant_prefix
from edgecache.stores import CachedAnswer, unsound
from edgecache.stores.memory import MemoryTier

log = logging.getLogger("edgecache")

# Every tenant's byte counter, for a SCAN (on every primary of a cluster) of the tenants with entries.
BYTE_COUNTERS = "ec:{*}:t:bytes"

# One entry's bookkeeping dropped (its size off the tenant's byte counter, its tag, its LRU place): the same steps for
# an eviction, a flush and a prune, so it is written once and put in front of each script that needs it.
_FORGET = """
local function forget(member, lru, sizes, tags, bytes, tag_prefix)
  local size = redis.call('HGET', sizes, member)
  if size then redis.call('DECRBY', bytes, size) end
  local tag = redis.call('HGET', tags, member)
  if tag then redis.call('SREM', tag_prefix .. tag, member) end
  redis.call('ZREM', lru, member)
  redis.call('HDEL', sizes, member)
  redis.call('HDEL', tags, member)
end
"""

# KEYS: entry, lru zset, sizes hash, tags hash, byte counter, tag set (unused without a tag, but named all the same:
# on a cluster every key of a script must be in the tenant's slot, and "" is not)
# ARGV: encoded answer, ttl ms, now ms, quota bytes, tag ("" for none), tag-set prefix
_PUT = """
local member = KEYS[1]
local old = redis.call('HGET', KEYS[3], member)
if old then redis.call('DECRBY', KEYS[5], old) end
local size = string.len(ARGV[1])
redis.call('SET', member, ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], member)
redis.call('HSET', KEYS[3], member, size)
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[4], member, ARGV[5])
  redis.call('SADD', KEYS[6], member)
end
local total = redis.call('INCRBY', KEYS[5], size)
local evicted = 0
while total > tonumber(ARGV[4]) do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
  if #oldest == 0 then break end
  local victim = oldest[1]
  redis.call('DEL', victim)
  forget(victim, KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[6])
  total = tonumber(redis.call('GET', KEYS[5]) or 0)
  evicted = evicted + 1
end
return evicted
"""

# KEYS: entry, lru zset. ARGV: now ms. A read also refreshes the entry's place in the tenant's LRU.
_GET = """
local value = redis.call('GET', KEYS[1])
if value then redis.call('ZADD', KEYS[2], 'XX', ARGV[1], KEYS[1]) end
return value
"""

# KEYS: entry, lru zset, sizes hash, tags hash, byte counter. ARGV: tag-set prefix.
_DELETE = """
local dropped = redis.call('DEL', KEYS[1])
forget(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1])
return dropped
"""

# KEYS: lru zset, sizes hash, tags hash, byte counter. ARGV: tag ("" for every entry), tag-set prefix.
_CLEAR = """
local members
if ARGV[1] == '' then
  members = redis.call('ZRANGE', KEYS[1], 0, -1)
else
  members = redis.call('SMEMBERS', ARGV[2] .. ARGV[1])
end
local dropped = 0
for _, member in ipairs(members) do
  dropped = dropped + redis.call('DEL', member)
  forget(member, KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2])
end
if ARGV[1] == '' then
  for _, tag in ipairs(redis.call('HVALS', KEYS[3])) do redis.call('DEL', ARGV[2] .. tag) end
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
end
return dropped
"""

# KEYS: lru zset, sizes hash, tags hash, byte counter. ARGV: how many of the oldest to look at, tag-set prefix.
# Entries Redis expired by TTL leave their bookkeeping behind; this drops it (from the oldest, where they gather).
_PRUNE = """
local pruned = 0
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)) do
  if redis.call('EXISTS', member) == 0 then
    forget(member, KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2])
    pruned = pruned + 1
  end
end
return pruned
"""


class RedisScripts:
    """The store's Lua scripts, registered once per link (Redis caches them by SHA)."""

    def __init__(self, link: RedisLink) -> None:
        self.put = link.script(_FORGET + _PUT)
        self.get = link.script(_GET)
        self.clear = link.script(_FORGET + _CLEAR)
        self.delete = link.script(_FORGET + _DELETE)
        self.prune = link.script(_FORGET + _PRUNE)


class RedisResultStore:
    """One tenant's answers in Redis, :class:`MemoryTier` in front. Same interface as the disk store."""

    PRUNE_BATCH = 256
    READ_BATCH = 1024  # keys per MGET of get_many

    def __init__(self, link: RedisLink, scripts: RedisScripts, tenant: str, *, quota_bytes: int,
                 memory_bytes: int, model_version: Callable[[], str]) -> None:
        self._link = link
        self._scripts = scripts
        self.tenant = tenant
        self.quota_bytes = int(quota_bytes)  # a plan's ByteSize: /stats encodes plain ints
        self._model_version = model_version
        self._memory = MemoryTier(memory_bytes, self._replay_reads)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CachedAnswer)
        prefix = tenant_prefix(tenant)
        base = prefix + "t:"
        self._entry_prefix = prefix + "r:"
        self._lru, self._sizes, self._tags, self._bytes = base + "lru", base + "sizes", base + "tags", base + "bytes"
        self._tag_prefix = base + "tag:"
        self._replays: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak references to tasks
        self.dropped = 0  # entries read that could not be served (undecodable or unsound), dropped

    def entry_key(self, key: str) -> str:
        return f"{self._entry_prefix}{self._model_version()}:{key}"

    def get_memory(self, key: str) -> CachedAnswer | None:
        return self._memory.get(key)

    def forget_memory(self) -> None:
        """Another node flushed this tenant: drop the memory copy (Redis itself is already cleared)."""
        self._memory.forget()

    def _replay_reads(self, keys: set[str]) -> bool:
        # A task, since the hit path cannot wait on Redis; put() waits for it, so its script's eviction sees them.
        if not self._link.up:
            return False
        now = time.time() * 1000
        members = {self.entry_key(k): now for k in keys}
        replay = asyncio.get_running_loop().create_task(self._touch(members))
        self._replays.add(replay)
        replay.add_done_callback(self._replays.discard)
        return True

    async def _touch(self, members: dict[str, float]) -> None:
        try:
            await self._link.run(self._link.client.zadd(self._lru, members, xx=True))
        except LinkDown:
            pass  # access order is a hint; losing one batch of it while Redis is away costs nothing else

    async def get(self, key: str) -> CachedAnswer | None:
        answer = self.get_memory(key)
        if answer is not None or not self._link.up:
            return answer
        entry = self.entry_key(key)
        try:
            raw = await self._link.run(self._scripts.get(keys=[entry, self._lru], args=[time.time() * 1000]))
        except LinkDown:
            return None
        if raw is None:
            return None
        answer = await self._decode(key, raw)
        if answer is None or answer.expires_at <= time.time():
            return None
        self._memory.put(key, answer, len(raw))
        return answer

    async def _decode(self, key: str, raw: bytes) -> CachedAnswer | None:
        """The answer in an entry read from Redis. None for one written by an incompatible version, or by a writer
        that is not a node of this fleet: a miss, dropped (the next put of this key would replace it; a bad entry
        must not stay until its TTL) and counted."""
        try:
            answer = self._decoder.decode(raw)
            if (why := unsound(answer)) is not None:
                raise msgspec.DecodeError(why)
        except msgspec.DecodeError as exc:
            self.dropped += 1
            log.warning("redis store: dropped the unreadable entry %s of tenant %s: %s", self.entry_key(key),
                        self.tenant, exc)
            await self.delete(key)
            return None
        return answer

    async def put(self, key: str, answer: CachedAnswer, tag: str | None = None) -> bool:
        if unsound(answer) is not None:
            return False
        raw = self._encoder.encode(answer)
        ttl_ms = int((answer.expires_at - time.time()) * 1000)
        if ttl_ms <= 0:
            return False
        self._memory.put(key, answer, len(raw))  # before the first await, as on disk
        if not self._link.up:
            return False
        self._memory.replay_reads()
        if self._replays:
            await asyncio.wait(self._replays)
        tag = tag or ""
        try:
            await self._link.run(self._scripts.put(
                keys=[self.entry_key(key), self._lru, self._sizes, self._tags, self._bytes,
                      self._tag_prefix + tag],
                args=[raw, ttl_ms, time.time() * 1000, self.quota_bytes, tag, self._tag_prefix]))
        except LinkDown:
            return False  # kept in this node's memory tier; the fleet recomputes it at worst
        return True

    async def put_many(self, items: Sequence[tuple[str, CachedAnswer, str | None]]) -> bool:
        """A warmup's answers, one script call each (each keeps the quota and the LRU exact)."""
        stored = True
        for key, answer, tag in items:
            stored = await self.put(key, answer, tag) and stored
        return stored

    async def get_many(self, keys: Sequence[str]) -> list[CachedAnswer | None]:
        """:meth:`get` of many keys: the memory copy's, else Redis', read in one round trip (MGETs of
        :attr:`READ_BATCH` keys on a pipeline: a tenant's entries share its slot, so on a cluster they go to one
        primary), and the entries found then moved up the tenant's LRU in one command. The memory copy is neither
        filled nor noted; while Redis is away only it answers."""
        now = time.time()
        found = [self._memory.peek(key, now) for key in keys]
        wanted = [i for i, answer in enumerate(found) if answer is None]
        if not wanted or not self._link.up:
            return found
        entries = [self.entry_key(keys[i]) for i in wanted]
        pipe = self._link.client.pipeline(transaction=False)
        for start in range(0, len(entries), self.READ_BATCH):
            # As a command: redis-py's cluster pipeline refuses its mget() (keys may span slots), not an MGET
            # whose keys share one slot, as a tenant's do.
            pipe.execute_command("MGET", *entries[start:start + self.READ_BATCH])
        try:
            raws = [raw for batch in await self._link.run(pipe.execute()) for raw in batch]
        except LinkDown:
            return found
        read: dict[str, float] = {}
        for i, entry, raw in zip(wanted, entries, raws):
            if raw is None:
                continue
            answer = await self._decode(keys[i], raw)
            if answer is not None:
                read[entry] = now * 1000
                if answer.expires_at > now:
                    found[i] = answer
        if read:
            await self._touch(read)
        return found

    async def delete(self, key: str) -> bool:
        """Drop one answer from Redis and this node's memory tier (another node's memory copy lives on until it
        ages out of that tier's LRU); False when Redis is away."""
        self._memory.pop(key)
        if not self._link.up:
            return False
        try:
            dropped = await self._link.run(self._scripts.delete(
                keys=[self.entry_key(key), self._lru, self._sizes, self._tags, self._bytes],
                args=[self._tag_prefix]))
        except LinkDown:
            return False
        return bool(dropped)

    async def clear(self, tag: str | None = None) -> int:
        self._memory.forget()
        if not self._link.up:
            raise NotReady("the fleet's Redis is unreachable, so a flush cannot reach the other nodes; retry "
                           "when /health shows redis up")
        try:
            dropped = await self._link.run(self._scripts.clear(
                keys=[self._lru, self._sizes, self._tags, self._bytes], args=[tag or "", self._tag_prefix]))
        except LinkDown as exc:
            raise NotReady(f"the fleet's Redis failed during the flush: {exc}") from exc
        return int(dropped)

    async def stats(self) -> dict[str, int]:
        out = {"entries": 0, "bytes": 0, "budget_bytes": self.quota_bytes, "dropped_unreadable": self.dropped,
               **self._memory.stats()}
        if not self._link.up:
            return out
        try:
            await self._link.run(self._scripts.prune(keys=[self._lru, self._sizes, self._tags, self._bytes],
                                                     args=[self.PRUNE_BATCH, self._tag_prefix]))
            pipe = self._link.client.pipeline(transaction=False)
            pipe.zcard(self._lru)
            pipe.get(self._bytes)
            entries, volume = await self._link.run(pipe.execute())
        except LinkDown:
            return out
        out["entries"], out["bytes"] = int(entries), int(volume or 0)
        return out

    def close(self) -> None:
        """The link belongs to the node and is closed by it; nothing of the store's own to release."""


class RedisTenantStores:
    """One :class:`RedisResultStore` per tenant, all on the node's link. Same shape as ``TenantStores``."""

    def __init__(self, link: RedisLink, *, quota_for: Callable[[str], int], memory_bytes: int,
                 model_version: Callable[[], str]) -> None:
        self._link = link
        self._scripts = RedisScripts(link)
        self._quota_for = quota_for
        self._memory_bytes = memory_bytes
        self._model_version = model_version
        self._stores: dict[str, RedisResultStore] = {}

    def __call__(self, tenant: str) -> RedisResultStore:
        store = self._stores.get(tenant)
        if store is None:
            store = self._stores[tenant] = RedisResultStore(
                self._link, self._scripts, tenant, quota_bytes=self._quota_for(tenant),
                memory_bytes=self._memory_bytes, model_version=self._model_version)
        return store

    def opened(self) -> dict[str, RedisResultStore]:
        return dict(self._stores)

    def existing_tenants(self) -> list[str]:
        """Tenants this node has opened: the fleet's others are flushed by name (``/admin/flush`` with a tenant)
        or by ``all``, which reaches Redis through each tenant's keys (:meth:`known_tenants`)."""
        return sorted(self._stores)

    async def known_tenants(self) -> list[str]:
        """Every tenant with entries in Redis (a SCAN over the byte counters, on every primary of a cluster; for a
        fleet-wide flush)."""
        if not self._link.up:
            return self.existing_tenants()
        found = set(self._stores)
        try:
            names = await self._link.scan(BYTE_COUNTERS)
        except LinkDown:
            names = []
        found.update(unquote(name[name.index("{") + 1:name.index("}")]) for name in names)
        return sorted(found)

    def close(self) -> None:
        self._stores.clear()
