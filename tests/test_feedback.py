"""``POST /v1/feedback`` over HTTP: a wrong mark on a semantic hit is a label and stops that answer being served for
that request (after a restart too); a mark cannot cross tenants; an unknown id is a 404; a mark on the engine's own
answer is only counted. The real embedder and index, in-process with a scripted engine; the threshold rule where a
test needs a paraphrase served at first sight (an untaught learner serves nothing), the learner where it learns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from edgecache.http.app import create_app
from edgecache.semantic.decision_log import DecisionRecord, LabelRecord, read_records
from tests.conftest import chat_body, serve_in_process
from tests.fakes import FakeEngine
from tests.test_decision_log import settled
from tests.test_learner_serving import teach_confidence
from tests.test_tenants import auth, write_tenants_file

ORIGINAL = "How do I reset my password?"
PARAPHRASE = "How can I reset my password?"


async def ask(c: httpx.AsyncClient, text: str, headers: dict[str, str] | None = None) -> tuple[str, str, str]:
    """(X-EdgeCache, the answer, the response id)."""
    resp = await c.post("/v1/chat/completions", json=chat_body(text), headers=headers or {})
    assert resp.status_code == 200, resp.text
    await settled(c)
    body = resp.json()
    return resp.headers["x-edgecache"], body["choices"][0]["message"]["content"], body["id"]


async def mark(c: httpx.AsyncClient, response_id: str, correct: bool,
               headers: dict[str, str] | None = None) -> httpx.Response:
    return await c.post("/v1/feedback", json={"response_id": response_id, "correct": correct}, headers=headers or {})


async def test_a_wrong_mark_on_a_semantic_hit_is_a_label_and_the_answer_is_no_longer_served_for_that_request(
        make_settings: Any) -> None:
    settings = make_settings(semantic__enabled=True, semantic__decision="threshold")
    engine = FakeEngine()
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        assert (await ask(c, ORIGINAL))[0] == "miss"
        served, text, hit_id = await ask(c, PARAPHRASE)
        assert (served, text) == ("semantic", f"answer to: {ORIGINAL}")
        assert (await ask(c, PARAPHRASE))[:2] == ("exact", f"answer to: {ORIGINAL}")  # the hit's copy
        resp = await mark(c, hit_id, False)
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"response_id": hit_id, "correct": False, "served": "semantic", "effect": "demoted",
                               "object": "edgecache.feedback"}
        # The copy is gone and the candidate refused for this request: the engine answers it, and its own answer
        # serves the repeats from then on.
        calls = engine.calls
        assert (await ask(c, PARAPHRASE))[:2] == ("miss", f"answer to: {PARAPHRASE}")
        assert engine.calls == calls + 1
        assert (await ask(c, PARAPHRASE))[:2] == ("exact", f"answer to: {PARAPHRASE}")
        # Marked once: a second mark changes nothing.
        assert (await mark(c, hit_id, True)).json()["effect"] == "already_marked"
        metrics = (await c.get("/metrics")).text
        assert 'edgecache_semantic_refusals_total{reason="marked_wrong",scenario="default"} 1.0' in metrics
        assert 'edgecache_feedback_total{served="semantic",tenant="default",verdict="wrong"} 1.0' in metrics
        labelling = (await c.get("/stats")).json()["semantic"]["labelling"]
        assert labelling["feedback"] == {"semantic_wrong": 1} and labelling["labels_last_hour"] >= 1
        rt.decisions.flush()
    records = list(read_records(Path(settings.data_dir) / "decisions"))
    hit = next(r for r in records if isinstance(r, DecisionRecord) and r.decision == "hit")
    assert [(r.good, r.labeler) for r in records if isinstance(r, LabelRecord) and r.id == hit.id] == \
        [(False, "feedback")]


async def test_the_demotion_and_the_response_ids_survive_a_restart(make_settings: Any) -> None:
    settings = make_settings(semantic__enabled=True, semantic__decision="threshold")
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        await ask(c, ORIGINAL)
        served, _, hit_id = await ask(c, PARAPHRASE)
        assert served == "semantic"
        _, _, miss_id = await ask(c, "What is the boiling point of water at sea level?")
        assert (await mark(c, hit_id, False)).json()["effect"] == "demoted"
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        assert (await ask(c, PARAPHRASE))[:2] == ("miss", f"answer to: {PARAPHRASE}")
        assert (await mark(c, hit_id, False)).json()["effect"] == "already_marked"
        assert (await mark(c, miss_id, True)).json()["effect"] == "recorded"


async def test_a_mark_on_the_repeat_of_a_semantic_hit_is_a_mark_of_that_hit(make_settings: Any) -> None:
    settings = make_settings(semantic__enabled=True, semantic__decision="threshold")
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        await ask(c, ORIGINAL)
        assert (await ask(c, PARAPHRASE))[0] == "semantic"
        served, text, repeat_id = await ask(c, PARAPHRASE)
        assert (served, text) == ("exact", f"answer to: {ORIGINAL}")
        assert (await mark(c, repeat_id, False)).json() == {
            "response_id": repeat_id, "correct": False, "served": "exact", "effect": "demoted",
            "object": "edgecache.feedback"}
        assert (await ask(c, PARAPHRASE))[:2] == ("miss", f"answer to: {PARAPHRASE}")


async def test_a_mark_on_the_engines_own_answer_is_counted_and_drops_nothing(make_settings: Any) -> None:
    settings = make_settings(semantic__enabled=True, semantic__decision="threshold")
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        served, _, miss_id = await ask(c, ORIGINAL)
        assert served == "miss"
        served, _, exact_id = await ask(c, ORIGINAL)
        assert served == "exact"
        assert (await mark(c, miss_id, False)).json()["effect"] == "recorded"
        assert (await mark(c, exact_id, False)).json()["effect"] == "recorded"
        assert (await ask(c, ORIGINAL))[:2] == ("exact", f"answer to: {ORIGINAL}")
        assert (await ask(c, PARAPHRASE))[0] == "semantic"
        metrics = (await c.get("/metrics")).text
        assert 'edgecache_feedback_total{served="miss",tenant="default",verdict="wrong"} 1.0' in metrics
        assert 'edgecache_feedback_total{served="exact",tenant="default",verdict="wrong"} 1.0' in metrics


async def test_feedback_cannot_cross_tenants_and_an_unknown_id_is_a_404(make_settings: Any, tmp_path: Path) -> None:
    tenants = write_tenants_file(tmp_path / "tenants.toml")
    settings = make_settings(semantic__enabled=True, semantic__decision="threshold", tenants_file=str(tenants))
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        await ask(c, ORIGINAL, auth("t01"))
        served, _, hit_id = await ask(c, PARAPHRASE, auth("t01"))
        assert served == "semantic"
        other = await mark(c, hit_id, False, auth("t02"))
        unknown = await mark(c, "chatcmpl-0123456789abcdef00000000", False, auth("t01"))
        for resp in (other, unknown):
            assert resp.status_code == 404
            error = resp.json()["error"]
            assert error["type"] == "not_found_error" and error["param"] == "response_id"
        # The same words for both: a tenant cannot tell another's id from one never sent.
        assert other.json()["error"]["message"].replace(hit_id, "X") == \
            unknown.json()["error"]["message"].replace("chatcmpl-0123456789abcdef00000000", "X")
        # The other tenant's attempt changed nothing: the owner's mark still demotes.
        assert (await ask(c, PARAPHRASE, auth("t01")))[0] == "exact"
        assert (await mark(c, hit_id, False, auth("t01"))).json()["effect"] == "demoted"
        assert (await c.post("/v1/feedback", json={"response_id": hit_id, "correct": False})).status_code == 401
        bad = await c.post("/v1/feedback", json={"response_id": hit_id, "correct": "no"}, headers=auth("t01"))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "correct"
        extra = await c.post("/v1/feedback", json={"response_id": hit_id, "correct": False, "why": "x"},
                             headers=auth("t01"))
        assert extra.status_code == 400


async def test_a_wrong_mark_teaches_the_learner_which_demotes_after_its_rule(make_settings: Any) -> None:
    settings = make_settings(semantic__enabled=True, semantic__decision="learner", semantic__learner_demote_after=1)
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        teach_confidence(rt.learner, "default", "default")
        rt.learner.audit_share = 0.0
        await ask(c, ORIGINAL)
        served, _, hit_id = await ask(c, PARAPHRASE)
        assert served == "semantic"
        rt.decisions.flush()
        hit = [r for r in read_records(Path(settings.data_dir) / "decisions") if isinstance(r, DecisionRecord)][-1]
        assert hit.decision == "hit" and hit.store_key
        assert (await mark(c, hit_id, False)).json()["effect"] == "demoted"
        assert rt.learner.entry_labels_of("default", "default", hit.store_key)[-1][1] is False
        assert rt.learner.is_demoted("default", "default", hit.store_key)
        # Demoted: another paraphrase is no longer served that answer either.
        served, text, _ = await ask(c, "How could I reset my password?")
        assert (served, text) == ("miss", "answer to: How could I reset my password?")
        assert 'reason="learner:demoted"' in (await c.get("/metrics")).text


async def test_stats_say_how_fast_labels_come_and_what_their_want_costs(make_settings: Any) -> None:
    settings = make_settings(semantic__enabled=True, semantic__decision="learner")
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        labelling = (await c.get("/stats")).json()["semantic"]["labelling"]
        assert labelling["labels_last_hour"] == 0 and labelling["refused_for_want_of_labels"] == 0
        # The CPU default's model is never asked to judge, and /stats says so.
        assert labelling["judge"]["state"] == "off" and "llamacpp" in labelling["judge"]["why"]
        teach_confidence(rt.learner, "default", "default")
        rt.learner.audit_share = 1.0  # every confident serve explored: refused to get a label
        await ask(c, ORIGINAL)
        assert (await ask(c, PARAPHRASE))[0] == "miss"
        labelling = (await c.get("/stats")).json()["semantic"]["labelling"]
        assert labelling["refused_for_want_of_labels"] == 1
        assert labelling["labels_last_hour"] == labelling["labels_since_start"] == 1  # the exploration's label
        assert labelling["labels_per_hour"] > 0


def test_the_hourly_label_count_forgets_what_is_older_than_an_hour() -> None:
    from edgecache.metrics import HourlyCount

    now = [0.0]
    count = HourlyCount(lambda: now[0])
    count.add()
    now[0] = 1800.0
    count.add(2)
    assert count.last_hour() == 3
    now[0] = 3700.0
    assert count.last_hour() == 2
    now[0] = 5500.0
    assert count.last_hour() == 0 and count.total == 3 and count.per_hour() == 3 * 3600 / 5500


def test_tune_leaves_the_callers_marks_out(tmp_path: Path) -> None:
    # A caller marks what it noticed (mostly wrong answers), not a sample of the hits: weighted as one, a single
    # mark would stand for every hit.
    from edgecache.semantic.decision_log import DecisionLog
    from edgecache.semantic.tuning import join

    log = DecisionLog(tmp_path, max_bytes=1 << 20)
    hit = log.decided("t", "s", "q1", "hit", store_key="k", vector_key=1, similarity=0.9)
    refused = log.decided("t", "s", "q2", "refused", reason="below_threshold", store_key="k", vector_key=1,
                          similarity=0.8)
    log.labelled(hit, False, "feedback")
    log.labelled(refused, False, "answer-embedding")
    log.close()
    group = join(read_records(tmp_path), pooled=False)[("t", "s")]
    assert [(s.similarity, s.good) for s in group.labelled] == [(0.8, False)]


def test_one_tenants_traffic_never_pushes_another_tenants_responses_out(tmp_path: Path) -> None:
    """beta's flood of hits must not cost acme the responses it may still mark: past the bound the tenant holding
    the most loses its oldest, and after a restart the same holds."""
    from edgecache.call import Call
    from edgecache.engines.base import GenerationRequest
    from edgecache.http.feedback import ResponseLedger
    from edgecache.pipeline import Reply

    path = tmp_path / "responses.msgpack"
    ledger = ResponseLedger(path, max_entries=50)
    for i in range(10):
        ledger.remember(f"acme-{i}", Call(request=GenerationRequest(prompt="q"), tenant="acme"), Reply(served="miss"))
    for i in range(500):
        ledger.remember(f"beta-{i}", Call(request=GenerationRequest(prompt="q"), tenant="beta"), Reply(served="exact"))
    assert len(ledger) == 50
    assert all(ledger.find("acme", f"acme-{i}") is not None for i in range(10))
    assert ledger.find("beta", "beta-499") is not None and ledger.find("beta", "beta-449") is None
    ledger.save()
    again = ResponseLedger(path, max_entries=50)
    assert all(again.find("acme", f"acme-{i}") is not None for i in range(10)) and len(again) == 50


def test_one_tenants_marks_never_push_another_tenants_marks_out(tmp_path: Path) -> None:
    """The callers' wrong marks are bounded with a share each: beta's flood of marks costs acme none of its own
    (beta's oldest go), and after a restart the same holds."""
    from edgecache.semantic.marks import MarkedWrong

    path = tmp_path / "marks.msgpack"
    marks = MarkedWrong(path, max_entries=50)
    for i in range(10):
        marks.mark("acme", f"request-{i}", "wrong-answer")
    for i in range(500):
        marks.mark("beta", f"request-{i}", "wrong-answer")
    assert len(marks) == 50 and marks.held("acme") == 10 and marks.held("beta") == 40
    assert all(marks.refuses("acme", f"request-{i}", "wrong-answer") for i in range(10))
    assert marks.refuses("beta", "request-499", "wrong-answer")
    assert not marks.refuses("beta", "request-459", "wrong-answer")
    marks.save()
    again = MarkedWrong(path, max_entries=50)
    assert again.held("acme") == 10 and len(again) == 50
    assert all(again.refuses("acme", f"request-{i}", "wrong-answer") for i in range(10))
