"""Grouped warmup lines teach the semantic learner: a fresh server serves a taught paraphrase as a semantic hit from
the first request and a minimal pair of another group's question as a miss; teaching stays with its tenant, survives
a restart, and a file that contradicts itself is refused naming its lines. The real embedder and index, in-process
with a fake engine; the learner's arithmetic of taught labels is checked directly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgecache.call import Call
from edgecache.cli.warmup import _batches
from edgecache.engines.base import GenerationRequest, Message, SamplingParams
from edgecache.http.app import create_app
from edgecache.semantic.learner import SemanticLearner
from edgecache.semantic.teaching import GroupedLines, group_labels
from tests.conftest import chat_body, serve_in_process
from tests.fakes import FakeEngine
from tests.test_semantic_http import settled

VERBS = ("reset", "change", "delete", "recover")
THINGS = ("password", "email address", "username", "phone number", "billing address", "profile photo")
FORMS = ("How do I {v} my {t}?", "How can I {v} my {t}?", "What is the way to {v} my {t}?", "I need to {v} my {t}.",
         "Where can I {v} my {t}?")
OTHERS = {
    "refund-30": ["Can I get a refund after 30 days?", "Is a refund possible after 30 days?",
                  "Will you refund me after 30 days?"],
    "ship-paris": ["Do you ship to Paris?", "Can you deliver to Paris?", "Is delivery to Paris available?"],
    "cancel": ["Can I cancel my order?", "Is it possible to cancel my order?", "How can I cancel an order?"],
}


def faq() -> list[dict[str, Any]]:
    """A tenant's FAQ in groups: every verb of every account detail (near questions with other answers), and a few
    more; "How do I reset my password?" and "How can I reset my password?" are in one group."""
    rows = []
    for v in VERBS:
        for t in THINGS:
            group = f"{v}-{t}"
            rows += [{"messages": [{"role": "user", "content": form.format(v=v, t=t)}], "group": group,
                      "max_tokens": 16,
                      **({"answer": f"To {v} your {t}: ..."} if n == 0 else {})} for n, form in enumerate(FORMS)]
    for group, texts in OTHERS.items():
        rows += [{"messages": [{"role": "user", "content": text}], "group": group, "max_tokens": 16,
                  **({"answer": f"answer of {group}"} if n == 0 else {})} for n, text in enumerate(texts)]
    return rows


def numbered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"line": n, "request": row} for n, row in enumerate(rows, start=1)]


async def warm(c: Any, rows: list[dict[str, Any]], **extra: Any) -> Any:
    return await c.post("/admin/warmup", json={"lines": numbered(rows), **extra})


async def ask(c: Any, text: str) -> Any:
    resp = await c.post("/v1/chat/completions", json=chat_body(text))
    assert resp.status_code == 200, resp.text
    await settled(c)
    return resp


@pytest.fixture
def learner_settings(make_settings: Any) -> Any:
    return lambda **kw: make_settings(semantic__enabled=True, **kw)  # the shipped decision: the learner


async def test_a_taught_group_serves_its_paraphrase_from_the_first_request_and_not_a_minimal_pair(
        learner_settings: Any) -> None:
    engine = FakeEngine()
    async with serve_in_process(create_app(learner_settings(), engine=engine)) as c:
        resp = await warm(c, faq())
        assert resp.status_code == 200, resp.text
        assert {r["outcome"] for r in resp.json()["results"]} == {"written"}
        assert engine.calls == 0  # every group gave its answer
        hit = await ask(c, "How could I reset my password?")
        assert hit.headers["x-edgecache"] == "semantic", hit.headers
        assert hit.json()["choices"][0]["message"]["content"] == "To reset your password: ..."
        # Minimal pairs of other groups' questions: a number, a negation, another name.
        for text in ("Can I get a refund after 60 days?", "Can I not cancel my order?", "Do you ship to Berlin?"):
            assert (await ask(c, text)).headers["x-edgecache"] == "miss", text
        pools = (await c.get("/stats")).json()["semantic"]["learner"]["pools"]
        assert pools["default/default"]["taught"] > 0


async def test_a_group_without_an_answer_computes_it_once(learner_settings: Any) -> None:
    engine = FakeEngine()
    rows = [{"messages": [{"role": "user", "content": text}], "group": "cancel", "max_tokens": 16}
            for text in OTHERS["cancel"]]
    async with serve_in_process(create_app(learner_settings(), engine=engine)) as c:
        resp = await warm(c, rows)
        assert [r["outcome"] for r in resp.json()["results"]] == ["written"] * 3
        assert engine.calls == 1
        exact = await ask(c, OTHERS["cancel"][2])
        assert exact.headers["x-edgecache"] == "exact"
        assert exact.json()["choices"][0]["message"]["content"] == f"answer to: {OTHERS['cancel'][0]}"


async def test_teaching_never_reaches_another_tenant(learner_settings: Any) -> None:
    engine = FakeEngine()
    async with serve_in_process(create_app(learner_settings(), engine=engine)) as c:
        assert (await warm(c, faq())).status_code == 200
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        # Another tenant holds the same lines, warmed without groups: its vectors, none of the teaching.
        calls = [(Call(tenant="globex", request=GenerationRequest(
            messages=(Message("user", row["messages"][0]["content"]),),
            params=SamplingParams(temperature=0.0, max_tokens=8))), "globex's answer") for row in faq()]
        await rt.pipeline.store_known_answers(calls)
        reply = await rt.pipeline.serve(Call(tenant="globex", request=GenerationRequest(
            messages=(Message("user", "How could I reset my password?"),),
            params=SamplingParams(temperature=0.0, max_tokens=8))))
        text = "".join([chunk.text async for chunk in reply.stream()])
        assert (reply.served, text) == ("miss", "answer to: How could I reset my password?")
        assert ("globex", "default") not in rt.learner.summary() or \
            rt.learner.summary()[("globex", "default")]["taught"] == 0
        assert rt.learner.summary()[("default", "default")]["taught"] > 0


async def test_a_restart_keeps_what_was_taught_and_a_flush_forgets_it(learner_settings: Any) -> None:
    settings = learner_settings()
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        assert (await warm(c, faq())).status_code == 200
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        taught = rt.learner.summary()[("default", "default")]["taught"]
        assert taught == len(rt.semantic.taught_log.read().__next__().labels) > 0
        assert (await c.post("/admin/flush", json={"tenant": "default"})).status_code == 200
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        assert rt.learner.summary() == {}


async def test_a_self_contradicting_file_is_refused_with_its_line_numbers(learner_settings: Any,
                                                                        tmp_path: Path) -> None:
    rows = faq()[:5] + [{"messages": [{"role": "user", "content": "How do I reset my password?"}],
                         "group": "cancel", "max_tokens": 16},
                        {"messages": [{"role": "user", "content": "Can I cancel?"}], "group": "cancel",
                         "answer": "yes"},
                        {"messages": [{"role": "user", "content": "May I cancel?"}], "group": "cancel",
                         "answer": "no"}]
    engine = FakeEngine()
    async with serve_in_process(create_app(learner_settings(), engine=engine)) as c:
        resp = await warm(c, rows)
        assert resp.status_code == 400
        message = resp.json()["error"]["message"]
        assert "lines 1 and 6" in message and "'reset-password'" in message and "'cancel'" in message
        assert "lines 7 and 8" in message and "two different answers" in message
        assert (await ask(c, "How do I reset my password?")).headers["x-edgecache"] == "miss"  # nothing written
    path = tmp_path / "faq.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    with pytest.raises(SystemExit, match="lines 1 and 6"):
        _batches(path)


def test_a_files_groups_are_sent_whole(tmp_path: Path) -> None:
    rows = faq()
    plain = [{"messages": [{"role": "user", "content": f"question {i}"}], "answer": "a"} for i in range(2100)]
    path = tmp_path / "faq.jsonl"
    # Each group split by plain lines, so a send of 2048 lines would cut through groups kept in file order.
    mixed = [row for pair in zip(rows, plain) for row in pair] + plain[len(rows):]
    path.write_text("\n".join(json.dumps(row) for row in mixed) + "\n")
    _, batches = _batches(path)
    where: dict[str, set[int]] = {}
    for n, batch in enumerate(batches):
        for item in batch:
            if item.request.group is not None:  # type: ignore[union-attr]
                where.setdefault(item.request.group, set()).add(n)  # type: ignore[union-attr]
    assert len(where) == len(VERBS) * len(THINGS) + len(OTHERS)
    assert all(len(sends) == 1 for sends in where.values())


def test_group_labels_teach_the_nearest_of_each_variant() -> None:
    vectors = np.array([[1.0, 0.0], [0.99, 0.141], [0.0, 1.0], [0.141, 0.99]], dtype=np.float32)
    taught = group_labels(["a1", "a2", "b1", "b2"], ["a", "a", "b", "b"], vectors)
    assert taught.classes == [["a1", "a2"], ["b1", "b2"]]
    lookups = [(key, ok) for key, _, ok, lookup in taught.labels if lookup]
    assert lookups == [("a2", True), ("a1", True), ("b2", True), ("b1", True)]
    assert sorted((key, ok) for key, _, ok, lookup in taught.labels if not lookup) == \
        [("a2", False), ("a2", False), ("b2", False), ("b2", False)]


def test_taught_labels_weigh_less_as_the_pools_own_come_and_an_untaught_pool_serves_nothing() -> None:
    learner = SemanticLearner()
    assert learner.decide("acme", "default", "x", 0.99, 0.01).action != "serve"  # no prior without labels
    labels = [(f"k{i % 20}", 0.97, True, True) for i in range(200)] + [(f"k{i % 20}", 0.6, False, True)
                                                                       for i in range(200)]
    assert learner.teach("t", "default", [[f"k{i}" for i in range(20)]], labels) == 400
    pool = learner._pools[("t", "default")]
    assert pool.taught_weight() == 1.0
    assert learner.decide("t", "default", "k1", 0.97, 0.01).action == "serve"
    for i in range(400):
        learner.record("t", "default", f"other{i}", 0.97, False)
    assert pool.taught_weight() == 0.5
    assert learner.decide("t", "default", "new", 0.97, 0.01).action != "serve"  # its own labels outrank the FAQ
    assert "t" not in {tenant for tenant, _ in learner.summary()} - {"t"}
    assert ("acme", "default") not in learner.summary() or learner.summary()[("acme", "default")]["taught"] == 0


def test_a_teachings_head_start_pays_for_unsure_serves_at_their_bound_until_it_is_spent() -> None:
    def taught() -> SemanticLearner:
        learner = SemanticLearner(audit_share=0.0)
        labels = [(f"k{i % 20}", 0.97, True, True) for i in range(27)] + [(f"k{i % 20}", 0.6, False, True)
                                                                          for i in range(27)]
        learner.teach("t", "default", [[f"k{i}" for i in range(20)]], labels, prior_cut=0.9)
        return learner

    learner = taught()
    decisions = [learner.decide("t", "default", "k3", 0.97, 0.01, prior_cut=0.9) for _ in range(4)]
    # Unsure (bound over the cut, estimate under it): served while the head start pays for its bound, then explored.
    assert all(d.error <= d.cut < d.bound for d in decisions)
    assert [(d.action, d.reason) for d in decisions] == [("serve", "taught_bound")] * 2 + [("explore", "unsure")] * 2
    pool = learner._pools[("t", "default")]
    assert pool.head_start_spent == pytest.approx(decisions[0].bound + decisions[1].bound)
    assert pool.served_error == pytest.approx(pool.head_start_spent)  # the ledger is charged the bounds too
    head_start = 0.01 * pool.taught_lookup_weight() * pool.taught_lookups
    assert pool.head_start_spent + 1.645 * pool.head_start_var ** 0.5 <= head_start
    # The same labels as the pool's own (no teaching): no head start, the unsure candidate is explored.
    own = SemanticLearner(audit_share=0.0)
    for i in range(27):
        own.record("t", "default", f"k{i % 20}", 0.97, True, prior_cut=0.9)
        own.record("t", "default", f"k{i % 20}", 0.6, False, prior_cut=0.9)
    assert all(own.decide("t", "default", "k3", 0.97, 0.01, prior_cut=0.9).reason != "taught_bound"
               for _ in range(4))


def _faq(learner: SemanticLearner, right: int = 150, wrong: int = 150) -> None:
    """One taught class: its variants meet each other at 0.95 (right) and other groups' at 0.6 (wrong)."""
    labels = [(f"k{i % 20}", 0.95, True, True) for i in range(right)] + [(f"k{i % 20}", 0.6, False, True)
                                                                          for i in range(wrong)]
    learner.teach("t", "default", [[f"k{i}" for i in range(20)]], labels, prior_cut=0.9)


def test_a_class_keeps_every_taught_label_beside_its_own_last_labels() -> None:
    # A class keeps the last entry_labels (32) labels of its own lookups; what it was taught stays whole. Its first
    # lookups (right ones at 0.99) may not push out the taught wrong answers at 0.6: the estimate there stays high.
    # (Asked at 0.6 itself: above the taught wrong answers the class separates cleanly, and the pooled head start,
    # not this estimate, decides.)
    learner = SemanticLearner(audit_share=0.0)
    _faq(learner)
    before = learner.decide("t", "default", "k3", 0.6, 0.01, prior_cut=0.9).error
    for _ in range(40):
        learner.record("t", "default", "k5", 0.99, True, prior_cut=0.9)
    after = learner.decide("t", "default", "k3", 0.6, 0.01, prior_cut=0.9).error
    assert before > 0.5 and after > 0.5


def test_the_class_fit_reaches_its_mode_where_the_labels_separate() -> None:
    # Right answers far below the class's wrong ones on the axis (separated labels): a plain Newton step overshoots
    # and swings; the fit must end where the log-posterior's gradient is zero.
    learner = SemanticLearner()
    rng = np.random.default_rng(0)
    sims = np.concatenate([rng.uniform(0.41, 0.65, 90), rng.uniform(0.85, 0.97, 40)])
    wrong = np.concatenate([np.zeros(90), (rng.random(40) < 0.9).astype(float)])
    rates = np.clip(0.97 - sims, 0.01, 0.99)
    offsets = np.log(rates / (1.0 - rates))
    x = (sims - 0.53) * 10.0
    weights = np.ones(len(sims))
    shift, variance = learner._class_slope(offsets, wrong, x, weights)
    design = np.stack([np.ones_like(x), x], axis=1)
    precision = np.diag([1.0 / learner.spread**2, 1.0 / learner.slope_spread**2])
    # The mode's slope, given its shift: a one-dimensional search on the (concave) log-posterior.
    def gradient(theta: np.ndarray) -> np.ndarray:
        p = 1.0 / (1.0 + np.exp(-(offsets + design @ theta)))
        return design.T @ (weights * (wrong - p)) - precision @ theta
    slopes = np.linspace(-30.0, 30.0, 60001)
    best = slopes[np.argmin([abs(gradient(np.array([shift, s]))[1]) for s in slopes])]
    assert np.abs(gradient(np.array([shift, best]))).max() < 1e-2
    assert abs(shift) < 20.0 and 0.0 < variance < learner.spread**2


def test_traffic_unlike_the_teaching_weighs_the_teaching_down_and_raises_its_estimates() -> None:
    # The tenant taught one FAQ, and its traffic asks other things that land on the FAQ's classes: the labelled
    # lookups the learner would have served come out wrong far more often than estimated.
    learner = SemanticLearner(audit_share=0.0)
    _faq(learner)
    pool = learner._pools[("t", "default")]
    first = learner.decide("t", "default", "k3", 0.95, 0.01, prior_cut=0.9)
    assert first.error <= first.cut and pool.taught_trust() == 1.0
    weight = pool.taught_weight()
    for i in range(10):
        decision = learner.decide("t", "default", f"k{i}", 0.95, 0.01, prior_cut=0.9, may_explore=False)
        learner.record("t", "default", f"k{i}", 0.95, False, prior_cut=0.9, decision=decision)
    # Counted while they were under the cut: it rose over it after a few
    assert pool.taught_check_wrong >= 5 and pool.taught_trust() > 2.0
    assert pool.taught_weight() < weight / 2.0
    later = learner.decide("t", "default", "k3", 0.95, 0.01, prior_cut=0.9)
    assert later.error > 2.0 * first.error and later.error > later.cut
    # Traffic like the teaching (right where it was estimated right) leaves it as it was.
    alike = SemanticLearner(audit_share=0.0)
    _faq(alike)
    for i in range(10):
        decision = alike.decide("t", "default", f"k{i}", 0.95, 0.01, prior_cut=0.9, may_explore=False)
        alike.record("t", "default", f"k{i}", 0.95, True, prior_cut=0.9, decision=decision)
    assert alike._pools[("t", "default")].taught_trust() <= 1.0


def _pooled_faq(learner: SemanticLearner, groups: int = 20, *, scenario: str = "default",
                wrong_lookup: float | None = None) -> None:
    """A taught FAQ of ``groups`` groups of 4 variants: each variant's nearest is a variant of its own group (a
    right lookup at 0.95-0.98), and its nearest of another group came at most 0.85 (a wrong label, no lookup).
    ``wrong_lookup``: one more variant of group 1 whose nearest was a variant of group 0, at that similarity."""
    classes = [[f"g{g}v{v}" for v in range(4)] for g in range(groups)]
    labels = []
    for g in range(groups):
        for v in range(4):
            labels.append((f"g{g}v{(v + 1) % 4}", 0.95 + 0.01 * v, True, True))
            labels.append((f"g{(g + 1) % groups}v{v}", 0.80 + 0.05 * v / 3, False, False))
    if wrong_lookup is not None:
        labels.append(("g0v0", wrong_lookup, False, True))
    learner.teach("t", scenario, classes, labels, prior_cut=0.975)


def test_classes_that_separate_cleanly_lend_each_other_their_evidence() -> None:
    # Twenty groups that all separate cleanly above the pool's line (0.85): a new phrasing above it, below every
    # taught right answer, is served from the pooled head start, charged at the pooled estimate's bound apart from
    # the ledger; under the line it is not.
    learner = SemanticLearner(audit_share=0.0)
    _pooled_faq(learner)
    pool = learner._pools[("t", "default")]
    assert (pool.clean_classes, pool.clean_lookups, pool.line_errors) == (20, 80, 0)
    served = learner.decide("t", "default", "g3v1", 0.90, 0.005, prior_cut=0.975)
    assert (served.action, served.reason) == ("serve", "taught_pool")
    assert (served.error, served.bound) == pytest.approx(pool.pooled_estimate(learner.confidence))
    assert served.bound < 0.05 and pool.pooled_spent == pytest.approx(served.bound) and pool.served_error == 0.0
    assert learner.decide("t", "default", "g3v1", 0.84, 0.005, prior_cut=0.975).reason != "taught_pool"
    # One group alone, taught the same: its own four lookups are all the evidence it has, and its share of them
    # pays for no serve at its bound.
    alone = SemanticLearner(audit_share=0.0)
    _pooled_faq(alone, groups=1)
    lone = alone.decide("t", "default", "g0v1", 0.90, 0.005, prior_cut=0.975)
    assert lone.action != "serve"


def test_a_class_with_a_right_answer_under_the_line_does_not_separate_cleanly() -> None:
    learner = SemanticLearner(audit_share=0.0)
    _pooled_faq(learner)
    learner.teach("t", "default", [["g5v9"]], [("g5v0", 0.82, True, True)], prior_cut=0.975)  # under 0.85
    pool = learner._pools[("t", "default")]
    assert pool.clean_classes == 19
    assert learner.decide("t", "default", "g5v0", 0.90, 0.005, prior_cut=0.975).reason != "taught_pool"
    assert learner.decide("t", "default", "g6v0", 0.90, 0.005, prior_cut=0.975).reason == "taught_pool"


def test_a_taught_question_the_line_would_have_answered_wrongly_raises_the_pooled_estimate() -> None:
    # A variant of group 1 whose nearest was group 0's, at 0.90: the pool's line is then 0.90, and drawn without
    # that variant (at 0.85) it would have served it group 0's answer: one cross-validated error.
    clean, missed = SemanticLearner(audit_share=0.0), SemanticLearner(audit_share=0.0)
    _pooled_faq(clean)
    _pooled_faq(missed, wrong_lookup=0.90)
    pool = missed._pools[("t", "default")]
    assert pool.taught_lines[0] == pytest.approx(0.90) and pool.line_errors == 1
    (error, bound), (clean_error, clean_bound) = pool.pooled_estimate(1.0), \
        clean._pools[("t", "default")].pooled_estimate(1.0)
    assert error > 2 * clean_error and bound > clean_bound
    assert missed.decide("t", "default", "g3v1", 0.88, 0.005, prior_cut=0.975).reason != "taught_pool"  # under it


def test_the_pooled_head_start_holds_each_class_to_its_share_and_stops_where_the_traffic_says_wrong() -> None:
    learner = SemanticLearner(audit_share=0.0)
    _pooled_faq(learner)
    pool = learner._pools[("t", "default")]
    share = 0.005 * pool.pooled_lookups()
    reasons = [learner.decide("t", "default", "g2v0", 0.93, 0.005, prior_cut=0.975).reason for _ in range(40)]
    taken = reasons.count("taught_pool")
    assert 0 < taken < 40 and reasons[:taken] == ["taught_pool"] * taken  # then its share is spent
    bound = pool.pooled_estimate(learner.confidence)[1]
    assert taken * bound <= share < (taken + 1) * bound
    assert learner.decide("t", "default", "g4v0", 0.93, 0.005, prior_cut=0.975).reason == "taught_pool"
    # A wrong label of group 4's own lookups above the line: group 4 is no longer served from the pool, and the
    # check weighs the pooled estimate up for every group.
    decision = learner.decide("t", "default", "g4v0", 0.96, 0.005, prior_cut=0.975, may_explore=False)
    learner.record("t", "default", "g4v0", 0.96, False, prior_cut=0.975, decision=decision)
    assert learner.decide("t", "default", "g4v0", 0.93, 0.005, prior_cut=0.975).reason != "taught_pool"
    assert pool.pooled_trust() > 1.0
    later = learner.decide("t", "default", "g7v0", 0.93, 0.005, prior_cut=0.975)
    assert later.reason == "taught_pool" and later.bound > bound


def test_the_taught_state_says_what_the_pooled_head_start_pays_for() -> None:
    learner = SemanticLearner(audit_share=0.0)
    _pooled_faq(learner)
    state = learner.taught_state("t", "default", 0.005)
    assert state is not None and (state.groups, state.separated) == (20, 20)
    assert state.line == pytest.approx(0.85)
    assert state.describe() == f"taught 20 groups: a paraphrase above 0.85 is served; {state.serves} unsure serves " \
                               "of head start"
    # As many serves as it says, round the groups, and then none.
    reasons = [learner.decide("t", "default", f"g{n % 20}v0", 0.93, 0.005, prior_cut=0.975).reason
               for n in range(state.serves + 5)]
    assert reasons.count("taught_pool") == state.serves and reasons[:state.serves] == ["taught_pool"] * state.serves
    spent = learner.taught_state("t", "default", 0.005)
    assert spent is not None and spent.serves == 0 and "is spent" in spent.describe()
    assert learner.taught_state("nobody", "default", 0.005) is None
    unclean = SemanticLearner()
    unclean.teach("t", "default", [["a"], ["b"]], [("a", 0.9, True, True), ("b", 0.95, False, True)])
    assert "none separates cleanly" in unclean.taught_state("t", "default", 0.005).describe()


def _taught_labels(learner: SemanticLearner, tenant: str, scenario: str) -> tuple:
    """What a pool was taught: its counts, and each class's taught labels as (right?, similarity), sorted."""
    pool = learner._pools[(tenant, scenario)]
    classes = sorted(sorted((ok, s) for s, ok in taught.labels) for taught in learner._classes(tenant, scenario, pool))
    return (pool.taught, pool.taught_lookups, pool.taught_right.tolist(), pool.taught_wrong.tolist(),
            pool.taught_lines[0] if pool.taught_lines else None, classes)


def _same_teaching(a: tuple, b: tuple) -> bool:
    """The same labels, similarities to 1e-4 (the same vectors multiplied in another order round otherwise)."""
    if a[:4] != b[:4] or len(a[5]) != len(b[5]) or (a[4] is None) != (b[4] is None) or \
            (a[4] is not None and abs(a[4] - b[4]) > 1e-4):
        return False
    return all([ok for ok, _ in x] == [ok for ok, _ in y] and np.allclose([s for _, s in x], [s for _, s in y],
                                                                           atol=1e-4)
               for x, y in zip(sorted(a[5]), sorted(b[5])))


async def test_a_file_sent_in_parts_teaches_what_it_teaches_whole_across_a_restart(learner_settings: Any,
                                                                                 tmp_path: Path) -> None:
    # edgecache warmup sends a large file in parts (a group whole in each). Every line meets every other at lookup
    # time, so each part is taught against the lines sent before it, and an earlier line a later one came nearer to
    # is taught again: a class's wrong labels come from every group of the file, not from the few sent with it.
    rows = faq()
    groups = list(dict.fromkeys(row["group"] for row in rows))
    whole = learner_settings(data_dir=str(tmp_path / "whole"))
    async with serve_in_process(create_app(whole, engine=FakeEngine())) as c:
        assert (await warm(c, rows)).status_code == 200
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        expected = _taught_labels(rt.learner, "default", "default")
        expected_state = rt.learner.taught_state("default", "default", 0.005)
    parts = learner_settings(data_dir=str(tmp_path / "parts"))
    async with serve_in_process(create_app(parts, engine=FakeEngine())) as c:
        for group in groups[:len(groups) // 2]:  # one group a send: alone, a send teaches no wrong answer at all
            assert (await warm(c, [row for row in rows if row["group"] == group])).status_code == 200
    async with serve_in_process(create_app(parts, engine=FakeEngine())) as c:  # restarted: the rest in one send
        assert (await warm(c, [row for row in rows if row["group"] in groups[len(groups) // 2:]])).status_code == 200
        rt = c.app.state.runtime  # type: ignore[attr-defined]
    assert expected_state is not None and expected_state.line is not None
    assert _same_teaching(_taught_labels(rt.learner, "default", "default"), expected)
    state = rt.learner.taught_state("default", "default", 0.005)
    assert (state.groups, state.separated) == (expected_state.groups, expected_state.separated)
    assert state.line == pytest.approx(expected_state.line, abs=1e-4)


def test_grouped_lines_added_in_parts_teach_each_variant_what_the_whole_teaches() -> None:
    rng = np.random.default_rng(7)
    centres = rng.normal(size=(12, 16))
    groups = [f"g{n % 12}" for n in range(120)]
    vectors = centres[[n % 12 for n in range(120)]] + rng.normal(scale=0.9, size=(120, 16))
    vectors = (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)
    keys = [f"k{n}" for n in range(120)]
    order = sorted(range(120), key=lambda n: groups[n])  # a file grouped by group, cut into sends of whole groups
    whole = group_labels([keys[n] for n in order], [groups[n] for n in order], vectors[order])
    one = SemanticLearner()
    one.teach("t", "s", whole.classes, whole.labels, variants=whole.variants)
    lines, parts = GroupedLines(), SemanticLearner()
    latest: dict[str, list[tuple[str, float, bool, bool]]] = {}
    vector_of = dict(zip(keys, vectors))
    for start in range(0, 120, 30):
        part = order[start:start + 30]
        taught = lines.add([keys[n] for n in part], [groups[n] for n in part], vector_of)
        assert {v for v in taught.variants} >= {keys[n] for n in part}  # every new line, and earlier ones it moved
        parts.teach("t", "s", taught.classes, taught.labels, variants=taught.variants)
        by_variant: dict[str, list[tuple[str, float, bool, bool]]] = {}
        for variant, label in zip(taught.variants, taught.labels):
            by_variant.setdefault(variant, []).append(label)
        latest.update(by_variant)
    assert sorted(label for labels in latest.values() for label in labels) == sorted(whole.labels)
    # An earlier line the index no longer holds (expired): every line left is worked out again, as if taught whole.
    gone = keys[order[0]]
    again = lines.add([], [], {key: v for key, v in vector_of.items() if key != gone})
    left = [n for n in order if keys[n] != gone]
    rounded = lambda labels: sorted((key, round(s, 5), ok, lookup) for key, s, ok, lookup in labels)  # noqa: E731
    assert rounded(again.labels) == rounded(group_labels([keys[n] for n in left], [groups[n] for n in left],
                                                         vectors[left]).labels)
    assert _same_teaching(_taught_labels(parts, "t", "s"), _taught_labels(one, "t", "s"))
    # Taught without naming its variants, each part teaches only what its own lines see of each other.
    apart = SemanticLearner()
    for start in range(0, 120, 30):
        part = order[start:start + 30]
        alone = group_labels([keys[n] for n in part], [groups[n] for n in part], vectors[part])
        apart.teach("t", "s", alone.classes, alone.labels)
    assert not _same_teaching(_taught_labels(apart, "t", "s"), _taught_labels(one, "t", "s"))


async def test_what_a_namespace_taught_goes_when_the_tenants_bound_drops_its_index(make_settings: Any,
                                                                                  tmp_path: Path) -> None:
    # Each system prompt is an index of its own; a plan bounds how many a tenant holds. The grouped lines a dropped
    # index was taught (kept to teach the next part of its file against) go with it; the other tenant's stay.
    path = tmp_path / "tenants.toml"
    path.write_text('[plans.one]\nsemantic_max_indexes = 1\n[plans.roomy]\n'
                    '[[tenants]]\nid = "acme"\nplan = "one"\nkeys = ["sk-acme-00000001"]\n'
                    '[[tenants]]\nid = "beta"\nplan = "roomy"\nkeys = ["sk-beta-00000001"]\n'
                    '[admin]\nkeys = ["sk-admin-0001"]\n')
    settings = make_settings(tenants_file=str(path), semantic__enabled=True)
    admin = {"Authorization": "Bearer sk-admin-0001"}
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        for tenant in ("acme", "beta"):
            resp = await c.post("/admin/warmup", headers=admin, json={"tenant": tenant, "lines": numbered(faq())})
            assert resp.status_code == 200, resp.text
        taught = {key[0] for key in rt.semantic._grouped}
        assert taught == {"acme", "beta"}
        for tenant, key in (("acme", "sk-acme-00000001"), ("beta", "sk-beta-00000001")):
            resp = await c.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=chat_body(
                "Where is my card?", messages=[{"role": "system", "content": "You are another assistant."},
                                               {"role": "user", "content": "Where is my card?"}]))
            assert resp.status_code == 200, resp.text
        await settled(c)
        assert {key[0] for key in rt.semantic._grouped} == {"beta"}
        sizes = await rt.semantic.sizes()
        assert sizes[("acme", "default")] == 1  # only the new prompt's index: the taught one was dropped whole
        assert sizes[("beta", "default")] == len(faq()) + 1
