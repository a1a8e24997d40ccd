"""Layer 1 of the request path, the exact result store: complete answers by request key.

Two backends sit side by side behind :class:`ResultStore` (one tenant's store) and :class:`ResultStores` (every
tenant's, one store each): :mod:`edgecache.stores.disk` (diskcache under the data dir, the default for one box) and
:mod:`edgecache.stores.redis` (one store shared by a fleet). Both hold a :class:`~edgecache.stores.memory.MemoryTier`
in front, so a hot hit never leaves the event loop.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import msgspec

from edgecache.engines.base import Choice, cut_text


class CachedAnswer(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A complete, successful answer. ``expires_at`` is wall-clock seconds (it must survive restarts).

    ``choices`` holds the whole answer when it is more than one text choice (tool calls, logprobs, n > 1); then
    ``text`` and ``finish_reason`` repeat its first choice's. It is the last field, so entries written before it
    existed still decode (as plain answers). ``stop_sequence`` (the stop string that ended the answer, see
    :class:`~edgecache.engines.base.Chunk`) came after it, last for the same reason, and so did the last two.

    ``token_ends`` (:attr:`Chunk.token_ends <edgecache.engines.base.Chunk.token_ends>`) and ``max_tokens`` (the limit
    the answer was computed under) are set on an answer stored under a key without ``max_tokens``
    (:func:`edgecache.keys.prefix_stable`): it serves other limits, cut where they are smaller
    (:func:`serve_within`). None and 0 on every other answer, which serves only its own key's ``max_tokens``.
    """

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    created_at: float
    expires_at: float
    choices: tuple[Choice, ...] | None = None
    stop_sequence: str | None = None
    token_ends: tuple[int, ...] | None = None
    max_tokens: int = 0


def serve_within(answer: CachedAnswer, max_tokens: int) -> CachedAnswer | None:
    """``answer`` (with token ends) as the engine writes it for ``max_tokens``, or None when it does not cover it.

    An answer of K tokens serves a larger limit when it ended by itself (``stop``), or at ``length`` below the limit
    it was computed under (the context ended it, and would again); one that ended at its own limit does not. A
    limit of K is served as it is when the answer ended at ``length`` or on a stop string (the engine checks a stop
    string before the limit); otherwise, and for any smaller limit, by its first ``max_tokens`` tokens with finish
    ``length``, which is exactly what the engine writes when it stops there. A cut that a stop string already took
    off the text (a token that ends past the stored text) cannot be served."""
    ends = answer.token_ends
    if ends is None or answer.choices is not None or max_tokens < 1:
        return None
    k = answer.completion_tokens
    if max_tokens > k:
        ended = answer.finish_reason != "length" or k < answer.max_tokens
        return answer if ended else None
    if max_tokens == k and (answer.finish_reason == "length" or answer.stop_sequence is not None):
        return answer
    if max_tokens > len(ends):
        return None
    end = ends[max_tokens - 1]
    if end > len(answer.text.encode()):
        return None
    return msgspec.structs.replace(answer, text=cut_text(answer.text, end), finish_reason="length",
                                   completion_tokens=max_tokens, stop_sequence=None, token_ends=ends[:max_tokens])


FINISH_REASONS = frozenset({"stop", "length", "tool_calls"})


def unsound(answer: CachedAnswer) -> str | None:
    """Why a decoded entry cannot be served (None: it can): what another writer of a shared store, a damaged file
    or an incompatible version may leave that the decoder's types do not catch."""
    if not (math.isfinite(answer.created_at) and math.isfinite(answer.expires_at)):
        return "a time that is not finite"
    if answer.created_at > answer.expires_at:
        return "created after it expires"
    if answer.prompt_tokens < 0 or answer.completion_tokens < 0:
        return "a negative token count"
    if answer.finish_reason not in FINISH_REASONS:
        return f"finish reason {answer.finish_reason!r}"
    if answer.choices is not None and (not answer.choices or
                                       any(c.finish_reason not in FINISH_REASONS for c in answer.choices)):
        return "no choices, or a choice's finish reason unknown"
    return None


class ResultStore(Protocol):
    """What the request path needs from a tenant's result store (one per tenant; the backends are in this package)."""

    def get_memory(self, key: str) -> CachedAnswer | None:
        """A lookup that never blocks (no I/O): the hit path's first look."""
        ...

    def forget_memory(self) -> None:
        """Drop this node's memory copy, not the backend's entries (another node flushed the shared store)."""
        ...

    async def get(self, key: str) -> CachedAnswer | None: ...

    async def put(self, key: str, answer: CachedAnswer, tag: str | None = None) -> bool:
        """Store ``answer``; False when it could not be stored (a full disk: counted, never raised)."""
        ...

    async def put_many(self, items: Sequence[tuple[str, CachedAnswer, str | None]]) -> bool:
        """Store many ``(key, answer, tag)`` at once (a warmup), in one transaction where the backend has them."""
        ...

    async def get_many(self, keys: Sequence[str]) -> list[CachedAnswer | None]:
        """:meth:`get` of many keys in one pass on the backend (a warmup's look at what is already answered). The
        memory copy is looked at but neither filled nor noted: a bulk read would only evict what traffic uses."""
        ...

    async def delete(self, key: str) -> bool:
        """Drop one answer (the caller marked a semantic hit's copy of it wrong); True when one was there."""
        ...

    async def clear(self, tag: str | None = None) -> int: ...

    async def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...


class ResultStores(Protocol):
    """Every tenant's result store, one each, opened on first use (``TenantStores`` on disk, ``RedisTenantStores``)."""

    def __call__(self, tenant: str) -> ResultStore: ...

    def opened(self) -> Mapping[str, ResultStore]:
        """The stores this node has opened so far."""
        ...

    def existing_tenants(self) -> list[str]:
        """Tenants this node can see without asking anyone (for stats): opened, or on this box's disk."""
        ...

    async def known_tenants(self) -> list[str]:
        """Every tenant with entries in the backend, wherever they were written (for a flush of all)."""
        ...

    def close(self) -> None: ...
