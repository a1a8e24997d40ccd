"""`scripts/eval_semantic.py --stream --log DIR`: the online learner's run written as a decision log (the records the
server writes), which `edgecache tune` reads; on a synthetic stream with a known truth, the cut tune recovers from
the log lands on the cut that truth implies."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from edgecache.cli.main import app as cli
from edgecache.semantic.decision_log import DecisionLog, DecisionRecord, LabelRecord, read_records
from edgecache.semantic.tuning import ALL, tune
from edgecache.bench import semantic_eval as eval_semantic


def test_a_stream_run_writes_a_decision_log_that_tune_reads(tmp_path: Path, capsys) -> None:
    data = tmp_path / "intents.jsonl"
    rows = [("how do I reset my password", "reset"), ("reset my password please", "reset"),
            ("I forgot my password", "reset"), ("what is my balance", "balance"), ("show my balance", "balance"),
            ("how much money do I have", "balance"), ("play some jazz music", "oos")]
    data.write_text("".join(json.dumps({"text": t, "intent": i}) + "\n" for t, i in rows), encoding="utf-8")
    logs = tmp_path / "decisions"
    result = eval_semantic.main(["--stream", "--intents", str(data), "--scenario", "support", "--oracle-step",
                                 "0.05", "--log", str(logs), "--embed-cache", "none", "--day-one-prior", str(data)])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == result
    # The untaught learner also ran with a prior fitted on the file's own truth, and the outcomes carry estimates.
    assert "day-one prior P(wrong)" in out and result["day_one_hit_rate"] is not None
    assert set(result["estimated"]) == set(result["outcomes"])
    assert result["log"] == str(logs) and set(result["tune"]) == set(eval_semantic.TUNE_VARIANTS)
    records = list(read_records(logs))
    decisions = {r.id: r for r in records if isinstance(r, DecisionRecord)}
    labels = {r.id: r for r in records if isinstance(r, LabelRecord)}
    assert len(decisions) == len(rows) and all(d.tenant == "eval" and d.scenario == "support"
                                               for d in decisions.values())
    first, *rest = sorted(decisions.values(), key=lambda d: int(d.id.rsplit("-", 1)[1]))
    assert first.decision == "miss" and first.similarity is None  # the cache was empty
    assert all(d.similarity is not None and d.store_key is not None and d.vector_key is not None for d in rest)
    assert all(d.query is None for d in decisions.values())  # a keyed hash, as for a plan without log_prompts
    # A label for every exploration and refused candidate (what the run revealed), none for a hit.
    assert set(labels) == {i for i, d in decisions.items() if d.decision in ("explore", "refused")}
    assert result["labels"] == len(labels)
    out = CliRunner().invoke(cli, ["tune", str(logs), "--per", "lookup", "--confidence", "0"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert f"{len(rows)}" in out.output and "support" in out.output
    # A second run into the same folder would mix two runs' decisions: refused.
    again = CliRunner().invoke(cli, ["tune", str(logs)])
    assert again.exit_code == 0
    try:
        eval_semantic.main(["--stream", "--intents", str(data), "--scenario", "support", "--log", str(logs),
                            "--embed-cache", "none"])
    except SystemExit as exc:
        assert "already holds a decision log" in str(exc)
    else:
        raise AssertionError("a second run into a used log folder was not refused")


def synthetic_stream(n: int, seed: int) -> tuple[eval_semantic.Stream, np.ndarray]:
    """Texts in groups of 5 that answer each other: a candidate of the same group at cosine 0.82-0.98, any other at
    0.2-0.78, so the truth is a cut at 0.8 (right iff the nearest candidate is at least that similar)."""
    rng = np.random.default_rng(seed)
    group = rng.permutation(np.arange(n) // 5).tolist()
    sim = rng.uniform(0.2, 0.78, (n, n)).astype(np.float32)
    same = np.equal.outer(group, group)
    sim[same] = rng.uniform(0.82, 0.98, int(same.sum()))
    sim = np.triu(sim) + np.triu(sim, 1).T
    return eval_semantic.Stream([f"text {i}" for i in range(n)], group, set(), "synthetic"), sim


def test_tune_recovers_the_cut_a_synthetic_truth_implies_from_a_learner_log(tmp_path: Path) -> None:
    stream, sim = synthetic_stream(1500, seed=0)
    log = DecisionLog(tmp_path, max_bytes=64 << 20, flush_interval_s=0.05)
    result, _ = eval_semantic.learner_stream(stream, sim, scenario="support", target=0.01, shipped=0.85, seed=0,
                                             log=log)
    log.close()
    assert result.hits > 100 and result.false_hit_rate <= 0.01
    assert all((s >= 0.8) == right for s, right in result.candidates)  # the truth is the cut at 0.8
    # Every lookup labelled, with hindsight: the lowest cut whose wrong candidates stay within 1 % of the lookups.
    implied = eval_semantic.hindsight_cut(result.candidates, result.lookups, 0.01)
    assert implied is not None and 0.75 <= implied <= 0.82
    records = list(read_records(tmp_path))
    hits = [r for r in records if isinstance(r, DecisionRecord) and r.decision == "hit"]
    assert len(hits) == result.hits  # served lookups stay unlabelled; tune weighs the audits up for them
    [found] = [c for c in tune(records, target=0.01, confidence=0, per="lookup") if c.tenant == ALL]
    assert found.cut is not None and abs(found.cut - implied) <= 0.01, (found, implied)
    assert found.unlabelled == 0 and found.effective < found.backing  # audits weighed up for the hits
    # Per served (the default): wrong candidates within 1 % of those at or above the cut, with hindsight.
    bad, implied_served = 0, None
    for n, (similarity, right) in enumerate(sorted(result.candidates, reverse=True), 1):
        bad += not right
        if bad <= 0.01 * n:
            implied_served = similarity
    [served] = [c for c in tune(records, target=0.01, confidence=0) if c.tenant == ALL]
    assert served.cut is not None and implied_served is not None and abs(served.cut - implied_served) <= 0.01, \
        (served, implied_served)


def confusable_stream(n: int, seed: int) -> tuple[eval_semantic.Stream, np.ndarray]:
    """Groups of 5 whose right candidates sit at cosine 0.86-0.99, and a wrong candidate near at 0.86-0.97 for a
    third of the texts (customer-service traffic: questions that differ in one word the answer depends on)."""
    rng = np.random.default_rng(seed)
    group = rng.permutation(np.arange(n) // 5).tolist()
    sim = rng.uniform(0.2, 0.7, (n, n)).astype(np.float32)
    same = np.equal.outer(group, group)
    sim[same] = rng.uniform(0.86, 0.99, int(same.sum()))
    confusable = rng.random(n) < 1 / 3
    for i in np.flatnonzero(confusable):
        others = np.flatnonzero(~same[i])
        sim[i, rng.choice(others, 3, replace=False)] = rng.uniform(0.86, 0.97, 3)
    sim = np.maximum(sim, sim.T)
    return eval_semantic.Stream([f"text {i}" for i in range(n)], group, set(), "confusable"), sim


def test_the_default_profiles_decision_holds_its_target_where_its_threshold_does_not() -> None:
    from edgecache.semantic.assembly import learner_for
    from edgecache.semantic.embedders import DEFAULT_THRESHOLDS
    from edgecache.settings import resolve_settings

    settings = resolve_settings("cpu", {}, environ={})
    assert settings.semantic.decision == "learner"
    scenario = "support"
    target = settings.scenarios[scenario].target_false_hit_rate
    threshold = DEFAULT_THRESHOLDS["use-multilingual-v3-0.2.1"][scenario]
    stream, sim = confusable_stream(2000, seed=1)
    static = eval_semantic.run_stream(stream, sim, lambda i, j, s: "serve" if s >= threshold else "miss")
    assert static.false_hit_rate > 5 * target  # the threshold serves wrong answers here
    learner = learner_for(settings)
    assert learner is not None
    learned, _ = eval_semantic.learner_stream(stream, sim, scenario=scenario, target=target, shipped=threshold,
                                              learner=learner)
    assert learned.false_hit_rate <= target and learned.hits > 0.25 * static.hits


def test_the_storage_rule_stores_a_refused_lookup_only_when_its_candidate_was_wrong() -> None:
    stream, sim = synthetic_stream(600, seed=2)
    every, _ = eval_semantic.learner_stream(stream, sim, scenario="support", target=0.01, shipped=0.85, seed=0)
    lean, _ = eval_semantic.learner_stream(stream, sim, scenario="support", target=0.01, shipped=0.85, seed=0,
                                           store="on_wrong")
    assert every.stored == every.lookups - every.hits - every.false_hits
    right_refusals = sum(right for right, _ in lean.outcomes.values()) - lean.outcomes.get("hit", [0, 0])[0]
    assert lean.stored == lean.lookups - lean.hits - lean.false_hits - right_refusals
    assert lean.stored < every.stored


def test_the_ratio_to_the_oracle_comes_with_a_bootstrap_interval() -> None:
    rng = np.random.default_rng(0)
    pairs = []
    for _ in range(5):
        oracle = (rng.random(2000) < 0.2).astype(float)
        learner = oracle * (rng.random(2000) < 0.5)  # half the oracle's hits
        pairs.append((learner, oracle))
    ratio, lo, hi = eval_semantic.bootstrap_ratio(pairs, resamples=500)
    assert ratio is not None and lo is not None and hi is not None
    assert lo < ratio < hi and 0.45 < lo and hi < 0.55
    assert eval_semantic.bootstrap_ratio([(np.zeros(10), np.zeros(10))]) == (None, None, None)


def test_the_learners_own_estimates_ranked_with_hindsight() -> None:
    # Four lookups: the lowest estimates first, until the wrong ones would pass the rate's share of the lookups.
    result = eval_semantic.StreamResult(lookups=100, candidates=[(0.9, True), (0.8, False), (0.95, True), (0.7, True)],
                                        errors=[0.01, 0.02, 0.005, 0.5])
    assert result.ranked_hit_rate(0.0) == 0.02  # the two right ones under the first wrong one
    assert result.ranked_hit_rate(0.01) == 0.03  # one wrong answer allowed in 100 lookups: all three right ones
    assert eval_semantic.StreamResult(lookups=10).ranked_hit_rate(0.01) == 0.0


def test_a_prior_fitted_on_sets_serves_the_untaught_learner_only_where_it_holds() -> None:
    from edgecache.semantic.learner import upper_curve

    stream, sim = synthetic_stream(1500, seed=3)  # the truth: right iff the nearest candidate is at 0.8 or more
    seen = eval_semantic.run_stream(stream, sim, lambda i, j, s: "miss")
    sims = np.array([s for s, _ in seen.candidates])
    wrong = np.array([not ok for _, ok in seen.candidates])
    prior = upper_curve(sims, wrong)
    assert (prior[82:98] < 0.05).all() and (prior[:78][np.bincount((sims * 100).astype(int), minlength=100)[:78] > 0]
                                             > 0.9).all()
    assert (prior[:20] == 1.0).all()  # no candidate under 0.2: nothing is known there
    assert prior[99] == prior[int(sims.max() * 100)]  # none at 0.99 either: the bound of the highest bin with one
    flat, _ = eval_semantic.learner_stream(stream, sim, scenario="support", target=0.01, shipped=0.85, labels=False)
    fitted, _ = eval_semantic.learner_stream(stream, sim, scenario="support", target=0.01, shipped=0.85, labels=False,
                                             prior_curve=prior)
    assert flat.hits == 0 and fitted.hits > 100 and fitted.false_hit_rate <= 0.01
    # A prior fitted where the same cosines were wrong holds the untaught learner back on this stream.
    wrong_everywhere = upper_curve(sims, np.ones_like(wrong))
    held, _ = eval_semantic.learner_stream(stream, sim, scenario="support", target=0.01, shipped=0.85, labels=False,
                                           prior_curve=np.maximum(prior, wrong_everywhere))
    assert held.hits == 0
