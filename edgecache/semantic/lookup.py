"""What a semantic lookup is about and what it decided: the probe a request offers, the candidate the index found,
the :class:`Lookup` outcome, the scenario's :class:`MatchRule`, and how a lookup is written to the decision log.

These are the semantic layer's shared words. The cache (:mod:`edgecache.semantic.cache`), the deciders
(:mod:`edgecache.semantic.deciders`), the labeler and the request path read them from here, and the decision log never needs
the cache to record one.
"""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np

from edgecache.engines.base import GenerationRequest
from edgecache.semantic import refusals
from edgecache.semantic.decision_log import Decision as LoggedDecision
from edgecache.semantic.decision_log import DecisionLog
from edgecache.semantic.index import Candidate
from edgecache.semantic.learner import Decision

_encoder = msgspec.json.Encoder()


class Probe(msgspec.Struct, frozen=True):
    """What a request offers the semantic layer: the text to embed and the namespace it must match in."""

    text: str
    namespace: str


def probe_for(request: GenerationRequest, model_version: str, *, any_max_tokens: bool = False) -> Probe | None:
    """The semantic probe of a first-turn chat request, or None when the request is not matched semantically.
    ``any_max_tokens``: its namespace leaves ``max_tokens`` out (a :func:`~edgecache.keys.prefix_stable` request,
    whose stored answers serve every limit they cover)."""
    if request.messages is None:
        return None
    systems, rest = [], []
    for message in request.messages:
        (systems if message.role in ("system", "developer") and not rest else rest).append(message)
    if len(rest) != 1 or rest[0].role != "user" or not rest[0].content.strip():
        return None
    # Everything but the user's text: the system prompt, the sampling, and the tools, tool choice and response
    # format, so a paraphrase is never served across different tool sets or schemas.
    fields = msgspec.structs.replace(request, messages=tuple(systems), cache=None)
    if any_max_tokens:
        fields = msgspec.structs.replace(fields, params=msgspec.structs.replace(fields.params, max_tokens=0))
    context = (model_version, fields)
    return Probe(text=rest[0].content, namespace=hashlib.blake2b(_encoder.encode(context), digest_size=8).hexdigest())


class SemanticHit(msgspec.Struct, frozen=True):
    similarity: float
    store_key: str
    vector_key: int

    @classmethod
    def of(cls, candidate: Candidate) -> SemanticHit:
        """The index's candidate as the decision names it (without its text: the guard's business only)."""
        return cls(similarity=candidate.similarity, store_key=candidate.store_key, vector_key=candidate.vector_key)


class Lookup(msgspec.Struct, frozen=True):
    """A lookup's outcome: the candidate it decided about (if any), whether it served, and the query's vector, kept
    to index the answer on a miss.

    ``candidate`` is the entry the decision was about: the one that serves, or the refused nearest candidate (the
    decision log records it, and a miss labels it against the fresh answer). It serves unless ``refusal`` says why
    not (``below_threshold``, ``below_cut``, ``veto:<rule>``, ``guard:<rule>``, ``explore`` or
    ``learner:<reason>``); ``refused_by_guard`` is the guard's reason when a rule fired on the refused candidate.
    ``score`` is the verifier's score of the best candidate (None under a threshold rule). ``learned`` is the
    learner's decision about it (None under the other rules, and when the guard refused before the learner was
    asked).
    """

    vector: np.ndarray | None
    candidate: SemanticHit | None = None
    refusal: str | None = None
    refused_by_guard: str | None = None
    score: float | None = None
    learned: Decision | None = None

    @property
    def similarity(self) -> float | None:
        """The candidate's cosine similarity to the query (None without a candidate)."""
        return self.candidate.similarity if self.candidate is not None else None

    @property
    def hit(self) -> SemanticHit | None:
        """The candidate that serves: there was one, and nothing refused it."""
        return self.candidate if self.refusal is None else None

    @property
    def explored(self) -> bool:
        """The learner refused a candidate it would have served, to label it against the engine's answer."""
        return self.refusal == refusals.EXPLORE


class MatchRule(msgspec.Struct, frozen=True):
    """How a scenario decides (profiles are data): the verifier at a target false-hit rate, or a cosine threshold
    with the guard's veto when ``threshold`` is set (the override, and the rule for an embedder the verifier was not
    fitted for). Under a learner, ``threshold`` is its prior and ``target_false_hit_rate`` its bound."""

    target_false_hit_rate: float = 0.005
    threshold: float | None = None


def record_lookup(decisions: DecisionLog, tenant: str, scenario: str, query: str, lookup: Lookup, *, served: bool,
                  dropped: str | None = None) -> str:
    """Log what a semantic lookup decided; returns the decision's id. ``served``: its hit's answer went out;
    ``dropped``: why a hit's answer did not (``gone``: expired or evicted; ``too_old`` for the caller's TTL)."""
    candidate = lookup.candidate
    decision: LoggedDecision
    if served:
        decision, reason = "hit", None
    elif dropped is not None:
        decision, reason = "miss", dropped
    elif candidate is None:
        decision, reason = "miss", None
    elif lookup.explored:
        decision, reason = "explore", lookup.learned.reason if lookup.learned else None
    else:
        decision, reason = "refused", lookup.refusal
    return decisions.decided(tenant, scenario, query, decision, reason=reason,
                       store_key=candidate.store_key if candidate else None,
                       vector_key=candidate.vector_key if candidate else None,
                       similarity=lookup.similarity, score=lookup.score)
