"""Why the semantic layer did not serve a candidate: the one spelling of every refusal reason.

A refusal is a short string, because it travels as data: in :attr:`Lookup.refusal`, the decision log's ``reason``,
the ``reason`` label of ``edgecache_semantic_refusals_total`` and ``edgecache tune``'s strata. It is made here and
read here; no other module writes or parses one by hand.

=====================  ======================================================================================
``below_threshold``    the nearest candidate's cosine is under the scenario's threshold (threshold rule)
``below_cut``          the verifier's best score is under the cut for the scenario's target (verifier rule)
``guard:<rule>``       the guard found a difference the answer depends on (threshold rule, and the learner's veto)
``veto:<rule>``        the same, found by the verifier's rules
``explore``            the learner refused a candidate it would serve, to label it against the engine's answer
``learner:<reason>``   the learner refused it (``<reason>`` is its :data:`~edgecache.semantic.learner.Reason`)
``marked_wrong``       the caller marked this candidate's answer wrong for this very request (``POST
                       /v1/feedback``; :mod:`edgecache.semantic.marks`)
=====================  ======================================================================================

Refused **for want of labels** (:func:`for_want_of_labels`, counted on ``/stats``): the learner's estimate would
serve the candidate but its bound is too wide, so it explored it (``explore``: refused to get a label; an audit of
a confident serve is one too: about 2 % of them) or, its exploration budget spent, missed it
(``learner:unsure``). More labels (a model judge, the callers' feedback) turn these into hits.
"""

from __future__ import annotations

BELOW_THRESHOLD = "below_threshold"
BELOW_CUT = "below_cut"
EXPLORE = "explore"
MARKED_WRONG = "marked_wrong"

_GUARD = "guard:"
_VETO = "veto:"
_LEARNER = "learner:"


def by_guard(rule: str) -> str:
    """The guard refused the nearest candidate under ``rule`` (``numbers``, ``negation``, ...)."""
    return _GUARD + rule


def by_veto(rule: str) -> str:
    """The verifier's rule ``rule`` vetoed its best candidate."""
    return _VETO + rule


def by_learner(reason: str) -> str:
    """The learner's miss, under its reason (an exploration is :data:`EXPLORE`, not this)."""
    return _LEARNER + reason


def is_rule(refusal: str | None) -> bool:
    """Refused by a rule (the guard's or the verifier's veto) before any learned decision was made: the learner
    never decided it, so its label teaches the learner nothing."""
    return refusal is not None and refusal.startswith((_GUARD, _VETO))


def guard_rule(refusal: str | None) -> str | None:
    """The guard's rule of a ``guard:<rule>`` refusal, else None."""
    return refusal[len(_GUARD):] if refusal is not None and refusal.startswith(_GUARD) else None


def for_want_of_labels(refusal: str | None) -> bool:
    """The learner refused the candidate because it has too few labels to be sure of it (see the module)."""
    return refusal in _WANT_OF_LABELS


_WANT_OF_LABELS = frozenset({EXPLORE, _LEARNER + "unsure"})
