"""scripts/measure_second_stage.py: it decides as the server's verifier does, and its fit uses the second cosine."""

from __future__ import annotations

import numpy as np

from edgecache.semantic.verifier import FEATURES, Verifier
from edgecache.bench import second_stage as measure_second_stage
from edgecache.bench import semantic_eval as eval_semantic
from tests.test_verifier import small_fit_sets

#: The right pairs of small_fit_sets(): a fake second embedder gives each pair one vector.
PARTNERS = {"北京今天天气如何": "北京的天气怎么样", "我忘记密码了，如何重新设置密码": "怎么重置我的密码",
            "如何申请退款": "我想退款", "How can I reset my password?": "How do I reset my password?",
            "My card has not arrived yet": "Where is my card?"}


class PairedEmbedder:
    """A second stage that knows the answers: cosine 1 on a right pair, near 0 on any other."""

    dim = 64

    def embed(self, texts: list[str]) -> np.ndarray:
        out = []
        for text in texts:
            seed = int.from_bytes(PARTNERS.get(text, text).encode()[:8].ljust(8, b"\0"), "little")
            v = np.random.default_rng(seed).standard_normal(self.dim)
            out.append(v / np.linalg.norm(v))
        return np.array(out)


def rows_of() -> dict[str, measure_second_stage.Rows]:
    return {name: measure_second_stage.Rows(cases, PairedEmbedder()) for name, (_, cases) in small_fit_sets().items()}


def test_first_stage_decisions_are_the_server_verifiers() -> None:
    verifier = Verifier.load()
    first = list(range(len(FEATURES)))
    for name, (script, cases) in small_fit_sets().items():
        model = verifier.params.models[script]
        score, ok = rows_of()[name].decisions(first, np.array(model.weights), model.bias)
        expected_score, expected_ok = eval_semantic.verifier_decisions(verifier, cases)
        np.testing.assert_allclose(score, expected_score, atol=1e-9)
        assert ok.tolist() == expected_ok.tolist()


def test_the_fit_weighs_a_second_cosine_that_separates_right_from_wrong() -> None:
    sets = rows_of()
    both = list(range(len(FEATURES) + len(measure_second_stage.SECOND)))
    weights, bias, cuts = measure_second_stage.fit(sets, both)
    assert weights[len(FEATURES)] > 0.5  # the second cosine, held non-negative, carries weight
    assert set(cuts) == {"zh", "en"} and all(set(c) == {0.005, 0.01} for c in cuts.values())
    for rows in sets.values():
        score, ok = rows.decisions(both, weights, bias)
        assert score[ok].min() > score[~ok & (score >= 0)].max()
