"""End to end: the real `edgecache serve` process, the real llama.cpp engine and SmolLM2, the official openai client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.real_server import LONG_SYSTEM, MODEL, Server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("e2e") / "data").start()
    yield srv
    srv.stop()


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(c: openai.OpenAI, question: str, **kw: object) -> tuple[str, object]:
    kw.setdefault("max_tokens", 12)
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": question}], temperature=0, **kw)
    return raw.headers["x-edgecache"], raw.parse()


def test_openai_sync_client_miss_then_exact(server: Server) -> None:
    c = client(server)
    served1, first = ask(c, "What is the capital of France?")
    served2, second = ask(c, "What is the capital of France?")
    assert (served1, served2) == ("miss", "exact")
    assert first.choices[0].message.content and first.choices[0].message.content == second.choices[0].message.content
    assert first.usage.completion_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens


def test_openai_sync_streaming_hit_equals_stored_answer(server: Server) -> None:
    c = client(server)
    _, stored = ask(c, "Name a colour.")
    with c.chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12, temperature=0,
            stream=True) as resp:
        assert resp.headers["x-edgecache"] == "exact"
        text = "".join(chunk.choices[0].delta.content or "" for chunk in resp.parse() if chunk.choices)
    assert text == stored.choices[0].message.content


async def test_openai_async_client_stream_and_not(server: Server) -> None:
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    stream = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to three."}],
                                             max_tokens=10, temperature=0, stream=True)
    pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    assert len([p for p in pieces if p]) > 1, "a miss streams token by token"
    full = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to three."}],
                                           max_tokens=10, temperature=0)
    assert full.choices[0].message.content == "".join(pieces)
    completion = await c.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0)
    assert completion.choices[0].text
    await c.close()


def test_shared_system_prompt_skips_prefill(server: Server) -> None:
    c = client(server)
    answers = []
    for question in ("How long does series 4 take to ship?", "What warranty does series 9 have?"):
        answers.append(c.chat.completions.create(
            model=MODEL, max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": question}]))
    cold, warm = answers
    assert cold.usage.prompt_tokens > 1000
    assert cold.usage.prompt_tokens_details.cached_tokens < 100
    # Everything up to the user's question comes from the engine's prefix cache.
    assert warm.usage.prompt_tokens_details.cached_tokens > 0.9 * warm.usage.prompt_tokens


def test_a_streaming_miss_is_stored(server: Server) -> None:
    c = client(server)
    with c.chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=6, temperature=0,
            stream=True) as resp:
        assert resp.headers["x-edgecache"] == "miss"
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in resp.parse() if chunk.choices)
    time.sleep(0.5)  # the flight stores the answer just after the client has it
    served, again = ask(c, "Name a fruit.", max_tokens=6)
    assert served == "exact"
    assert again.choices[0].message.content == streamed


def test_disconnect_mid_stream_stores_nothing(server: Server) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "max_tokens": 120, "temperature": 0, "stream": True}
    entries_before = server.stats()["store"]["entries"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.headers["x-edgecache"] == "miss"
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break  # one token, then hang up
    time.sleep(1.0)
    assert server.stats()["store"]["entries"] == entries_before
    again = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False},
                       timeout=60)
    assert again.headers["x-edgecache"] == "miss"


def test_errors_on_the_real_server(server: Server) -> None:
    url = server.url + "/v1/chat/completions"
    bad_json = httpx.post(url, content=b"{", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
    unknown = httpx.post(url, json={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    huge = httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 2_000_000}]})
    assert huge.status_code == 413 and "error" in huge.json()
    too_long = httpx.post(url, json={"model": MODEL, "temperature": 0,
                                     "messages": [{"role": "user", "content": "word " * 5000}]}, timeout=120)
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client(server).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_semantic_decisions_are_logged_without_query_text(server: Server) -> None:
    """The real engine and embedder: a refused paraphrase is logged with its candidate and similarity, and the open
    default tenant's plan keeps no query text in the decision log."""
    from edgecache.semantic.decision_log import DecisionRecord, LabelRecord, read_records

    c = client(server)
    assert ask(c, "Which river flows through Vienna?")[0] == "miss"
    assert ask(c, "Tell me which river flows through the city of Vienna?")[0] in ("miss", "semantic")
    directory = server.data_dir / "decisions"
    for _ in range(100):  # the writer thread appends each second
        if directory.is_dir() and any(isinstance(r, DecisionRecord) and r.store_key for r in read_records(directory)):
            break
        time.sleep(0.1)
    records = list(read_records(directory))
    decisions = [r for r in records if isinstance(r, DecisionRecord)]
    assert len(decisions) >= 2 and all(d.query is None and len(d.query_hash) == 32 for d in decisions)
    paraphrase = next(d for d in decisions if d.store_key)
    assert paraphrase.decision in ("hit", "refused") and 0 < paraphrase.similarity <= 1  # type: ignore[operator]
    assert b"Vienna" not in b"".join(p.read_bytes() for p in directory.glob("decisions-*.jsonl"))
    labels = [r for r in records if isinstance(r, LabelRecord)]
    assert all(label.id in {d.id for d in decisions} for label in labels)


def test_restart_on_the_same_data_dir_is_still_exact(tmp_path: Path) -> None:
    first = Server(tmp_path / "data").start()
    try:
        served, answer = ask(client(first), "Is water wet?")
        assert served == "miss"
    finally:
        first.stop()
    second = Server(tmp_path / "data").start()
    try:
        served, again = ask(client(second), "Is water wet?")
        assert served == "exact"
        assert again.choices[0].message.content == answer.choices[0].message.content
        assert "edgecache_engine_calls_total 0.0" in httpx.get(second.url + "/metrics").text
    finally:
        second.stop()
