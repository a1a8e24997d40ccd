"""May a cached answer serve this query? A calibrated score over the nearest candidates of a semantic lookup.

One cosine threshold per scenario did not transfer between workloads: a cut strict enough for Chinese
word-swap pairs served almost nothing on short customer-service questions, and one loose enough to hit there served
wrong answers on English question pairs. The verifier instead estimates P(the cached answer serves the query) from
several cheap signals of one (query, candidate) pair:

- the default embedder's cosine, with hinges above 0.8 / 0.9 / 0.95 so the model can bend the curve;
- lexical evidence: overlap of content units (characters for Chinese, words for English), containment, length ratio;
- the guard's rules (:mod:`edgecache.semantic.guard`) as 0/1 features, not vetoes; a rule stays a hard veto only on a
  minimal pair (:attr:`VerifierParams.vetoes`: the rule fires and the two prompts otherwise share most of their
  content units), where the difference the rule found is the whole difference.

The score is a logistic model per script (``zh`` for text with Chinese characters, ``en`` otherwise), with signs
constrained (more cosine or overlap never lowers the score; a firing guard rule never raises it), fitted by
``scripts/fit_verifier.py`` on the permissive sets only. Each model carries a calibration table: the score cut that
kept false hits at or under a target share of lookups on every set it was fitted on, for a ladder of targets. A
scenario states its target false-hit rate; :meth:`Verifier.cut` turns it into a cut.

The parameters ship as ``verifier_params.json`` next to this module and are rebuilt byte for byte by
``scripts/fit_verifier.py``. Everything here is pure Python + numpy on short strings: tens of microseconds per
candidate, run on the index's worker thread.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import msgspec

from edgecache.semantic import guard, refusals

#: The features, in the order the weights are stored. Changing it invalidates the shipped file (the fit rebuilds it).
FEATURES: tuple[str, ...] = (
    "cosine", "cosine_over_80", "cosine_over_90", "cosine_over_95",
    "overlap", "containment", "length_ratio",
    "numbers", "entities", "negation", "antonyms", "order", "code",
)
#: The sign each weight is held to: +1 never negative, -1 never positive, 0 free.
SIGNS: dict[str, int] = {
    "cosine": 1, "cosine_over_80": 1, "cosine_over_90": 1, "cosine_over_95": 1,
    "overlap": 1, "containment": 1, "length_ratio": 1,
    "numbers": -1, "entities": -1, "negation": -1, "antonyms": -1, "order": -1, "code": -1,
}
RULE_FEATURES: tuple[str, ...] = tuple(guard.RULES)  # one feature per guard rule, whichever the guard runs

#: The parameters the package ships (rebuilt by scripts/fit_verifier.py).
SHIPPED_PARAMS = Path(__file__).with_name("verifier_params.json")

_HAS_CJK = re.compile(r"[\u3400-\u9fff]")


def language(query: str) -> str:
    """The model a query is scored with: ``zh`` when it has a Chinese character, else ``en``."""
    return "zh" if _HAS_CJK.search(query) else "en"


def features(query: str, cached: str, cosine: float) -> tuple[list[float], dict[str, str]]:
    """The feature vector of one pair (in :data:`FEATURES` order) and the reasons of the guard rules that fired."""
    a, b = guard.units(query), guard.units(cached)
    sa, sb = set(a), set(b)
    inter = len(sa & sb)
    overlap = inter / max(len(sa | sb), 1)
    containment = inter / max(min(len(sa), len(sb)), 1)
    length_ratio = min(len(a), len(b)) / max(len(a), len(b), 1)
    fired: dict[str, str] = {}
    if query != cached:
        for name in RULE_FEATURES:
            reason = guard.RULES[name](query, cached)
            if reason is not None:
                fired[name] = reason
    row = [cosine, max(0.0, cosine - 0.8), max(0.0, cosine - 0.9), max(0.0, cosine - 0.95),
           overlap, containment, length_ratio]
    row += [1.0 if name in fired else 0.0 for name in RULE_FEATURES]
    return row, fired


class ScriptModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The logistic model of one script, and its calibration."""

    weights: list[float]  # one per FEATURES entry
    bias: float
    #: (target false-hit rate, score cut) pairs, targets ascending: the cut that met the target on every fit set.
    cuts: list[tuple[float, float]]


class VerifierParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The shipped file's content (``verifier_params.json``)."""

    embedder: str  # the embedder version whose cosine the models were fitted on
    features: list[str]
    #: rule -> the content-unit overlap from which a firing rule refuses outright (a minimal pair)
    vetoes: dict[str, float]
    models: dict[str, ScriptModel]
    fitted_on: list[str]  # the data files, for the record


class Judgement(msgspec.Struct, frozen=True):
    """The verifier's decision on one lookup's candidates.

    ``chosen`` is the index (into the candidates given) of the one to serve, or None. ``score`` is the best score
    seen (of the chosen one when there is one). ``refusal`` says why nothing was served: ``below_cut`` or
    ``veto:<rule>``; ``rule`` names the guard rule that fired on the best-scored refused candidate, if any.
    """

    chosen: int | None
    score: float
    cut: float
    refusal: str | None = None
    rule: str | None = None


class Verifier:
    """Scores (query, candidate) pairs and picks the candidate to serve, if any."""

    def __init__(self, params: VerifierParams) -> None:
        if list(params.features) != list(FEATURES):
            raise ValueError("verifier parameters were fitted for other features; rerun scripts/fit_verifier.py")
        self.params = params
        self._vetoes = dict(params.vetoes)
        self._overlap = FEATURES.index("overlap")

    @classmethod
    def load(cls, path: str | Path | None = None) -> Verifier:
        """The shipped parameters (``path`` None) or a file written by ``scripts/fit_verifier.py``."""
        data = Path(path or SHIPPED_PARAMS).read_bytes()
        return cls(msgspec.json.decode(data, type=VerifierParams))

    @property
    def embedder(self) -> str:
        return self.params.embedder

    def score(self, query: str, cached: str, cosine: float) -> tuple[float, dict[str, str]]:
        """P(the answer cached for ``cached`` serves ``query``), and the guard rules that fired."""
        score, fired, _, _ = self._score(query, cached, cosine)
        return score, fired

    def _score(self, query: str, cached: str, cosine: float) -> tuple[float, dict[str, str], float, str | None]:
        """The score, the rules that fired, the score had no rule fired, and the rule that vetoes (if one does)."""
        row, fired = features(query, cached, cosine)
        model = self.params.models[language(query)]
        z = model.bias + sum(w * x for w, x in zip(model.weights, row))
        without = z - sum(w * x for w, x, name in zip(model.weights, row, FEATURES) if name in RULE_FEATURES)
        veto = next((name for name in fired
                     if name in self._vetoes and row[self._overlap] >= self._vetoes[name] - 1e-12), None)
        return _sigmoid(z), fired, _sigmoid(without), veto

    def cut(self, target_false_hit_rate: float, query: str) -> float:
        """The score cut that met ``target_false_hit_rate`` on the fit data, for the query's script.

        Between two calibrated targets the stricter one's cut applies; below the smallest, nothing is served.
        """
        cuts = self.params.models[language(query)].cuts
        chosen = 1.0 + 1e-9  # stricter than any probability: serve nothing
        for target, cut in cuts:
            if target <= target_false_hit_rate + 1e-12:
                chosen = cut
        return chosen

    def judge(self, query: str, candidates: Sequence[tuple[str, float]], cut: float) -> Judgement:
        """Pick, among ``(text, cosine)`` candidates (nearest first), the best-scored one at or over ``cut``.

        An identical prompt always serves. A hard veto removes a candidate whatever its score. When nothing serves,
        the refusal is ``veto:<rule>`` if the best candidate was vetoed, else ``below_cut``; ``rule`` names a guard
        rule only when it made the difference (the candidate would have reached the cut had it not fired).
        """
        best_i, best_score = None, -1.0
        refused: tuple[float, str | None, bool] = (-1.0, None, False)  # score, deciding rule, vetoed
        for i, (text, cosine) in enumerate(candidates):
            if text == query:
                return Judgement(chosen=i, score=1.0, cut=cut)
            score, fired, without_rules, veto = self._score(query, text, cosine)
            if veto is None and score >= cut:
                if score > best_score:
                    best_i, best_score = i, score
                continue
            deciding = veto or (next(iter(fired)) if fired and without_rules >= cut else None)
            if score > refused[0]:
                refused = (score, deciding, veto is not None)
        if best_i is not None:
            return Judgement(chosen=best_i, score=best_score, cut=cut)
        if not candidates:
            return Judgement(chosen=None, score=0.0, cut=cut)
        score, rule, vetoed = refused
        return Judgement(chosen=None, score=max(score, 0.0), cut=cut,
                         refusal=refusals.by_veto(rule) if vetoed and rule else refusals.BELOW_CUT, rule=rule)


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, z))))
