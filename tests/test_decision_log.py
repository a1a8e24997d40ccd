"""The decision log: bounded in bytes across rotation, no query text without the plan's consent, labels joined to
their decisions, a full disk counted and never failing a request. Real files; the semantic layer's real embedder
and index in-process with a fake engine."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path
from typing import Any

import pytest

from edgecache.http.app import create_app
from edgecache.semantic.decision_log import DecisionLog, DecisionRecord, LabelRecord, log_files, read_records
from edgecache.health import StorageFaults
from edgecache.metrics import Metrics
from edgecache.semantic.tuning import join
from tests.conftest import chat_body, serve_in_process
from tests.fakes import FakeEngine


def total_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in log_files(directory))


def test_the_log_stays_within_its_bytes_across_rotation(tmp_path: Path) -> None:
    log = DecisionLog(tmp_path, max_bytes=6000, files=3, flush_interval_s=0.01)
    ids = []
    try:
        for i in range(400):
            ids.append(log.decided("acme", "support", f"query number {i}", "refused", reason="below_threshold",
                                   store_key=f"k{i}", vector_key=i, similarity=0.5 + i / 1000))
            if i % 50 == 0:
                log.flush()
                assert total_bytes(tmp_path) <= 6000
        log.flush()
    finally:
        log.close()
    files = log_files(tmp_path)
    assert 1 < len(files) <= 3
    assert total_bytes(tmp_path) <= 6000
    assert all(p.stat().st_size <= 2000 for p in files)
    kept = [r.id for r in read_records(tmp_path)]
    assert kept == ids[-len(kept):]  # the newest records, in order: the oldest files went first
    assert 0 < len(kept) < 400
    # Reopened, it appends to the newest file and keeps rotating within the budget.
    again = DecisionLog(tmp_path, max_bytes=6000, files=3, flush_interval_s=0.01)
    for i in range(100):
        again.decided("acme", "support", f"more {i}", "miss")
    again.close()
    assert total_bytes(tmp_path) <= 6000 and len(log_files(tmp_path)) <= 3
    # Reopened with a smaller budget, the oldest files go before anything is appended.
    smaller = DecisionLog(tmp_path, max_bytes=2500, files=2, flush_interval_s=0.01)
    smaller.decided("acme", "support", "last", "miss")
    smaller.close()
    assert total_bytes(tmp_path) <= 2500 and len(log_files(tmp_path)) <= 2
    assert list(read_records(tmp_path))[-1].query_hash == smaller.query_hash("last")


def test_records_round_trip_and_labels_join_their_decisions(tmp_path: Path) -> None:
    log = DecisionLog(tmp_path, max_bytes=1 << 20, keeps_prompts=lambda tenant: tenant == "open")
    first = log.decided("open", "support", "How do I reset my password?", "refused", reason="below_threshold",
                        store_key="s1", vector_key=7, similarity=0.84)
    second = log.decided("closed", "support", "secret plan", "refused", reason="guard:numbers", store_key="s2",
                         vector_key=8, similarity=0.91, score=0.4)
    log.decided("closed", "support", "another", "miss")
    log.labelled(first, True, "equality")
    log.labelled(second, False, "answer-embedding")
    log.close()
    records = list(read_records(tmp_path))
    decisions = [r for r in records if isinstance(r, DecisionRecord)]
    labels = [r for r in records if isinstance(r, LabelRecord)]
    assert [d.query for d in decisions] == ["How do I reset my password?", None, None]
    assert decisions[1].query_hash == log.query_hash("secret plan") and decisions[1].score == 0.4
    assert {label.id: label.good for label in labels} == {first: True, second: False}
    groups = join(records)
    closed = groups[("closed", "support")]
    assert closed.lookups == 2 and [(s.similarity, s.good) for s in closed.labelled] == [(0.91, False)]
    assert groups[("*", "support")].lookups == 3 and len(groups[("*", "support")].labelled) == 2


def test_the_query_hash_is_keyed_and_stable_across_reopening(tmp_path: Path) -> None:
    a = DecisionLog(tmp_path, max_bytes=1 << 20)
    digest = a.query_hash("hello")
    a.close()
    b = DecisionLog(tmp_path, max_bytes=1 << 20)
    assert b.query_hash("hello") == digest  # the key is kept beside the log
    b.close()
    other = DecisionLog(tmp_path / "elsewhere", max_bytes=1 << 20)
    assert other.query_hash("hello") != digest  # not a plain hash a guess could match
    other.close()


def test_a_full_disk_drops_records_counted_and_logged_and_the_log_recovers(tmp_path: Path,
                                                                          monkeypatch: Any) -> None:
    metrics = Metrics()
    faults = StorageFaults(metrics.storage_failures)
    log = DecisionLog(tmp_path, max_bytes=1 << 20, faults=faults, flush_interval_s=0.01)
    real_write = DecisionLog._write
    full = [True]

    def failing_write(self: DecisionLog, chunk: list[bytes]) -> None:
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(self, chunk)

    monkeypatch.setattr(DecisionLog, "_write", failing_write)
    log.decided("t", "s", "q1", "miss")  # never raises on the caller's side
    log.flush()
    assert log.dropped == 1 and faults.check("decisions")().status == "degraded"
    assert metrics.storage_failures.labels("decisions", "disk_full")._value.get() == 1
    full[0] = False
    log.decided("t", "s", "q2", "miss")
    log.flush()
    log.close()
    assert faults.check("decisions")().status == "ready"
    assert [r.query_hash for r in read_records(tmp_path)] == [log.query_hash("q2")]


def tenants_file(tmp_path: Path) -> str:
    path = tmp_path / "tenants.toml"
    path.write_text('[plans.private]\n[plans.open]\nlog_prompts = true\n'
                    '[[tenants]]\nid = "quiet"\nplan = "private"\nkeys = ["sk-quiet-0001"]\n'
                    '[[tenants]]\nid = "loud"\nplan = "open"\nkeys = ["sk-loud-00001"]\n'
                    '[admin]\nkeys = ["sk-admin-0001"]\n')
    return str(path)


class ConstantEngine(FakeEngine):
    """Answers every prompt with the same text: a refused paraphrase's answer equals its candidate's."""

    def answer_for(self, request: Any) -> str:
        return "Refunds reach your card within five working days."


async def settled(c: Any) -> None:
    rt = c.app.state.runtime
    for _ in range(1000):
        if not len(rt.inflight) and (rt.labels is None or not rt.labels._tasks):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("a flight or a label never finished")


async def test_decisions_over_http_keep_text_only_for_a_consenting_plan_and_a_refusal_gets_a_label(
        make_settings: Any, tmp_path: Path) -> None:
    settings = make_settings(semantic__enabled=True, tenants_file=tenants_file(tmp_path))
    secret = "Is the refund for order 4417 twenty dollars?"
    private_queries = [secret, "Is the refund for order 4417 fifty dollars?", "Where is my parcel for order 4417?"]
    async with serve_in_process(create_app(settings, engine=ConstantEngine())) as c:
        for tenant, key in (("quiet", "sk-quiet-0001"), ("loud", "sk-loud-00001")):
            for query in private_queries:
                resp = await c.post("/v1/chat/completions", json=chat_body(f"{query}"),
                                    headers={"Authorization": f"Bearer {key}", "X-EdgeCache-Scenario": "support"})
                assert resp.status_code == 200, resp.text
                await settled(c)
        stats = (await c.get("/stats", headers={"Authorization": "Bearer sk-admin-0001"})).json()
    directory = Path(settings.data_dir) / "decisions"
    raw = b"".join(p.read_bytes() for p in log_files(directory))
    records = list(read_records(directory))
    decisions = {r.id: r for r in records if isinstance(r, DecisionRecord)}
    labels = [r for r in records if isinstance(r, LabelRecord)]
    quiet = [d for d in decisions.values() if d.tenant == "quiet"]
    loud = [d for d in decisions.values() if d.tenant == "loud"]
    assert len(quiet) == len(loud) == 3
    # The private plan's text is nowhere in the files (grep the bytes), the consenting plan's is.
    assert b"4417" not in b"".join(line for line in raw.splitlines() if b'"quiet"' in line)
    assert all(d.query is None for d in quiet) and [d.query for d in loud] == private_queries
    # The 50-dollar query refused the 20-dollar candidate (the guard's numbers rule): a label, joined to it.
    refused = [d for d in quiet if d.decision == "refused"]
    assert refused and refused[0].reason is not None and refused[0].store_key and refused[0].similarity
    by_decision = {label.id: label for label in labels}
    assert refused[0].id in by_decision
    assert by_decision[refused[0].id].good is True  # the same answer text at temperature 0: equality says good
    assert by_decision[refused[0].id].labeler.startswith("equality")
    summary = stats["semantic"]["labels"]["quiet/support"]
    assert summary["labels"] >= 1 and summary["bad"] == 0 and summary["false_hit_rate"] is None


async def test_the_log_off_writes_nothing(make_settings: Any) -> None:
    settings = make_settings(semantic__enabled=True, semantic__decision_log_bytes=0)
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        assert (await c.post("/v1/chat/completions", json=chat_body("How do I reset my password?"))
                ).status_code == 200
        assert c.app.state.runtime.decisions is None  # type: ignore[attr-defined]
    assert not (Path(settings.data_dir) / "decisions").exists()


@pytest.mark.parametrize("files", [1, 2])
def test_one_or_two_files_still_bound_the_bytes(tmp_path: Path, files: int) -> None:
    log = DecisionLog(tmp_path, max_bytes=3000, files=files, flush_interval_s=0.01)
    for i in range(200):
        log.decided("t", "s", f"q{i}", "miss", similarity=0.5)
    log.close()
    assert total_bytes(tmp_path) <= 3000 and len(log_files(tmp_path)) <= files
