"""``POST /v1/feedback``: the caller says whether an answer it received was right.

Body ``{"response_id": "chatcmpl-...", "correct": false}``: the ``id`` of a chat or text completion this server
sent the caller's tenant. Only that tenant may mark it; any other tenant's response id, an id this server never
sent, and one too old to be remembered all get the same 404 (so a tenant cannot learn that another's id exists).

What a mark does depends on what served the response (its ``X-EdgeCache``):

- **semantic** (or ``shared`` from a semantic hit): the mark is a label of that semantic decision, appended to the
  decision log under labeler ``feedback`` (so ``edgecache tune`` and the learner see it, after a restart too), and
  taught to the learner, which demotes the cached answer after its rule (``semantic.learner_demote_after`` wrong
  labels where it would serve it). A **wrong** mark also demotes the answer for that request at once: the copy the
  hit stored under the request's own key is dropped (so its repeats no longer replay it), and the semantic layer
  refuses that candidate for that request from then on (:mod:`edgecache.semantic.marks`; refusal
  ``marked_wrong``), so the next such request is answered by the engine and that answer is cached as any miss's.
  Other paraphrases still reach the candidate until its labels demote it: one caller's mark is one label.
- **exact**: when the entry is the copy a semantic hit stored (a repeat of that paraphrase), the mark counts as a
  mark of that semantic hit, as above. Otherwise the stored answer is the engine's own for this very request: the
  mark is counted, and nothing is dropped (at temperature 0 the engine would answer the same again).
- **miss** (or ``shared`` from an identical request's computation): the engine's answer; counted only.

Every mark is counted in ``edgecache_feedback_total{tenant, served, verdict}``. A response is marked once; a second
mark answers ``already_marked`` and changes nothing.

Which response was what (:class:`ResponseLedger`): the last ``server.feedback_responses`` responses, by id, in memory
(about 300 bytes each), and for each copy a semantic hit stored, the hit it came from. Written to
``<data_dir>/feedback/responses.msgpack`` at a clean shutdown and read at start, so a restart forgets none of them
(a crash forgets the responses of that run: marks of them get 404; the labels already given stay in the decision
log).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from edgecache.call import Call, Served
from edgecache.errors import NotFound
from edgecache.health import STORAGE_ERRORS
from edgecache.ledger import semantic_reason
from edgecache.pipeline import Reply
from edgecache.runtime import Runtime
from edgecache.semantic import refusals
from edgecache.semantic.learner import Decision
from edgecache.semantic.lookup import Lookup, SemanticHit
from edgecache.semantic.marks import FEEDBACK_LABELER

log = logging.getLogger("edgecache")

Effect = Literal["demoted", "labelled", "recorded", "already_marked"]


class FeedbackRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A caller's verdict on one response it received."""

    response_id: Annotated[str, Meta(min_length=1, max_length=128, description=(
        "The id of a chat or text completion this server sent the same tenant."))]
    correct: Annotated[bool, Meta(description="Whether the answer was right for the request.")]


class FeedbackReply(msgspec.Struct, kw_only=True):
    """What the mark did: ``demoted`` (a wrong semantic answer: labelled, its copy dropped, refused for that
    request), ``labelled`` (a right semantic answer: a good label), ``recorded`` (the engine's own answer: counted),
    ``already_marked`` (this response was marked before: nothing changed)."""

    response_id: str
    correct: bool
    served: Served
    effect: Effect
    object: Literal["edgecache.feedback"] = "edgecache.feedback"


class Responded(msgspec.Struct, array_like=True):
    """What one response was, for its feedback. ``candidate``/``learned``/``decision_id``: the semantic hit that
    served it and the decision that chose it (None: not a semantic answer); ``key``: the request's key in the
    result store (None: not stored)."""

    tenant: str
    scenario: str
    served: Served
    key: str | None = None
    decision_id: str | None = None
    candidate: SemanticHit | None = None
    learned: Decision | None = None
    marked: bool = False


class _Saved(msgspec.Struct, array_like=True):
    responses: list[tuple[str, Responded]]
    copies: list[tuple[str, str, str]]  # tenant, key, the response id of the semantic hit that stored it


class ResponseLedger:
    """The last ``max_entries`` responses by id, and the copies semantic hits stored (bounded alike). Past the bound
    the oldest entry of the tenant that holds the most goes: a tenant within its share (the bound over the tenants
    that hold any) never loses an entry to another tenant's traffic."""

    def __init__(self, path: Path | None = None, max_entries: int = 65_536) -> None:
        self.path = path
        self.max_entries = max_entries
        self._responses: dict[str, Responded] = {}
        self._ids_of: dict[str, OrderedDict[str, None]] = {}  # tenant -> its response ids, oldest first
        self._copies: OrderedDict[tuple[str, str], Responded] = OrderedDict()
        self._copies_of: dict[str, int] = {}
        if path is not None:
            self._load(path)

    def _add_response(self, response_id: str, entry: Responded) -> None:
        self._responses[response_id] = entry
        ids = self._ids_of.setdefault(entry.tenant, OrderedDict())
        ids[response_id] = None
        ids.move_to_end(response_id)
        if len(self._responses) > self.max_entries:
            largest = max(self._ids_of.values(), key=len)
            oldest, _ = largest.popitem(last=False)
            self._responses.pop(oldest, None)
            if not largest:
                self._ids_of = {t: i for t, i in self._ids_of.items() if i}

    def _add_copy(self, tenant: str, key: str, entry: Responded) -> None:
        if (tenant, key) not in self._copies:
            self._copies_of[tenant] = self._copies_of.get(tenant, 0) + 1
        self._copies[(tenant, key)] = entry
        if len(self._copies) > self.max_entries:
            largest = max(self._copies_of, key=self._copies_of.__getitem__)
            oldest = next(pair for pair in self._copies if pair[0] == largest)
            del self._copies[oldest]
            self._copies_of[largest] -= 1

    def remember(self, response_id: str, call: Call, reply: Reply) -> None:
        """The response ``response_id`` answered ``call`` as ``reply`` says (the hit path: a few dict operations)."""
        lookup = reply.lookup
        hit = lookup.hit if lookup is not None and reply.answer is not None else None
        if hit is None:
            entry = Responded(call.tenant, call.scenario, reply.served, reply.key)
        else:
            assert lookup is not None
            entry = Responded(call.tenant, call.scenario, reply.served, reply.key, reply.decision_id, hit,
                              lookup.learned)
            if reply.key is not None:
                self._add_copy(call.tenant, reply.key, entry)
        self._add_response(response_id, entry)

    def find(self, tenant: str, response_id: str) -> Responded | None:
        """The response, if ``tenant`` received it and it is remembered."""
        entry = self._responses.get(response_id)
        return entry if entry is not None and entry.tenant == tenant else None

    def copied_by(self, tenant: str, key: str) -> Responded | None:
        """The semantic hit whose answer was stored under ``key`` (a repeat of that request replays it)."""
        return self._copies.get((tenant, key))

    def drop(self, tenant: str | None = None) -> None:
        """A flush: the copies it dropped are no semantic hit's any more (the responses stay markable)."""
        if tenant is None:
            self._copies.clear()
            self._copies_of.clear()
            return
        for pair in [pair for pair in self._copies if pair[0] == tenant]:
            del self._copies[pair]
        self._copies_of.pop(tenant, None)

    def held(self, tenant: str) -> int:
        """Responses of ``tenant`` remembered for its feedback (its ``/stats``)."""
        return len(self._ids_of.get(tenant, ()))

    def __len__(self) -> int:
        return len(self._responses)

    def save(self) -> None:
        """Write the table (temp file + rename); a failure is logged and costs the marks of these responses."""
        if self.path is None:
            return
        ids = {id(entry): response_id for response_id, entry in self._responses.items()}
        copies = [(tenant, key, ids[id(entry)]) for (tenant, key), entry in self._copies.items() if id(entry) in ids]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_bytes(msgspec.msgpack.encode(_Saved(list(self._responses.items()), copies)))
            os.replace(tmp, self.path)
        except STORAGE_ERRORS as exc:
            log.warning("the responses feedback can name were not saved (%s): their marks get 404 after the restart",
                        exc)

    def _load(self, path: Path) -> None:
        try:
            saved = msgspec.msgpack.decode(path.read_bytes(), type=_Saved)
        except FileNotFoundError:
            return
        except (*STORAGE_ERRORS, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("the responses feedback can name were not read from %s (%s): starting without them", path,
                        exc)
            return
        for response_id, entry in saved.responses[-self.max_entries:]:
            self._add_response(response_id, entry)
        for tenant, key, response_id in saved.copies[-self.max_entries:]:
            entry = self._responses.get(response_id)
            if entry is not None:
                self._add_copy(tenant, key, entry)


async def apply_feedback(rt: Runtime, responses: ResponseLedger, tenant: str, mark: FeedbackRequest) -> FeedbackReply:
    """Apply ``tenant``'s mark (see the module); 404 when the response is not that tenant's or not remembered."""
    found = responses.find(tenant, mark.response_id)
    if found is None:
        raise NotFound(f"no response {mark.response_id!r} to mark: this server did not send it to this API key's "
                       f"tenant, or it is older than the last {responses.max_entries} responses",
                       param="response_id")

    def reply(effect: Effect) -> FeedbackReply:
        return FeedbackReply(response_id=mark.response_id, correct=mark.correct, served=found.served, effect=effect)

    if found.marked:
        return reply("already_marked")
    found.marked = True
    rt.metrics.observe_feedback(tenant, found.served, mark.correct)
    hit = found
    if found.candidate is None and found.served == "exact" and found.key is not None:
        copied = responses.copied_by(tenant, found.key)
        if copied is not None and not copied.marked:  # a repeat of a semantic hit: its mark is that hit's
            copied.marked = True
            hit = copied
    if hit.candidate is None:
        return reply("recorded")
    if rt.decisions is not None and hit.decision_id is not None:
        rt.decisions.labelled(hit.decision_id, mark.correct, FEEDBACK_LABELER)
    rt.metrics.observe_label(tenant, hit.scenario, "hit", mark.correct)
    if rt.semantic_layer is not None:
        rt.semantic_layer.learn(tenant, hit.scenario, Lookup(vector=None, candidate=hit.candidate,
                                                             learned=hit.learned), None, mark.correct)
    if mark.correct:
        return reply("labelled")
    if hit.key is not None:
        # Refused first, then dropped: a lookup between the two must not store the copy again.
        rt.marks.mark(tenant, hit.key, hit.candidate.store_key)
        await rt.stores(tenant).delete(hit.key)
        rt.ledger.history.removed(hit.key, semantic_reason(refusals.MARKED_WRONG))  # its next miss says why
    return reply("demoted")
