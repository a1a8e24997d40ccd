"""The online learner in the server (``semantic.decision = "learner"``): an explored request gets the engine's fresh
answer, never the cached one; its label (temperature 0: equality) reaches the learner; labels showing an entry
serves wrong answers stop it being served; no exploration while the engine sheds load. The real embedder and index,
in-process with scripted engines; the learner's own logic is tested in test_semantic_learner.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from edgecache.http.app import create_app
from edgecache.semantic.decision_log import DecisionRecord, read_records
from edgecache.semantic.lookup import MatchRule, Probe
from edgecache.semantic.cache import SemanticCache
from edgecache.semantic.index import SemanticIndex
from edgecache.semantic.learner import SemanticLearner
from tests.conftest import chat_body, serve_in_process
from tests.fakes import FakeEngine
from tests.test_decision_log import settled

ORIGINAL = "How do I reset my password?"
PARAPHRASE = "How can I reset my password?"


def teach_confidence(learner: SemanticLearner, tenant: str, scenario: str) -> None:
    """Right labels at every similarity from 0.5 up, enough that the pool would serve any candidate there. The
    ledger keeps a fixed margin: with z deviations (the default) a pool of a handful of lookups cannot afford even a
    1e-4 error at 0.5 %, and these tests are about the server's paths, not the margin (test_semantic_learner.py)."""
    learner.z = None
    for i in range(10_000):
        learner.record(tenant, scenario, f"taught-{i % 50}", 0.5 + (i % 50) / 100, True)


class ScriptedEngine(FakeEngine):
    """Answers from a list, one per engine call, whatever the prompt."""

    def __init__(self, answers: list[str]) -> None:
        super().__init__()
        self.answers = answers

    def answer_for(self, request: Any) -> str:
        return self.answers[min(self.calls, len(self.answers)) - 1]


async def ask(c: Any, text: str) -> tuple[str, str]:
    resp = await c.post("/v1/chat/completions", json=chat_body(text))
    assert resp.status_code == 200, resp.text
    await settled(c)
    return resp.headers["x-edgecache"], resp.json()["choices"][0]["message"]["content"]


async def test_a_confident_learner_serves_and_an_explored_request_gets_the_fresh_answer(make_settings: Any) -> None:
    settings = make_settings(semantic__enabled=True, semantic__decision="learner")
    engine = FakeEngine()
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        assert rt.semantic.learner is rt.learner is not None
        # Untaught, the learner's prior (the static threshold's region is wrong 1 time in 5) is far over the
        # default scenario's 0.5 % target: the paraphrase is a miss, decided by the learner.
        assert await ask(c, ORIGINAL) == ("miss", f"answer to: {ORIGINAL}")
        assert (await ask(c, "How could I reset my password?"))[0] == "miss"
        rt.learner.drop()
        teach_confidence(rt.learner, "default", "default")
        served, text = await ask(c, PARAPHRASE)
        assert served == "semantic"
        assert text in (f"answer to: {ORIGINAL}", "answer to: How could I reset my password?")
        # Every confident serve audited: the next paraphrase is explored. Its client gets what the engine computed.
        rt.learner.audit_share = 1.0
        calls = engine.calls
        served, text = await ask(c, "How should I reset my password?")
        assert (served, text) == ("miss", "answer to: How should I reset my password?")
        assert engine.calls == calls + 1
        metrics = (await c.get("/metrics")).text
        assert 'edgecache_semantic_explorations_total{scenario="default",tenant="default"} 1.0' in metrics
        assert 'edgecache_semantic_refusals_total{reason="explore",scenario="default"} 1.0' in metrics
        stats = (await c.get("/stats")).json()
        pool = stats["semantic"]["learner"]["pools"]["default/default"]
        assert pool["explorations"] == 1 and pool["lookups"] == 2  # since the drop
        from edgecache.cli.render import stats_tables

        learned = [t for t in stats_tables(stats) if str(t.title).startswith("Semantic learner")]
        assert len(learned) == 1 and learned[0].row_count == 1
        assert not [t for t in stats_tables(stats, tenant="other") if str(t.title).startswith("Semantic learner")]
        assert 'edgecache_semantic_learner_false_hit_rate{scenario="default",tenant="default"}' in \
            (await c.get("/metrics")).text
        rt.decisions.flush()
    decisions = [r for r in read_records(Path(settings.data_dir) / "decisions") if isinstance(r, DecisionRecord)]
    assert [d.decision for d in decisions] == ["miss", "refused", "hit", "explore"]
    assert decisions[1].reason in ("learner:above_cut", "learner:budget") and decisions[3].reason == "audit"


class ConstantEngine(FakeEngine):
    def answer_for(self, request: Any) -> str:
        return "Open Settings, then Security, then Reset password."


async def test_an_explored_candidate_is_labelled_by_equality_and_the_learner_records_it(make_settings: Any) -> None:
    settings = make_settings(semantic__enabled=True, semantic__decision="learner")
    async with serve_in_process(create_app(settings, engine=ConstantEngine())) as c:
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        teach_confidence(rt.learner, "default", "default")
        rt.learner.audit_share = 1.0
        await ask(c, ORIGINAL)
        assert (await ask(c, PARAPHRASE))[0] == "miss"  # explored
        rt.decisions.flush()
        decisions = [r for r in read_records(Path(settings.data_dir) / "decisions")
                     if isinstance(r, DecisionRecord)]
        explored = decisions[-1]
        assert explored.decision == "explore" and explored.store_key
        # Temperature 0 and the same text: the cached answer served. The learner has the label on the candidate,
        # and the paraphrase's own answer joined the candidate's class (they share labels).
        labels = rt.learner.entry_labels_of("default", "default", explored.store_key)
        assert len(labels) == 1 and labels[0][1] is True
        assert labels[0][0] == pytest.approx(explored.similarity, abs=1e-3)
        linked = [(tenant, scenario, key) for tenant, (scenario, key), _ in rt.learner._entries.items()
                  if not key.startswith("taught-") and key != explored.store_key]
        assert len(linked) == 1 and rt.learner.entry_labels_of(*linked[0]) == labels
        metrics = (await c.get("/metrics")).text
        assert 'edgecache_semantic_labels_total{decision="explore",label="good",scenario="default",' \
               'tenant="default"} 1.0' in metrics


async def test_a_wrong_label_through_the_server_demotes_the_entry(make_settings: Any) -> None:
    settings = make_settings(semantic__enabled=True, semantic__decision="learner")
    engine = ScriptedEngine(["Open Settings, then Security, then Reset password.",
                             "Bananas are yellow fruit, rich in potassium."])
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        teach_confidence(rt.learner, "default", "default")
        rt.learner.audit_share, rt.learner.demote_after = 1.0, 1
        await ask(c, ORIGINAL)
        await ask(c, PARAPHRASE)  # explored; the fresh answer has nothing to do with the cached one
        rt.decisions.flush()
        explored = [r for r in read_records(Path(settings.data_dir) / "decisions")
                    if isinstance(r, DecisionRecord)][-1]
        assert explored.decision == "explore"
        assert rt.learner.is_demoted("default", "default", explored.store_key)
        assert (await c.get("/stats")).json()["semantic"]["learner"]["demoted"] == 1


@pytest.fixture(scope="module")
def embedder() -> Any:
    from edgecache.semantic.embedders import load_embedder

    return load_embedder("use-multilingual")


async def cache_with(embedder: Any, tmp_path: Path, learner: SemanticLearner,
                     may_explore: bool = True) -> SemanticCache:
    index = SemanticIndex(tmp_path / "semantic", dim=embedder.dim, embedder_version=embedder.version)
    sem = SemanticCache(embedder=embedder, index=index, rule_for=lambda t, s: MatchRule(0.01, threshold=0.9),
                        learner=learner, may_explore=lambda: may_explore)
    probe = Probe(text=ORIGINAL, namespace="n")
    await sem.remember("acme", "support", probe, await sem.batcher.embed(ORIGINAL), "original-key")
    return sem


async def test_labels_of_wrong_answers_stop_an_entry_being_served(embedder: Any, tmp_path: Path) -> None:
    learner = SemanticLearner(audit_share=0.0)
    teach_confidence(learner, "acme", "support")
    sem = await cache_with(embedder, tmp_path, learner)
    try:
        probe = Probe(text=PARAPHRASE, namespace="n")
        first = await sem.lookup("acme", "support", probe)
        assert first.hit is not None and first.hit.store_key == "original-key" and first.learned is not None
        # Two explorations of it came out wrong (a refused or explored lookup's label, as MissLabels reports it).
        for _ in range(2):
            sem.learn("acme", "support", first, False, "fresh-key")
        again = await sem.lookup("acme", "support", probe)
        assert again.hit is None and again.refusal == "learner:demoted"
        assert again.candidate is not None and again.candidate.store_key == "original-key"
        # Another tenant's lookups are not the learner's business for acme: its pool is untaught, so a miss.
        other = await sem.lookup("globex", "support", probe)
        assert other.candidate is None  # and it cannot even see acme's vectors
    finally:
        sem.close()


async def test_no_exploration_while_the_engine_sheds_load(embedder: Any, tmp_path: Path) -> None:
    learner = SemanticLearner(audit_share=1.0)
    teach_confidence(learner, "acme", "support")
    sem = await cache_with(embedder, tmp_path, learner, may_explore=False)
    try:
        lookup = await sem.lookup("acme", "support", Probe(text=PARAPHRASE, namespace="n"))
        assert lookup.hit is not None and not lookup.explored  # served on its estimate
        sem.may_explore = lambda: True
        explored = await sem.lookup("acme", "support", Probe(text=PARAPHRASE, namespace="n"))
        assert explored.explored and explored.hit is None and explored.candidate is not None
        # A flush forgets what was learned about the flushed tenant.
        await sem.drop(tenant="acme")
        assert learner.summary() == {}
    finally:
        sem.close()


async def test_a_restart_starts_the_learner_from_the_labels_the_log_kept(make_settings: Any) -> None:
    settings = make_settings(semantic__enabled=True, semantic__decision="learner")
    async with serve_in_process(create_app(settings, engine=ConstantEngine())) as c:
        await ask(c, ORIGINAL)
        assert (await ask(c, PARAPHRASE))[0] == "miss"  # untaught: refused, and labelled from the miss for free
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        rt.decisions.flush()
        refused = [r for r in read_records(Path(settings.data_dir) / "decisions")
                   if isinstance(r, DecisionRecord)][-1]
        assert refused.decision == "refused" and refused.reason.startswith("learner:")
        before = rt.learner.entry_labels_of("default", "default", refused.store_key)
        assert len(before) == 1 and before[0][1] is True
    async with serve_in_process(create_app(settings, engine=ConstantEngine())) as c:
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        after = rt.learner.entry_labels_of("default", "default", refused.store_key)
        assert len(after) == 1 and after[0][1] is True and after[0][0] == pytest.approx(before[0][0], abs=1e-3)
        assert rt.learner.summary()[("default", "default")]["labels"] == 1


def test_labelled_decisions_pair_labels_with_their_decisions_within_a_window(tmp_path: Path) -> None:
    from edgecache.semantic.decision_log import DecisionLog, labelled_decisions

    log = DecisionLog(tmp_path, max_bytes=1 << 20)
    old = log.decided("t", "s", "q0", "refused", reason="learner:budget", store_key="k0", similarity=0.8)
    ids = [log.decided("t", "s", f"q{i}", "refused", reason="below_threshold", store_key=f"k{i}",
                       similarity=0.9) for i in range(1, 4)]
    log.decided("t", "s", "no candidate", "miss")
    log.labelled(ids[2], False, "equality")
    log.labelled(old, True, "equality")  # its decision left the window of 3
    log.labelled(ids[1], True, "equality")
    log.close()
    paired = [(d.id, good) for d, good in labelled_decisions(read_records(tmp_path), window=3)]
    assert paired == [(ids[2], False), (ids[1], True)]


class JudgingEngine(ScriptedEngine):
    """Scripted answers; to the judge's prompt it says ``verdict``."""

    def __init__(self, answers: list[str], verdict: str) -> None:
        super().__init__(answers)
        self.verdict = verdict

    def answer_for(self, request: Any) -> str:
        from edgecache.semantic.judge import JUDGE_INSTRUCTIONS

        if request.messages and request.messages[0].content == JUDGE_INSTRUCTIONS:
            return self.verdict
        return super().answer_for(request)


async def test_with_label_judge_the_served_model_labels_what_equality_cannot(make_settings: Any) -> None:
    settings = make_settings(semantic__enabled=True, semantic__decision="learner", semantic__label_judge=True,
                             semantic__label_judge_min_agreement=0.0)  # no start-up check: the verdict is scripted
    # Close enough that answer embeddings alone would not call it wrong; the judge does.
    engine = JudgingEngine(["Open Settings, then Security, then Reset password.",
                            "Open Settings, then Privacy, then Reset password."], verdict="No")
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        teach_confidence(rt.learner, "default", "default")
        rt.learner.audit_share = 1.0
        await ask(c, ORIGINAL)
        assert (await ask(c, PARAPHRASE))[0] == "miss"  # explored
        judged = [r for r in engine.requests if r.params.max_tokens == 1]
        assert len(judged) == 1 and judged[0].salt == "default"
        rt.decisions.flush()
        explored = [r for r in read_records(Path(settings.data_dir) / "decisions")
                    if isinstance(r, DecisionRecord)][-1]
        labels = rt.learner.entry_labels_of("default", "default", explored.store_key)
        assert explored.decision == "explore" and len(labels) == 1 and labels[0][1] is False


async def test_labels_reach_the_learner_with_the_decision_log_off(make_settings: Any) -> None:
    settings = make_settings(semantic__enabled=True, semantic__decision="learner", semantic__decision_log_bytes=0)
    async with serve_in_process(create_app(settings, engine=ConstantEngine())) as c:
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        assert rt.decisions is None and rt.labels is not None
        await ask(c, ORIGINAL)
        assert (await ask(c, PARAPHRASE))[0] == "miss"  # untaught: refused, labelled from the miss
        assert rt.learner.summary()[("default", "default")]["labels"] == 1
    assert not (Path(settings.data_dir) / "decisions").exists()


async def test_an_answer_the_labelers_cannot_verify_counts_against_its_candidate(make_settings: Any) -> None:
    # Different answers that neither equality nor the answer embeddings can call (cosine between floor and bar):
    # ignoring them would leave the learner only the "right" verdicts of equality.
    settings = make_settings(semantic__enabled=True, semantic__decision="learner")
    engine = ScriptedEngine(["answer #3", "answer #7"])
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        await ask(c, ORIGINAL)
        assert (await ask(c, PARAPHRASE))[0] == "miss"  # untaught: refused, then compared
        rt.decisions.flush()
        records = list(read_records(Path(settings.data_dir) / "decisions"))
        refused = [r for r in records if isinstance(r, DecisionRecord)][-1]
        assert [(r.id, r.good) for r in records if not isinstance(r, DecisionRecord)] == [(refused.id, None)]
        labels = rt.learner.entry_labels_of("default", "default", refused.store_key)
        assert len(labels) == 1 and labels[0][1] is False
        assert rt.labels.unverified == 1 and rt.labels.labelled == 0
        assert 'edgecache_semantic_labels_total{decision="refused",label="unverified",scenario="default",' \
               'tenant="default"} 1.0' in (await c.get("/metrics")).text


async def test_the_learner_explores_and_labels_with_the_real_cpu_engine(make_settings: Any) -> None:
    """End to end with llama.cpp: an explored paraphrase is computed by the engine (a second engine call), its
    client gets that answer, and the comparison with the cached answer reaches the log and the learner."""
    settings = make_settings(semantic__enabled=True, semantic__decision="learner")
    async with serve_in_process(create_app(settings)) as c:
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        teach_confidence(rt.learner, "default", "default")
        rt.learner.audit_share = 1.0
        answers = []
        for text in (ORIGINAL, PARAPHRASE):
            resp = await c.post("/v1/chat/completions", json=chat_body(text, model=model, max_tokens=12))
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-edgecache"] == "miss"
            answers.append(resp.json()["choices"][0]["message"]["content"])
            await settled(c)
        stats = (await c.get("/stats")).json()
        assert stats["engine"]["calls"] == 2  # the explored paraphrase was computed, not served from the cache
        rt.decisions.flush()
        records = list(read_records(Path(settings.data_dir) / "decisions"))
    explored = [r for r in records if isinstance(r, DecisionRecord)][-1]
    assert explored.decision == "explore" and explored.reason == "audit"
    assert [r.id for r in records if not isinstance(r, DecisionRecord)] == [explored.id]  # compared: one label
    labels = rt.learner.entry_labels_of("default", "default", explored.store_key)
    assert len(labels) == 1 and answers[1].strip()


async def test_labels_of_a_scenario_no_longer_configured_are_skipped_at_start_and_from_the_fleet(
        make_settings: Any) -> None:
    # A log written under a profile that had a scenario the operator has since removed (or a label from a fleet node
    # whose profile has it): nothing to teach, and never a failed start or a dead label follower.
    from edgecache.semantic.decision_log import DecisionLog

    settings = make_settings(semantic__enabled=True, semantic__decision="learner")
    log = DecisionLog(Path(settings.data_dir) / "decisions", max_bytes=1 << 20)
    gone = log.decided("default", "retired", "q0", "refused", reason="learner:unsure", store_key="k0", similarity=0.9)
    kept = log.decided("default", "default", "q1", "refused", reason="learner:unsure", store_key="k1", similarity=0.9)
    log.labelled(gone, False, "equality")
    log.labelled(kept, True, "equality")
    log.close()
    async with serve_in_process(create_app(settings, engine=ConstantEngine())) as c:
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        assert rt.ready and (await c.get("/health")).status_code == 200
        assert rt.learner.entry_labels_of("default", "default", "k1") == [(0.9, True)]
        assert ("default", "retired") not in rt.learner.summary()
        rt.semantic.learn_shared("default", "retired", "k2", 0.9, False, None)  # no KeyError out of the follower
        assert ("default", "retired") not in rt.learner.summary()
