"""The online learner of semantic decisions (edgecache/semantic/learner.py): pure, seeded, no clock."""

from __future__ import annotations

import math
import random

from edgecache.semantic.learner import SemanticLearner

TARGET = 0.01


def _far_lookups(learner: SemanticLearner, n: int, *, tenant: str = "t", scenario: str = "s") -> None:
    """Lookups whose nearest candidate is far and wrong (a miss, labelled for free): the pool's usual traffic."""
    for i in range(n):
        d = learner.decide(tenant, scenario, f"far{i}", 0.3, TARGET)
        assert d.action == "miss"
        learner.record(tenant, scenario, f"far{i}", 0.3, False)


def _confident_pool(learner: SemanticLearner, *, tenant: str = "t", scenario: str = "s") -> None:
    """A pool that has seen many right answers at 0.95 (from other entries) and many far wrong ones."""
    for i in range(300):
        learner.decide(tenant, scenario, f"far{i}", 0.3, TARGET)
        learner.record(tenant, scenario, f"far{i}", 0.3, False)
        if i % 3 == 0:
            learner.record(tenant, scenario, f"near{i}", 0.95, True)


def test_an_unsure_candidate_is_explored_not_served() -> None:
    # A fixed margin: after 50 lookups z deviations of one coin-toss serve would already spend the budget.
    learner = SemanticLearner(prior_cut=0.9, z=None)
    _far_lookups(learner, 50)
    d = learner.decide("t", "s", "new", 0.95, TARGET)
    # Above the static prior cut, so the point estimate would serve, but no label backs it: compute fresh.
    assert d.error <= d.cut < d.bound
    assert d.action == "explore" and d.reason == "unsure"


def test_a_new_entry_in_a_confident_pool_is_served_without_exploring() -> None:
    learner = SemanticLearner(prior_cut=0.9, audit_share=0.0)
    _confident_pool(learner)
    d = learner.decide("t", "s", "brand-new", 0.95, TARGET)
    assert d.action == "serve" and d.reason == "confident"


def test_a_far_candidate_is_a_miss() -> None:
    learner = SemanticLearner(prior_cut=0.9)
    _confident_pool(learner)
    d = learner.decide("t", "s", "x", 0.3, TARGET)
    assert d.action == "miss" and d.reason == "above_cut"


def test_an_entry_with_wrong_labels_stops_being_served() -> None:
    learner = SemanticLearner(prior_cut=0.9, audit_share=0.0, demote_after=2)
    _confident_pool(learner)
    assert learner.decide("t", "s", "bad", 0.96, TARGET).action == "serve"
    learner.record("t", "s", "bad", 0.96, False)
    learner.record("t", "s", "bad", 0.97, False)
    assert learner.is_demoted("t", "s", "bad")
    for s in (0.96, 0.99, 1.0):
        d = learner.decide("t", "s", "bad", s, TARGET)
        assert d.action == "miss" and d.reason == "demoted"
    # Other entries of the pool are still served; forgetting the entry lifts the demotion.
    assert learner.decide("t", "s", "good", 0.96, TARGET).action == "serve"
    learner.forget("t", "s", "bad")
    assert not learner.is_demoted("t", "s", "bad")


def test_one_wrong_label_already_lowers_what_the_entry_is_trusted_with() -> None:
    learner = SemanticLearner(prior_cut=0.9, audit_share=0.0, demote_after=99)
    _confident_pool(learner)
    before = learner.decide("t", "s", "e", 0.95, TARGET)
    learner.record("t", "s", "e", 0.97, False)
    after = learner.decide("t", "s", "e", 0.95, TARGET)
    assert before.action == "serve"
    assert after.error > before.error


def test_labels_of_one_tenant_do_not_move_another_tenants_decisions() -> None:
    learner = SemanticLearner(prior_cut=0.9, audit_share=0.0)
    _confident_pool(learner, tenant="a")
    _confident_pool(learner, tenant="b")
    learner.record("a", "s", "shared-key", 0.96, False)
    learner.record("a", "s", "shared-key", 0.96, False)
    assert learner.is_demoted("a", "s", "shared-key")
    assert not learner.is_demoted("b", "s", "shared-key")
    assert learner.decide("b", "s", "shared-key", 0.96, TARGET).action == "serve"


def test_exploration_stays_within_its_budget() -> None:
    learner = SemanticLearner(prior_cut=0.9, explore_share=0.1, explore_allowance=5)
    rng = random.Random(1)
    explored = 0
    for i in range(2000):
        s = rng.uniform(0.5, 1.0)
        d = learner.decide("t", "s", f"e{i}", s, TARGET)  # every entry new: unsure wherever it would serve
        explored += d.action == "explore"
        assert explored <= 0.1 * (i + 1) + 5
        if d.action != "serve":
            learner.record("t", "s", f"e{i}", s, s >= 0.8)
    assert explored > 0


def test_switched_off_exploration_never_explores() -> None:
    off, on = SemanticLearner(prior_cut=0.9, audit_share=0.5), SemanticLearner(prior_cut=0.9, audit_share=0.5)
    for learner in (off, on):
        _far_lookups(learner, 200)
    actions_off = [off.decide("t", "s", f"n{i}", 0.95, TARGET, may_explore=False).action for i in range(20)]
    actions_on = [on.decide("t", "s", f"n{i}", 0.95, TARGET).action for i in range(20)]
    assert "explore" not in actions_off
    # Unsure without exploration: decided on the point estimate (served), so shedding load saves engine time.
    assert actions_off[0] == "serve"
    # The same lookups with exploration allowed are explored: the switch is what made the difference.
    assert actions_on[0] == "explore"


def test_memory_per_entry_and_entries_are_bounded() -> None:
    learner = SemanticLearner(entry_labels=8, max_entries=10)
    for i in range(100):
        learner.record("t", "s", "one", 0.9, i % 2 == 0)
    assert len(learner.entry_labels_of("t", "s", "one")) == 8
    for i in range(50):
        learner.record("t", "s", f"e{i}", 0.9, True)
    assert learner.entries == 10
    assert learner.entry_labels_of("t", "s", "e0") == []  # least recently used went first


def _stream(seed: int, correct_of, n: int = 4000, entries: int = 300) -> tuple[float, float, float]:
    """Lookups at uniform similarities in [0.5, 1]; returns (hit rate, false-hit rate, exploration share)."""
    rng = random.Random(seed)
    learner = SemanticLearner(prior_cut=0.9, seed=seed)
    hits = false_hits = explored = 0
    for _ in range(n):
        s = rng.uniform(0.5, 1.0)
        entry = f"e{rng.randrange(entries)}"
        ok = correct_of(s, rng)
        d = learner.decide("t", "s", entry, s, TARGET)
        if d.action == "serve":
            hits += ok
            false_hits += not ok
            continue
        explored += d.action == "explore"
        learner.record("t", "s", entry, s, ok)
    return hits / n, false_hits / n, explored / n


def test_a_stream_with_a_known_cut_converges_within_the_target() -> None:
    # Right answers exactly at similarity >= 0.8: the best policy serves 40 % of lookups with no false hit. The
    # static prior (0.9) would serve 20 %; the learner has to find the lower cut from labels.
    for seed in range(3):
        hit_rate, false_hit_rate, explore_share = _stream(seed, lambda s, rng: s >= 0.8)
        assert false_hit_rate <= TARGET
        assert hit_rate >= 0.23
        assert explore_share <= 0.05 + 20 / 4000


def test_a_noisy_stream_stays_within_the_target() -> None:
    # P(right | s) a steep sigmoid around 0.8: serving at any cut costs some false hits; the bound must hold.
    def noisy(s: float, rng: random.Random) -> bool:
        return rng.random() < 1.0 / (1.0 + math.exp(-60.0 * (s - 0.8)))

    for seed in range(3):
        hit_rate, false_hit_rate, _ = _stream(seed, noisy)
        assert false_hit_rate <= TARGET
        assert hit_rate >= 0.2


# ---- the --stream mode of scripts/eval_semantic.py ----


def _eval_semantic():
    from edgecache.bench import semantic_eval

    return semantic_eval


def test_stream_ground_truth_of_pairs(tmp_path) -> None:
    eval_semantic = _eval_semantic()
    data = tmp_path / "pairs.tsv"  # a-b same, b-c same, a-c labelled different, d-e different
    data.write_text("a\tb\t1\nb\tc\t1\na\tc\t0\nd\te\t0\n", encoding="utf-8")
    stream = eval_semantic.stream_of("pairs", data, seed=0, limit=0)
    assert sorted(stream.texts) == ["a", "b", "c", "d", "e"]
    at = {t: i for i, t in enumerate(stream.texts)}

    def right(q: str, c: str) -> bool:
        return eval_semantic.right_answer(stream, at[q], at[c])

    assert right("a", "b") and right("b", "c") and right("c", "b")
    assert not right("a", "c")  # joined through b, but the set labels this very pair different
    assert not right("d", "e") and not right("a", "d")


def test_a_sample_per_intent_cuts_each_intent_to_its_share_and_keeps_every_out_of_scope_text() -> None:
    from collections import Counter

    eval_semantic = _eval_semantic()
    items = [(f"a{i}", "a") for i in range(10)] + [(f"b{i}", "b") for i in range(2)] + [(f"o{i}", "oos")
                                                                                      for i in range(7)]
    sample = eval_semantic.sample_per_intent(items, 4, seed=1)
    assert Counter(intent for _, intent in sample) == {"a": 4, "b": 2, "oos": 7}
    assert set(sample) <= set(items) and len(set(sample)) == len(sample)
    assert sample == eval_semantic.sample_per_intent(items, 4, seed=1)  # a seed names one sample
    assert any(eval_semantic.sample_per_intent(items, 4, seed=k) != sample for k in range(2, 6))


def test_the_stream_eval_prints_the_keys(tmp_path, capsys) -> None:
    import json

    eval_semantic = _eval_semantic()
    data = tmp_path / "intents.jsonl"
    rows = [("how do I reset my password", "reset"), ("reset my password please", "reset"),
            ("I forgot my password", "reset"), ("what is my balance", "balance"), ("show my balance", "balance"),
            ("how much money do I have", "balance"), ("play some jazz music", "oos")]
    data.write_text("".join(json.dumps({"text": t, "intent": i}) + "\n" for t, i in rows), encoding="utf-8")
    vectors = tmp_path / "vectors"
    result = eval_semantic.main(["--stream", "--intents", str(data), "--scenario", "support", "--oracle-step", "0.05",
                                 "--embed-cache", str(vectors), "--verifier-oracle"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == result
    assert len(list(vectors.glob("*.npy"))) == 1  # the texts' vectors, kept for the next run
    again = eval_semantic.main(["--stream", "--intents", str(data), "--scenario", "support", "--oracle-step",
                                "0.05", "--embed-cache", str(vectors), "--verifier-oracle"])
    assert {k: v for k, v in again.items() if k != "_pair"} == result and len(list(vectors.glob("*.npy"))) == 1
    for key in ("hit_rate", "false_hit_rate", "explorations", "oracle_hit_rate", "static_hit_rate"):
        assert key in last
    assert last["n"] == len(rows)
    assert 0.0 <= last["false_hit_rate"] <= 1.0 and last["explorations"] >= 0
    # day one's ceiling (the best cut on the verifier's score within 1 %), asked for, is reported
    assert 0.0 <= last["verifier_oracle_hit_rate_at_1pct"] <= 1.0


def test_the_best_cut_serves_most_within_the_rate_and_the_lowest_cut_on_a_tie() -> None:
    eval_semantic = _eval_semantic()
    run = eval_semantic.StreamResult

    sweep = [(0.5, run(lookups=100, hits=30, false_hits=3)), (0.6, run(lookups=100, hits=20, false_hits=1)),
             (0.7, run(lookups=100, hits=20, false_hits=0)), (0.8, run(lookups=100, hits=10, false_hits=0))]
    assert eval_semantic.best_cut(sweep, 0.01)[:2] == (0.2, 0.6)  # 0.5 serves more but 3 % wrong
    assert eval_semantic.best_cut(sweep, 0.0)[:2] == (0.2, 0.7)
    assert eval_semantic.best_cut(sweep, 0.05)[:2] == (0.3, 0.5)
    assert eval_semantic.best_cut(sweep[:1], 0.01) == (0.0, 1.0, None)


def test_a_linked_entry_shares_its_class_labels() -> None:
    learner = SemanticLearner(prior_cut=0.9, audit_share=0.0, demote_after=99)
    _confident_pool(learner)
    for s in (0.95, 0.96, 0.97):
        learner.record("t", "s", "class", s, False)
    learner.link("t", "s", "member", "class")
    linked = learner.decide("t", "s", "member", 0.95, TARGET)
    alone = learner.decide("t", "s", "stranger", 0.95, TARGET)
    assert linked.error > alone.error
    assert learner.entry_labels_of("t", "s", "member") == learner.entry_labels_of("t", "s", "class")


def test_one_right_label_does_not_lower_a_class_error_but_several_do() -> None:
    learner = SemanticLearner(prior_cut=0.9, audit_share=0.0, trust_after=2)
    _far_lookups(learner, 100)
    for i in range(20):
        learner.record("t", "s", f"other{i}", 0.85, i % 2 == 0)  # the pool: a coin toss at 0.85
    learner.record("t", "s", "once", 0.85, True)
    # (Each label also moves the pooled curve; compare with an entry without labels at the same moment.)
    assert learner.decide("t", "s", "once", 0.85, TARGET).error >= learner.decide(
        "t", "s", "stranger", 0.85, TARGET).error
    for _ in range(3):
        learner.record("t", "s", "often", 0.85, True)
    assert learner.decide("t", "s", "often", 0.85, TARGET).error < learner.decide(
        "t", "s", "stranger", 0.85, TARGET).error


# ---- the calibrated prior, the shrinking margin, the per-class slope ----


def test_untaught_the_calibrated_prior_serves_where_it_is_confident_within_the_target() -> None:
    # The verifier's probability as the prior: a candidate it calls right 9999 times in 10000 serves with no label
    # at all; one it calls right 9 times in 10 serves only as far as its expected wrong answers fit in the target
    # (a few, among many lookups). The flat prior on a cosine (0.2 wrong over the cut) only as few.
    calibrated = SemanticLearner(signal="probability", audit_share=0.0)
    flat = SemanticLearner(prior_cut=0.9, audit_share=0.0)
    sure = [calibrated.decide("t", "s", f"a{i}", 0.9999, TARGET, may_explore=False).action for i in range(200)]
    assert sure.count("serve") >= 190
    unsure = [calibrated.decide("t", "s2", f"b{i}", 0.9, TARGET, may_explore=False).action for i in range(200)]
    assert unsure.count("serve") * 0.1 <= TARGET * 200 * 0.5
    cosine = [flat.decide("t", "s", f"a{i}", 0.9999, TARGET, may_explore=False).action for i in range(200)]
    assert cosine.count("serve") * 0.2 <= TARGET * 200 * 0.5


def test_labels_move_the_calibrated_prior_per_pool() -> None:
    # Wrong labels at a probability the prior trusts: that pool's estimate there follows them; another pool's
    # (tenant's) stays the prior's.
    learner = SemanticLearner(signal="probability", audit_share=0.0, demote_after=10**6)
    for i in range(50):
        learner.decide("u", "s", f"w{i}", 0.9999, TARGET)  # the other pool has some lookups to spend on
    for i in range(400):
        learner.record("t", "s", f"y{i}", 0.9999, i % 4 != 0)  # wrong one time in four
    taught = learner.decide("t", "s", "z", 0.9999, TARGET, may_explore=False)
    other = learner.decide("u", "s", "z", 0.9999, TARGET, may_explore=False)
    assert 0.15 <= taught.error <= 0.35 and other.error <= 1e-3 and other.action == "serve"


def test_a_margin_of_z_deviations_shrinks_as_lookups_accumulate() -> None:
    # Every lookup's candidate is wrong with probability ~0.0028, the target is 0.005 of the lookups. A fixed margin
    # keeps half the target back for good: it serves at most 0.0025 / 0.0028 of the lookups. z deviations of the
    # served errors keep back less and less of it (the deviation grows as the square root of their number): it
    # serves a growing share, past the fixed margin's, and its expected wrong answers with their z deviations stay
    # within the target.
    fixed = SemanticLearner(signal="probability", audit_share=0.0, margin=0.5, z=None)
    shrinking = SemanticLearner(signal="probability", audit_share=0.0, z=1.645)
    n, late = 6000, 1000
    served = {"fixed": [0, 0], "z": [0, 0]}  # [early, late]
    for i in range(n):
        for name, learner in (("fixed", fixed), ("z", shrinking)):
            d = learner.decide("t", "s", f"a{i}", 0.997, 0.005, may_explore=False)
            if d.action == "serve" and (i < late or i >= n - late):
                served[name][i >= n - late] += 1
    error = fixed.decide("t", "s", "b", 0.997, 0.005, may_explore=False).error
    assert served["fixed"][1] <= late * 0.0025 / error + 1
    assert served["z"][0] < served["z"][1] and served["z"][1] > served["fixed"][1] + 50
    rate, upper, _ = shrinking.estimate("t", "s")
    assert rate + 1.645 * (upper - rate) <= 0.005 + 1e-9  # estimate's bound is one deviation (confidence 1)


def test_a_class_with_labels_of_both_outcomes_gets_its_own_slope() -> None:
    # A class right at 0.95 and up, wrong at 0.80-0.84: with a slope of its own it serves high and refuses low
    # more sharply than one shift of the pooled curve can say.
    def taught(slope_after: int | None) -> SemanticLearner:
        learner = SemanticLearner(prior_cut=0.9, audit_share=0.0, slope_after=slope_after, demote_after=10**6)
        for i in range(8):
            learner.record("t", "s", "e", 0.95 + i * 0.005, True)
            learner.record("t", "s", "e", 0.80 + i * 0.005, False)
        return learner

    plain, sloped = taught(None), taught(2)
    high = [learner.decide("t", "s", "e", 0.97, TARGET, may_explore=False).error for learner in (plain, sloped)]
    low = [learner.decide("t", "s", "e", 0.82, TARGET, may_explore=False).error for learner in (plain, sloped)]
    assert high[1] < high[0] and low[1] > low[0]
    # Under slope_after labels of either outcome, no slope: the same estimate as the plain class shift.
    few = SemanticLearner(prior_cut=0.9, audit_share=0.0, slope_after=6)
    one = SemanticLearner(prior_cut=0.9, audit_share=0.0, slope_after=None)
    for learner in (few, one):
        for i in range(5):
            learner.record("t", "s", "e", 0.95, True)
            learner.record("t", "s", "e", 0.80, False)
    assert few.decide("t", "s", "e", 0.9, TARGET).error == one.decide("t", "s", "e", 0.9, TARGET).error


def test_a_pool_taught_on_another_signal_starts_again() -> None:
    learner = SemanticLearner(prior_cut=0.9)
    learner.record("t", "s", "e", 0.95, True)
    assert learner.entry_labels_of("t", "s", "e") == [(0.95, True)]
    learner.decide("t", "s", "e", 0.99, TARGET, signal="probability")
    assert learner.entry_labels_of("t", "s", "e") == []


def test_one_tenants_entries_never_push_out_anothers() -> None:
    """acme's traffic fills the learner's entries; beta's, within its share, stay: acme's own oldest go instead."""
    learner = SemanticLearner(entry_labels=4, max_entries=10)
    for i in range(3):
        learner.record("beta", "s", f"b{i}", 0.9, True)
    for i in range(100):
        learner.record("acme", "s", f"a{i}", 0.9, True)
    assert learner.entries == 10 and learner.entries_of("beta") == 3 and learner.entries_of("acme") == 7
    assert all(learner.entry_labels_of("beta", "s", f"b{i}") for i in range(3))
    assert learner.entry_labels_of("acme", "s", "a92") == [] and learner.entry_labels_of("acme", "s", "a99")
    learner.drop("acme")
    assert learner.entries == 3 and learner.entries_of("acme") == 0
