"""Flights shared by a fleet: the first node to take a Redis lease on a key computes, the others follow it.

Each node keeps its own :class:`~edgecache.inflight.local.InflightTable`, so requests on one node still share one
local flight. What changes is what that flight does: before computing, it tries to take the fleet-wide lease on the
key (``SET NX`` with an expiry, under the fleet's flush epoch, so no request after a flush joins a flight from
before it). The winner leads: it computes as on one box and mirrors every chunk to a Redis stream of its own,
renewing the lease while it runs. A loser follows: it reads that stream from its start (a late joiner misses
nothing) and republishes each chunk to its local listeners; it never calls the engine and stores nothing.

How a flight ends, as the followers see it:

- the leader finishes: an ``ok`` entry ends the stream; lease and stream stay a short while (the finished window)
  so a request that missed the store by a moment still reads the answer instead of computing it again;
- the leader's engine fails: an ``error`` entry carries the error to every follower; nothing was stored;
- the leading node dies: its lease is no longer renewed and expires; a follower that finds the lease gone (or
  taken by another) raises an error, within ``store.redis_lease_s``; the next request takes the lease and computes.

The lease is ``ec:f:<epoch>:{<key>}`` and the leader's stream is the lease's name followed by its token: the key in
braces is their hash tag, so on a Redis Cluster a flight's lease and stream share one slot, and flights spread over
every primary.

A flight led here runs to its end even when its own clients leave, because followers on other nodes may still be
reading it (knowing they are not would cost a round trip per listener). While Redis is away a node leads every
flight itself, as a single box does.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from contextlib import aclosing, suppress

import msgspec

from edgecache.engines.base import Chunk
from edgecache.errors import EdgeCacheError, EngineError, Overloaded
from edgecache.fleet.link import LinkDown, RedisLink
from edgecache.inflight import Producer
from edgecache.inflight.local import Flight, InflightTable

log = logging.getLogger("edgecache.fleet")

# KEYS: lease. ARGV: token, ms. Extend (or shorten) the lease only while it is still ours; 0 ms releases it.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if ARGV[2] == '0' then return redis.call('DEL', KEYS[1]) end
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


class RedisFlightTable:
    """Flights by key across a fleet; the interface of :class:`~edgecache.inflight.local.InflightTable`."""

    LEAD_ATTEMPTS = 3

    def __init__(self, link: RedisLink, *, node_id: str, epoch: Callable[[], int], lease_s: float,
                 finished_window_s: float | None = None) -> None:
        self._link = link
        self._node_id = node_id
        self._epoch = epoch
        self._lease_ms = max(100, int(lease_s * 1000))
        self._window_ms = int((finished_window_s if finished_window_s is not None else lease_s) * 1000)
        self._local = InflightTable()
        self._renew = link.script(_RENEW)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Chunk)
        self.led = 0       # flights this node computed while sharing them
        self.followed = 0  # flights this node followed from another node

    def __len__(self) -> int:
        return len(self._local)

    def get(self, key: str) -> Flight | None:
        return self._local.get(key)

    def lead(self, key: str, produce: Producer) -> Flight:
        return self._local.lead(key, lambda flight: self._lead_or_follow(key, flight, produce))

    async def drain(self, timeout_s: float) -> None:
        await self._local.drain(timeout_s)

    # ---- one flight ----

    async def _lead_or_follow(self, key: str, flight: Flight, produce: Producer) -> None:
        lease = f"ec:f:{self._epoch()}:{{{key}}}"
        token = f"{self._node_id}:{uuid.uuid4().hex[:8]}"
        for _ in range(self.LEAD_ATTEMPTS):
            if not self._link.up:
                break
            try:
                if await self._link.run(self._link.client.set(lease, token, nx=True, px=self._lease_ms)):
                    self.led += 1
                    await self._lead(flight, produce, lease, token)
                    return
                leader = await self._link.run(self._link.client.get(lease))
            except LinkDown:
                break
            if leader is not None:
                self.followed += 1
                flight.led_elsewhere = True  # type: ignore[attr-defined]  # read by the pipeline: "shared"
                await self._follow(flight, lease, leader)
                return
            # The lease expired between the two commands: try to take it again.
        await produce(flight)  # Redis is away: compute here, as a single box does

    async def _lead(self, flight: Flight, produce: Producer, lease: str, token: str) -> None:
        stream = f"{lease}:{token}"
        renewing = asyncio.create_task(self._keep_lease(lease, token), name="flight-lease")
        mirroring = asyncio.create_task(self._mirror(flight, stream), name="flight-mirror")
        try:
            await produce(flight)
            if not flight.done:
                raise EngineError("the engine stopped without finishing its answer")
        except BaseException as exc:
            mirroring.cancel()
            error = exc if isinstance(exc, EdgeCacheError) else EngineError("the generation was aborted")
            await self._end(lease, token, stream, {"end": "error", "status": str(error.status),
                                                   "message": error.message})
            raise
        else:
            # produce() finishes the flight before it returns; the mirror then has every chunk.
            with suppress(LinkDown):
                await mirroring
            await self._end(lease, token, stream, {"end": "ok"})
        finally:
            renewing.cancel()
            mirroring.cancel()

    async def _mirror(self, flight: Flight, stream: str) -> None:
        """Every chunk of the local flight onto the stream, in order (a listener of its own: see the docstring).
        Chunks published while a send is on its way go out together in the next one."""
        pending: list[Chunk] = []
        seen = 0
        async with aclosing(flight.follow()) as chunks:
            async for chunk in chunks:
                pending.append(chunk)
                seen += 1
                if seen < len(flight.chunks):
                    continue
                await self._send(stream, pending)
                pending = []
        if pending:
            await self._send(stream, pending)

    async def _send(self, stream: str, chunks: list[Chunk]) -> None:
        pipe = self._link.client.pipeline(transaction=False)
        for chunk in chunks:
            pipe.xadd(stream, {"c": self._encoder.encode(chunk)})
        # The stream outlives a dead leader only briefly; a live one refreshes this with every batch.
        pipe.pexpire(stream, self._lease_ms * 4)
        await self._link.run(pipe.execute())

    async def _end(self, lease: str, token: str, stream: str, fields: dict[str, str]) -> None:
        """The last entry. A finished answer keeps its lease for the finished window; a failed one releases it at
        once (errors are not kept: the next request computes), its stream staying for followers still reading."""
        try:
            pipe = self._link.client.pipeline(transaction=False)
            pipe.xadd(stream, fields)
            pipe.pexpire(stream, self._window_ms + self._lease_ms)
            await self._link.run(pipe.execute())
            keep_ms = self._window_ms if fields["end"] == "ok" else 0
            await self._link.run(self._renew(keys=[lease], args=[token, keep_ms]))
        except LinkDown:
            pass  # followers see the lease expire and report an error; this node's own listeners are served

    async def _keep_lease(self, lease: str, token: str) -> None:
        while True:
            await asyncio.sleep(self._lease_ms / 3000)
            try:
                if not await self._link.run(self._renew(keys=[lease], args=[token, self._lease_ms])):
                    log.warning("lost the lease on a flight (Redis restarted?); its followers elsewhere will "
                                "see an error")
                    return
            except LinkDown:
                return

    async def _follow(self, flight: Flight, lease: str, leader: bytes) -> None:
        stream = f"{lease}:{leader.decode()}"
        last: bytes | str = "0-0"
        while True:
            try:
                batch = await self._link.xread({stream: last}, count=256, block_ms=self._link.block_ms)
                if not batch:
                    if await self._link.run(self._link.client.get(lease)) != leader:
                        raise EngineError("the node computing this answer stopped before finishing it; retry")
                    continue
            except LinkDown as exc:
                raise EngineError("lost the fleet's Redis while following another node's answer; retry") from exc
            for _, entry_id, fields in batch:
                last = entry_id
                raw = fields.get(b"c")
                if raw is not None:
                    try:
                        chunk = self._decoder.decode(raw)
                    except msgspec.DecodeError as exc:  # (ValidationError is one) another version's chunk
                        raise EngineError("an unreadable chunk from another node (another version?)") from exc
                    flight.publish(chunk)
                elif fields.get(b"end") == b"ok":
                    flight.finish()
                    return
                else:
                    raise remote_error(fields)


def remote_error(fields: dict[bytes, bytes]) -> EdgeCacheError:
    """The leader's error as the follower raises it: a 429 stays a 429, anything else is an engine failure."""
    message = fields.get(b"message", b"the leading node failed").decode(errors="replace")
    if fields.get(b"status") == b"429":
        return Overloaded(message)
    return EngineError(message)
