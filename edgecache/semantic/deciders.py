"""The semantic layer's three ways of deciding whether the nearest stored prompts may answer a query.

Each decider is a function of the query, the candidates the index found (nearest first), the scenario's rule and
the query's vector, and returns the :class:`~edgecache.semantic.lookup.Lookup` it decided. None of them does I/O or keeps
state; the semantic cache (:mod:`edgecache.semantic.cache`) runs them on its index thread and hands the learner's
decision in as a function, since the learner is the one decider with state (taught by labels, under a lock).

- :func:`by_threshold`: the nearest candidate, when its cosine reaches the threshold and the guard finds no
  difference the answer depends on (a scenario's explicit threshold, and any embedder the verifier was not fitted
  for);
- :func:`by_verifier`: the best of the candidates by the verifier's calibrated score, cut at the scenario's target;
- :func:`by_learner`: the nearest candidate past the guard, served, explored or missed as the learner decides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from edgecache.semantic import refusals
from edgecache.semantic.guard import check
from edgecache.semantic.guard import rule_of as guard_rule_of
from edgecache.semantic.index import Candidate
from edgecache.semantic.learner import Decision
from edgecache.semantic.lookup import Lookup, MatchRule, SemanticHit
from edgecache.semantic.verifier import Verifier

#: How a decider is called by the cache: (query, candidates nearest first, rule, the query's vector) -> Lookup.
Decider = Callable[[str, list[Candidate], MatchRule, np.ndarray], Lookup]


def guard_refusal(query: str, best: Candidate, vector: np.ndarray, guard_rules: Sequence[str]) -> Lookup | None:
    """The guard's veto of the nearest candidate (a difference the answer depends on), or None."""
    verdict = check(query, best.text, guard_rules)
    if verdict.allowed:
        return None
    reason = verdict.reason or "guard"
    return Lookup(vector=vector, refused_by_guard=reason,
                  refusal=refusals.by_guard(guard_rule_of(reason)), candidate=SemanticHit.of(best))


def by_threshold(query: str, found: list[Candidate], rule: MatchRule, vector: np.ndarray,
                 guard_rules: Sequence[str]) -> Lookup:
    """The rule before the verifier: the nearest candidate, over the threshold, past the guard's veto."""
    if not found:
        return Lookup(vector=vector)
    best = found[0]
    threshold = rule.threshold if rule.threshold is not None else 1.0
    if best.similarity < threshold:
        return Lookup(vector=vector, refusal=refusals.BELOW_THRESHOLD, candidate=SemanticHit.of(best))
    return guard_refusal(query, best, vector, guard_rules) or Lookup(vector=vector, candidate=SemanticHit.of(best))


def by_verifier(query: str, found: list[Candidate], rule: MatchRule, vector: np.ndarray,
                verifier: Verifier) -> Lookup:
    """The verifier's choice among the candidates, cut at the scenario's target false-hit rate."""
    if not found:
        return Lookup(vector=vector)
    judged = verifier.judge(query, [(c.text, c.similarity) for c in found],
                            verifier.cut(rule.target_false_hit_rate, query))
    if judged.chosen is None:
        return Lookup(vector=vector, score=judged.score, refusal=judged.refusal, refused_by_guard=judged.rule,
                      candidate=SemanticHit.of(found[0]))
    return Lookup(vector=vector, score=judged.score, candidate=SemanticHit.of(found[judged.chosen]))


def by_learner(query: str, found: list[Candidate], vector: np.ndarray, guard_rules: Sequence[str],
               learned: Callable[[Candidate], Decision]) -> Lookup:
    """The nearest candidate past the guard, as the learner decides it (``learned``: its decision about one
    candidate). The guard's rules stay vetoes: a minimal pair (20 vs 50 dollars) must not cost a wrong answer to
    learn from, and the learner learns only from what it decided, so it is asked only past them."""
    if not found:
        return Lookup(vector=vector)
    best = found[0]
    vetoed = guard_refusal(query, best, vector, guard_rules)
    if vetoed is not None:
        return vetoed
    decision = learned(best)
    candidate = SemanticHit.of(best)
    if decision.action == "serve":
        return Lookup(vector=vector, candidate=candidate, learned=decision)
    # An exploration is a refusal: the engine computes the answer, the client gets that fresh answer (never the
    # cached one), and the comparison of the two is the label.
    return Lookup(vector=vector, candidate=candidate, learned=decision,
                  refusal=refusals.EXPLORE if decision.action == "explore" else refusals.by_learner(decision.reason))
