"""Warmup: answered lines land in the store and the index, unanswered ones go through the engine, shared system
prompts are prefilled, bad lines are reported by number and skipped."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console

from edgecache.http.app import create_app
from edgecache.cli.warmup import warm_offline
from edgecache.http.warmup_lines import NumberedLine, WarmupLine, read_lines
from edgecache.warmup import LineResult
from tests.conftest import chat_body, serve_in_process
from tests.fakes import FakeEngine

SYSTEM = "You are the help desk of ACME Rockets. " + " ".join(
    f"Rule {i}: rockets of series {i} ship in {i % 5 + 1} days." for i in range(40))


def lines_file(path: Path) -> Path:
    rows = [
        json.dumps({"messages": [{"role": "user", "content": "How do I reset my password?"}],
                    "answer": "Click 'Forgot password' on the sign-in page.", "max_tokens": 16}),
        "{not json at all",
        json.dumps({"messages": [{"role": "user", "content": "What is your refund policy?"}], "max_tokens": 16}),
        json.dumps({"prompt": "x", "messages": [{"role": "user", "content": "both"}]}),
        "",
        json.dumps({"messages": [{"role": "user", "content": "Where is my card?"}], "scenario": "support",
                    "answer": "It ships in 3 days.", "max_tokens": 16}),
        json.dumps({"messages": [{"role": "user", "content": "odd"}], "scenario": "nonexistent", "answer": "x"}),
    ]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_read_lines_reports_bad_lines_by_number(tmp_path: Path) -> None:
    items = list(read_lines(lines_file(tmp_path / "p.jsonl").read_text().splitlines()))
    bad = {i.line: i.detail for i in items if isinstance(i, LineResult)}
    good = [i.line for i in items if isinstance(i, NumberedLine)]
    assert set(bad) == {2, 4}
    assert "exactly one of" in bad[4]
    assert good == [1, 3, 6, 7]


async def test_warmup_over_the_admin_route(make_settings: Any, tmp_path: Path) -> None:
    engine = FakeEngine()
    items = list(read_lines(lines_file(tmp_path / "p.jsonl").read_text().splitlines()))
    good = [i for i in items if isinstance(i, NumberedLine)]
    # The threshold rule (opt-in) serves a warmed answer to a paraphrase at first sight; the default learner waits
    # for labels.
    settings = make_settings(semantic__enabled=True, semantic__decision="threshold")
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        body = msgspec.json.encode({"lines": good})
        resp = await c.post("/admin/warmup", content=body, headers={"content-type": "application/json"})
        assert resp.status_code == 200, resp.text
        results = {r["line"]: r["outcome"] for r in resp.json()["results"]}
        assert results == {1: "written", 3: "written", 6: "written", 7: "failed"}
        assert engine.calls == 1  # only the unanswered line reached the engine
        exact = await c.post("/v1/chat/completions", json=chat_body("How do I reset my password?"))
        assert exact.headers["x-edgecache"] == "exact"
        assert exact.json()["choices"][0]["message"]["content"] == "Click 'Forgot password' on the sign-in page."
        para = await c.post("/v1/chat/completions", json=chat_body("How can I reset my password?"))
        assert para.headers["x-edgecache"] == "semantic"
        support = await c.post("/v1/chat/completions", json=chat_body("Where is my card?"),
                               headers={"X-EdgeCache-Scenario": "support"})
        assert support.headers["x-edgecache"] == "exact"
        assert (await c.post("/v1/chat/completions", json=chat_body("What is your refund policy?"))
                ).headers["x-edgecache"] == "exact"
        again = await c.post("/admin/warmup", content=body, headers={"content-type": "application/json"})
        assert {r["line"]: r["outcome"] for r in again.json()["results"]} == \
            {1: "skipped", 3: "skipped", 6: "skipped", 7: "failed"}


async def test_warmup_prefills_a_shared_system_prompt_in_the_real_engine(make_settings: Any) -> None:
    line = {"line": 1, "request": {"messages": [{"role": "system", "content": SYSTEM},
                                                {"role": "user", "content": "Which series ships fastest?"}],
                                   "answer": "Series 4, 9, 14 ..."}}
    async with serve_in_process(create_app(make_settings())) as c:  # the real llama.cpp engine and SmolLM2
        resp = await c.post("/admin/warmup", json={"lines": [line]})
        assert resp.json()["results"][0]["outcome"] == "written"
        first = await c.post("/v1/chat/completions", json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How long for series 3?"}]})
        assert first.headers["x-edgecache"] == "miss"
        use = first.json()["usage"]
        assert use["prompt_tokens"] > 500
        assert use["prompt_tokens_details"]["cached_tokens"] > 0.9 * use["prompt_tokens"] - 30


def test_warmup_offline_on_a_data_dir(make_settings: Any, tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "What is EdgeCache?"}],
                                "answer": "An inference cache."}) + "\n" + "[]\n")
    settings = make_settings()
    out = io.StringIO()
    summary = warm_offline(path, settings, None, Console(file=out, width=120))
    assert (summary.written, summary.failed) == (1, 1)
    assert "line 2" in out.getvalue()


async def test_a_large_batch_of_answered_lines_is_stored_and_indexed_whole(make_settings: Any) -> None:
    engine = FakeEngine()
    system = {"role": "system", "content": "You answer questions about ACME orders."}
    lines = [NumberedLine(line=i + 1, request=msgspec.convert(
        {"messages": [system, {"role": "user", "content": f"Where is order number {i} right now?"}],
         "answer": f"Order {i} is on its way.", "max_tokens": 16,
         # "right now" is the realtime tier (30 s): on a loaded box the batch took longer than that, and its first
         # answers had expired before they were asked for. The test is about batching, not about expiry.
         "ttl": 3600}, WarmupLine)) for i in range(3000)]
    lines.append(NumberedLine(line=3001, request=lines[10].request))  # the same line twice: stored once
    async with serve_in_process(create_app(make_settings(semantic__enabled=True), engine=engine)) as c:
        body = msgspec.json.encode({"lines": lines})
        resp = await c.post("/admin/warmup", content=body, headers={"content-type": "application/json"})
        outcomes = [r["outcome"] for r in resp.json()["results"]]
        assert outcomes[:3000] == ["written"] * 3000 and outcomes[3000] == "skipped"
        assert engine.calls == 1  # the one system prompt's prefill, nothing per line
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        assert sum((await rt.semantic.sizes()).values()) == 3000
        for i in (0, 1234, 2999):
            hit = await c.post("/v1/chat/completions", json={**chat_body(""), "messages": [
                system, {"role": "user", "content": f"Where is order number {i} right now?"}]})
            assert hit.headers["x-edgecache"] == "exact" and f"Order {i} " in hit.text
        para = await c.post("/v1/chat/completions", json={**chat_body(""), "messages": [
            system, {"role": "user", "content": "Where's order number 1234 right now?"}]})
        assert para.headers["x-edgecache"] in ("semantic", "miss")
        if para.headers["x-edgecache"] == "semantic":
            assert "Order 1234 " in para.text
        calls = engine.calls  # 1, or 2 when the paraphrase was computed (the untaught learner may refuse it)
        again = await c.post("/admin/warmup", content=body, headers={"content-type": "application/json"})
        assert {r["outcome"] for r in again.json()["results"]} == {"skipped"}
        assert engine.calls == calls  # the prefill is remembered across batches


class _RecordingEmbedder:
    """A tiny embedder that records how many embed() calls ran at once; ``thread_safe`` as given."""

    dim = 4
    version = "recording-v1"
    max_input_tokens = 256

    def __init__(self, *, thread_safe: bool) -> None:
        import threading

        if thread_safe:
            self.thread_safe = True
        self._lock = threading.Lock()
        self.running = 0
        self.most_at_once = 0
        # Two calls must meet here to go on: a bulk embed that ran its batches one after another would time out.
        self._meet = threading.Barrier(2, timeout=10) if thread_safe else None

    def fits(self, text: str) -> bool:
        return True

    def embed(self, texts):
        import time

        import numpy as np

        with self._lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            if self._meet is not None:
                self._meet.wait()
            else:
                time.sleep(0.01)  # room for a second call to overlap, were the embedder shared
            return np.array([[1.0, len(t), 0.0, 0.0] for t in texts], dtype=np.float32) / np.sqrt(
                np.array([[1.0 + len(t) ** 2] for t in texts], dtype=np.float32))
        finally:
            with self._lock:
                self.running -= 1


async def _bulk_embed(tmp_path: Path, embedder: _RecordingEmbedder, bulk_threads: int):
    from edgecache.semantic.lookup import MatchRule
    from edgecache.semantic.cache import SemanticCache
    from edgecache.semantic.index import SemanticIndex

    index = SemanticIndex(tmp_path, dim=embedder.dim, embedder_version=embedder.version)
    sem = SemanticCache(embedder=embedder, index=index, rule_for=lambda t, s: MatchRule(threshold=0.9),
                        bulk_threads=bulk_threads)
    try:
        texts = [f"question number {i}" + "?" * (i % 7) for i in range(40)]
        vectors = await sem.embed_many(texts, batch=10)
        # In the order given, each the vector of its own text, whatever order the batches finished in.
        assert [round(float(v[1] / v[0])) for v in vectors] == [len(t) for t in texts]
    finally:
        sem.close()


async def test_a_warmup_embeds_batches_side_by_side(tmp_path: Path) -> None:
    embedder = _RecordingEmbedder(thread_safe=True)
    await _bulk_embed(tmp_path, embedder, bulk_threads=2)
    assert embedder.most_at_once == 2


async def test_an_embedder_not_marked_thread_safe_embeds_one_batch_at_a_time(tmp_path: Path) -> None:
    embedder = _RecordingEmbedder(thread_safe=False)
    await _bulk_embed(tmp_path, embedder, bulk_threads=2)
    assert embedder.most_at_once == 1
