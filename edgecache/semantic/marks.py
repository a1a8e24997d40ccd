"""The callers' wrong marks: which cached answer a caller said was wrong for which request (``POST /v1/feedback``).

A semantic hit serves a paraphrase the answer cached for another prompt, and keeps a copy under the paraphrase's own
request key so its repeats are exact hits. When the caller marks that answer wrong, the copy is dropped (by the
feedback route) and this table refuses the pair from then on: the paraphrase's next lookup finds the same candidate
and refuses it (refusal ``marked_wrong``), the engine answers, and that answer, stored under the request's key and
indexed as any miss, serves its repeats. The table is keyed by (tenant, request key): the key holds the model
version, scenario, system prompt, sampling and the user's text, so a mark is about that paraphrase in that context
and nothing else; the candidate stays servable to other paraphrases unless its labels demote it (the learner's rule).

Bounded: at most ``max_entries`` (tenant, key) pairs, each tenant with a share
(:class:`~edgecache.tenant_lru.TenantLru`): past the bound the least recently marked pair of the tenant that holds
the most goes, so one tenant's marks never push out another's within its share. Kept across a clean restart in
``path`` (written at close, read at start); a crash loses the marks made since the last start, not their labels (in
the decision log) nor the copies already dropped.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec

from edgecache.health import STORAGE_ERRORS
from edgecache.tenant_lru import TenantLru

log = logging.getLogger("edgecache")

#: The labeler a caller's mark is recorded under in the decision log (``POST /v1/feedback``). A caller marks what it
#: noticed, not a random sample of what was served, so ``edgecache tune`` leaves such labels out of its estimates.
FEEDBACK_LABELER = "feedback"

_Row = tuple[str, str, list[str]]  # tenant, request key, the store keys refused for it
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[_Row])


class MarkedWrong:
    """(tenant, request key) -> the candidates (their store keys) the caller marked wrong for that request."""

    def __init__(self, path: Path | None = None, max_entries: int = 65_536) -> None:
        self.path = path
        self.max_entries = max_entries
        self._marks: TenantLru[str, tuple[str, ...]] = TenantLru(max_entries)
        if path is not None:
            self._load(path)

    def mark(self, tenant: str, key: str, store_key: str) -> None:
        """The answer stored under ``store_key`` was wrong for the request whose key is ``key``."""
        refused = self._marks.get(tenant, key) or ()
        self._marks.put(tenant, key, refused if store_key in refused else (*refused, store_key))

    def refuses(self, tenant: str, key: str, store_key: str) -> bool:
        """Whether the caller marked ``store_key``'s answer wrong for ``key`` (a dict lookup: the hit path's)."""
        refused = self._marks.get(tenant, key)
        return refused is not None and store_key in refused

    def drop(self, tenant: str | None = None) -> None:
        """Forget the marks of ``tenant`` (None: everyone's): a flush leaves no answer they were about."""
        self._marks.drop(tenant)

    def held(self, tenant: str) -> int:
        """How many requests ``tenant`` has marks for (its ``/stats``)."""
        return self._marks.held(tenant)

    def __len__(self) -> int:
        return len(self._marks)

    def save(self) -> None:
        """Write the table (temp file + rename: a kill mid-write leaves the last one); a failure is logged, the
        marks are then lost at the next start."""
        if self.path is None:
            return
        rows = [(tenant, key, list(refused)) for tenant, key, refused in self._marks.items()]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_bytes(_encoder.encode(rows))
            os.replace(tmp, self.path)
        except STORAGE_ERRORS as exc:
            log.warning("the callers' wrong marks were not saved (%s): they are lost at the next start", exc)

    def _load(self, path: Path) -> None:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return
        except STORAGE_ERRORS as exc:
            log.warning("the callers' wrong marks were not read (%s): starting without them", exc)
            return
        try:
            rows = _decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("the callers' wrong marks in %s do not decode: starting without them", path)
            return
        for tenant, key, refused in rows[-self.max_entries:]:
            self._marks.put(tenant, key, tuple(refused))
