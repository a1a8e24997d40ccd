"""Buckets for sampled requests: up to N answers kept for a request that samples without a seed, one of them served
at random once all N are there (the model of Helicone's ``Helicone-Cache-Bucket-Max-Size``).

A request that samples without a seed (a temperature above 0, or none sent: the APIs' default is 1) should differ
from call to call, so no single answer of it is kept. With a bucket size N (``X-EdgeCache-Bucket-Size``, the body's
``edgecache.bucket_size``, the scenario's or the plan's ``bucket_size``) the cache keeps N: until N answers are
stored each request reaches the engine and its answer fills one slot; from then on every request is served one of
the N, drawn at random (``X-EdgeCache: exact``), and never reaches the engine. ``n`` > 1 draws n different slots.

**Slots.** A bucket is N ordinary entries of the tenant's result store, one per slot, keyed by the request's key
asked with ``n`` = 1 and the slot's number (:func:`slot_keys`). So it works the same on every store backend (disk
and Redis) with nothing added to them: each slot counts against the tenant's quota and lives its own TTL, and one
evicted or expired is filled again by the next request (the bucket serves only while all N are there). Slot i is
the same entry whatever N, so a bucket of 5 extends one of 3. Errors and partial answers never fill a slot: a slot
is written only by the engine call's producer after its final chunk (:meth:`RequestPipeline._compute_and_store`).

**While it fills**, identical requests are not joined onto one engine call: each takes a free slot of its own and
leads that slot's flight, so the first N requests are N different samples. Only once every slot is stored or being
filled does a request follow a running fill (``X-EdgeCache: shared``): it gets one of the bucket's N answers, as it
would from the full bucket, and the bucket reaches the engine N times in all. A fill is a flight under its slot's
key, so on a fleet (the Redis flight table) a slot another node is filling is followed, not computed twice.

**Which slots** (:func:`draw`): free slots first, lowest first (each a new sample); then running fills, at random;
then stored answers, at random. A full bucket is all stored, so it is served a uniform draw without repeats.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from contextlib import aclosing
from typing import NamedTuple

import msgspec

from edgecache.engines.base import Choice, Chunk, GenerationRequest
from edgecache.errors import EngineError
from edgecache.inflight import SharedFlight
from edgecache.keys import request_key
from edgecache.stores import CachedAnswer, ResultStore


def one_answer(request: GenerationRequest) -> GenerationRequest:
    """The request asking for one answer: what each slot holds, and what each fill asks the engine."""
    return request if request.n == 1 else msgspec.structs.replace(request, n=1)


def slot_keys(request: GenerationRequest, size: int, *, model_version: str, tenant: str, scenario: str) -> list[str]:
    """The store keys of the bucket's ``size`` slots: the key of the request with ``n`` = 1, and the slot's number
    (a suffix no request key has, so a slot never meets a ``reuse`` answer under the bare key)."""
    base = request_key(one_answer(request), model_version=model_version, tenant=tenant, scenario=scenario)
    return [f"{base}.b{i}" for i in range(size)]


async def read_slots(store: ResultStore, keys: Sequence[str],
                     usable: Callable[[CachedAnswer], bool]) -> dict[int, CachedAnswer]:
    """The slots that hold a ``usable`` answer, by number. Memory first: a full bucket that is hot never leaves the
    event loop; the slots not in memory are read from the store together."""
    found: dict[int, CachedAnswer] = {}
    absent: list[int] = []
    for i, key in enumerate(keys):
        answer = store.get_memory(key)
        if answer is None:
            absent.append(i)
        elif usable(answer):
            found[i] = answer
    if absent:
        read = await asyncio.gather(*(store.get(keys[i]) for i in absent))
        found.update((i, answer) for i, answer in zip(absent, read) if answer is not None and usable(answer))
    return found


def recheck(store: ResultStore, keys: Sequence[str], found: dict[int, CachedAnswer],
            usable: Callable[[CachedAnswer], bool]) -> None:
    """Adds the slots whose fill was stored while the bucket was read (the memory copy is made before a fill's flight
    ends, so a look at memory without an await closes that window before the caller takes a slot)."""
    for i, key in enumerate(keys):
        if i not in found and (answer := store.get_memory(key)) is not None and usable(answer):
            found[i] = answer


class Draw(NamedTuple):
    """The slots a request is answered from, one per choice: ``lead`` a new fill, ``follow`` a running fill,
    ``serve`` a stored answer."""

    lead: list[int]
    follow: list[int]
    serve: list[int]

    @property
    def slots(self) -> list[int]:
        """The slots in the order of the answer's choices."""
        return [*self.lead, *self.follow, *self.serve]


def draw(size: int, n: int, stored: Mapping[int, CachedAnswer], running: AbstractSet[int], *, read: bool = True,
         rng: random.Random | None = None) -> Draw:
    """``n`` different slots of a bucket of ``size`` (``n`` <= ``size``): free ones first, lowest first; then running
    fills and then stored answers, each at random. Without ``read`` (a ``no-cache`` request) nothing is followed or
    served: ``n`` slots are filled anew, free ones first, replacing what they held."""
    assert 1 <= n <= size
    pick = rng or random
    if not read:
        idle = [i for i in range(size) if i not in running]
        busy = [i for i in range(size) if i in running]
        return Draw(lead=(idle + pick.sample(busy, len(busy)))[:n] if len(idle) < n else pick.sample(idle, n),
                    follow=[], serve=[])
    free = [i for i in range(size) if i not in stored and i not in running]
    lead = free[:n]
    filling = [i for i in range(size) if i in running and i not in stored]
    follow = pick.sample(filling, min(n - len(lead), len(filling)))
    serve = pick.sample(sorted(stored), n - len(lead) - len(follow))
    return Draw(lead=lead, follow=follow, serve=serve)


def label(slots: Sequence[int], size: int) -> str:
    """The ``X-EdgeCache-Bucket`` header: the slots that answered (numbered from 1, in the order of the choices) out
    of the bucket's size, e.g. ``3/5`` or ``3,1/5``."""
    return f"{','.join(str(i + 1) for i in slots)}/{size}"


def choice_of(answer: CachedAnswer, index: int) -> Choice:
    """A one-answer entry as choice ``index`` of an answer of several."""
    if answer.choices:
        return msgspec.structs.replace(answer.choices[0], index=index)
    return Choice(index=index, text=answer.text, finish_reason=answer.finish_reason,  # type: ignore[arg-type]
                  stop_sequence=answer.stop_sequence)


def combined(answers: Sequence[CachedAnswer]) -> CachedAnswer:
    """Several one-answer entries as one answer of as many choices, as an engine writes ``n`` > 1: every choice whole,
    the completion tokens summed; as old as its oldest, gone with the first to go. One entry is itself (the HTTP
    front keeps a stored answer's rendering by object)."""
    if len(answers) == 1:
        return answers[0]
    choices = tuple(choice_of(answer, i) for i, answer in enumerate(answers))
    first = choices[0]
    return CachedAnswer(text=first.text, finish_reason=first.finish_reason, prompt_tokens=answers[0].prompt_tokens,
                        completion_tokens=sum(a.completion_tokens for a in answers),
                        created_at=min(a.created_at for a in answers), expires_at=min(a.expires_at for a in answers),
                        choices=choices, stop_sequence=first.stop_sequence)


async def gathered(flights: Sequence[SharedFlight], stored: Sequence[CachedAnswer], *, batch_s: float,
                   before_answer: Callable[[], None]) -> AsyncIterator[Chunk]:
    """The answers of running ``flights`` (followed to their ends) and ``stored`` ones, as one answer of several
    choices in that order: one final chunk, as an engine gives ``n`` > 1 (whole, never as text deltas). A flight's
    error fails the whole answer (the others are let go); ``before_answer`` runs once all are in, before the chunk
    goes out."""

    async def whole(flight: SharedFlight) -> tuple[CachedAnswer, int]:
        texts: list[str] = []
        final: Chunk | None = None
        async with aclosing(flight.follow(batch_s=batch_s)) as chunks:
            async for chunk in chunks:
                texts.append(chunk.text)
                if chunk.finish_reason is not None:
                    final = chunk
        if final is None:
            raise EngineError("the engine ended its stream without a finish reason")
        first = final.choices[0] if final.choices else None
        answer = CachedAnswer(text=first.text if first else "".join(texts),
                              finish_reason=first.finish_reason if first else final.finish_reason or "stop",
                              prompt_tokens=final.prompt_tokens, completion_tokens=final.completion_tokens,
                              created_at=0.0, expires_at=0.0, choices=final.choices,
                              stop_sequence=first.stop_sequence if first else final.stop_sequence)
        return answer, final.cached_tokens

    tasks = [asyncio.ensure_future(whole(flight)) for flight in flights]
    try:
        followed = await asyncio.gather(*tasks)
    finally:
        # One failed (or the client left): the others are let go, so nobody listens to their flights any more.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    answers = [answer for answer, _ in followed] + list(stored)
    whole_answer = combined(answers)
    # The engine's prefix cache held what every computed choice found cached; a stored answer computed nothing.
    cached = min([tokens for _, tokens in followed] + [a.prompt_tokens for a in stored])
    before_answer()
    yield Chunk(finish_reason=whole_answer.finish_reason,  # type: ignore[arg-type]
                prompt_tokens=whole_answer.prompt_tokens, completion_tokens=whole_answer.completion_tokens,
                cached_tokens=cached, choices=whole_answer.choices, stop_sequence=whole_answer.stop_sequence)
