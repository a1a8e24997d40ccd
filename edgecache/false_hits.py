"""How many of the semantic answers served were wrong: the one estimate of a false-hit rate from labels.

A label says whether a cached answer served its query. From ``bad`` wrong labels of ``n`` (counts, or effective
weighted counts) the rate is ``bad / n`` and its one-sided upper bound is Wilson's score bound: it stays sensible
with few labels and none wrong, where the normal approximation claims a bound of 0. ``/metrics`` and ``/stats``
report labels this way (:meth:`edgecache.metrics.Metrics.observe_label`) and ``edgecache tune`` picks its cuts with
it (:mod:`edgecache.tuning`). The online learner keeps its own running ledger of the same rate (its labels are
weighted by how likely each decision was to be explored, so its variance is summed per label, not binomial) and
reports it beside these (:meth:`edgecache.semantic_learner.SemanticLearner.estimate`).
"""

from __future__ import annotations

import math
from statistics import NormalDist


def wilson_upper(bad: float, n: float, confidence: float = 0.95) -> float:
    """One-sided Wilson score upper bound of a rate seen as ``bad`` of ``n`` (1.0 with no observations; both may be
    effective, weighted counts). ``confidence`` 0 gives the plain rate."""
    if n <= 0:
        return 1.0
    p = bad / n
    if confidence <= 0:
        return p
    z = NormalDist().inv_cdf(confidence)
    z2 = z * z
    centre = p + z2 / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return min(1.0, (centre + spread) / (1 + z2 / n))


def false_hit_estimate(bad: float, n: float, confidence: float = 0.95) -> tuple[float | None, float | None]:
    """(rate, upper bound) of ``bad`` wrong of ``n`` labelled served answers; (None, None) before the first."""
    if n <= 0:
        return None, None
    return bad / n, wilson_upper(bad, n, confidence)
