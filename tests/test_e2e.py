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


# --- one answer for every max_tokens of a greedy request ------------------------------------------------------

BYPASS = {"Cache-Control": "no-store"}  # the engine's own answer: neither read nor written


def engine_calls(server: Server) -> float:
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    return float(next(line.split()[1] for line in metrics.splitlines()
                      if line.startswith("edgecache_engine_calls_total ")))


def test_a_greedy_answer_serves_a_smaller_max_tokens_as_the_engine_writes_it(server: Server) -> None:
    c = client(server)
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    reference = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                          extra_headers=BYPASS).choices[0]
    assert reference.finish_reason == "length"
    calls = engine_calls(server)
    served, long = ask(c, messages[0]["content"], max_tokens=48)
    assert served == "miss" and long.usage.completion_tokens == 48
    served, short = ask(c, messages[0]["content"], max_tokens=12)
    assert served == "exact"
    assert short.choices[0].message.content == reference.message.content
    assert long.choices[0].message.content.startswith(reference.message.content)
    assert (short.choices[0].finish_reason, short.usage.completion_tokens) == ("length", 12)
    with c.chat.completions.with_streaming_response.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}) as resp:
        assert resp.headers["x-edgecache"] == "exact"
        chunks = list(resp.parse())
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == reference.message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]
    assert [ch.usage.completion_tokens for ch in chunks if ch.usage] == [12]
    assert engine_calls(server) == calls + 1
    # A larger max_tokens than the stored answer's 48 is computed; an answer that ended by itself serves any larger
    # max_tokens, whole.
    served, again = ask(c, messages[0]["content"], max_tokens=300)
    assert served == "miss" and again.choices[0].message.content.startswith(long.choices[0].message.content)
    if again.choices[0].finish_reason == "stop":
        served, whole = ask(c, messages[0]["content"], max_tokens=400)
        assert served == "exact" and whole.choices[0].message.content == again.choices[0].message.content
    assert engine_calls(server) == calls + 2


def test_a_smaller_max_tokens_on_completions_and_responses(server: Server) -> None:
    url = server.url
    body = {"model": MODEL, "prompt": "The three primary colours are", "temperature": 0}
    reference = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 7}, headers=BYPASS, timeout=60).json()
    assert httpx.post(url + "/v1/completions", json={**body, "max_tokens": 30}, timeout=60).headers[
        "x-edgecache"] == "miss"
    short = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 7}, timeout=60)
    assert short.headers["x-edgecache"] == "exact"
    assert short.json()["choices"][0]["text"] == reference["choices"][0]["text"]
    assert short.json()["choices"][0]["finish_reason"] == "length" and short.json()["usage"]["completion_tokens"] == 7

    request = {"model": MODEL, "input": "Describe a forest in one paragraph.", "temperature": 0}
    reference = httpx.post(url + "/v1/responses", json={**request, "max_output_tokens": 16}, headers=BYPASS,
                           timeout=60).json()
    assert httpx.post(url + "/v1/responses", json={**request, "max_output_tokens": 40}, timeout=60).headers[
        "x-edgecache"] == "miss"
    short = httpx.post(url + "/v1/responses", json={**request, "max_output_tokens": 16}, timeout=60)
    assert short.headers["x-edgecache"] == "exact"
    assert response_text(short.json()) == response_text(reference) and response_text(reference)
    assert short.json()["status"] == "incomplete" and short.json()["usage"]["output_tokens"] == 16
    with httpx.stream("POST", url + "/v1/responses", json={**request, "max_output_tokens": 16, "stream": True},
                      timeout=60) as resp:
        assert resp.headers["x-edgecache"] == "exact"
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert any('"response.incomplete"' in e for e in events)


def response_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")


def test_a_smaller_max_tokens_on_anthropic_messages(server: Server) -> None:
    import anthropic

    c = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    request: dict = {"model": MODEL, "extra_body": {"temperature": 0},
                     "messages": [{"role": "user", "content": "Tell me a story about a dragon."}]}
    reference = c.messages.create(**request, max_tokens=10, extra_headers=BYPASS)
    assert reference.stop_reason == "max_tokens"
    long = c.messages.with_raw_response.create(**request, max_tokens=48)
    assert long.headers["x-edgecache"] == "miss"
    short = c.messages.with_raw_response.create(**request, max_tokens=10)
    assert short.headers["x-edgecache"] == "exact"
    message = short.parse()
    assert [b.text for b in message.content] == [b.text for b in reference.content]  # type: ignore[union-attr]
    assert (message.stop_reason, message.usage.output_tokens) == ("max_tokens", 10)
    with c.messages.stream(**request, max_tokens=10) as stream:
        assert stream.response.headers["x-edgecache"] == "exact"
        streamed = stream.get_final_message()
    assert [b.text for b in streamed.content] == [b.text for b in reference.content]  # type: ignore[union-attr]
    assert (streamed.stop_reason, streamed.usage.output_tokens) == ("max_tokens", 10)


def test_seeded_sampling_is_prefix_stable_on_the_engine_and_served_so(server: Server) -> None:
    # The engine itself (no-store: neither read nor written): the same seed with max_tokens 48 and 12 writes the
    # 48-token answer's first 12 tokens, which is what lets max_tokens leave a seeded request's key.
    c = client(server)
    messages = [{"role": "user", "content": "Tell me about the moon."}]
    seeded = {"model": MODEL, "messages": messages, "temperature": 0.9, "seed": 7}
    long = c.chat.completions.create(**seeded, max_tokens=48, extra_headers=BYPASS).choices[0].message.content
    short = c.chat.completions.create(**seeded, max_tokens=12, extra_headers=BYPASS).choices[0].message.content
    assert short and long.startswith(short) and len(long) > len(short)
    calls = engine_calls(server)
    assert c.chat.completions.with_raw_response.create(**seeded, max_tokens=48).headers["x-edgecache"] == "miss"
    raw = c.chat.completions.with_raw_response.create(**seeded, max_tokens=12)
    assert raw.headers["x-edgecache"] == "exact" and raw.parse().choices[0].message.content == short
    with c.completions.with_streaming_response.create(
            model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=20) as resp:
        assert resp.headers["x-edgecache"] == "miss"
    with c.completions.with_streaming_response.create(
            model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=6, stream=True) as resp:
        assert resp.headers["x-edgecache"] == "exact"
        pieces = [chunk.choices[0] for chunk in resp.parse() if chunk.choices]
    reference = c.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=6,
                                     extra_headers=BYPASS).choices[0]
    assert "".join(p.text for p in pieces) == reference.text
    assert [p.finish_reason for p in pieces if p.finish_reason] == ["length"] == [reference.finish_reason]
    assert engine_calls(server) == calls + 3  # the two misses and the reference


def test_a_taught_answer_serves_every_max_tokens_on_messages(server: Server) -> None:
    # A warmup line's answer, given without max_tokens, is counted in the model's tokens: an Anthropic client (which
    # always sends max_tokens) is served it whole when it fits and cut at max_tokens when it does not.
    import anthropic

    question, answer = "How can I cancel my subscription?", "Open Settings, then Billing, and press Cancel."
    line = {"messages": [{"role": "user", "content": question}], "answer": answer}
    warm = httpx.post(server.url + "/admin/warmup", json={"lines": [{"line": 1, "request": line}]}, timeout=60)
    assert warm.status_code == 200, warm.text
    calls = engine_calls(server)
    c = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    request: dict = {"model": MODEL, "extra_body": {"temperature": 0},
                     "messages": [{"role": "user", "content": question}]}
    whole = c.messages.with_raw_response.create(**request, max_tokens=64)
    assert whole.headers["x-edgecache"] == "exact"
    message = whole.parse()
    assert [b.text for b in message.content] == [answer]  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn" and 5 < message.usage.output_tokens < 64
    short = c.messages.with_raw_response.create(**request, max_tokens=3)
    assert short.headers["x-edgecache"] == "exact"
    cut = short.parse()
    text = "".join(b.text for b in cut.content)  # type: ignore[union-attr]
    assert answer.startswith(text) and 0 < len(text) < len(answer)
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 3)
    with c.messages.stream(**request, max_tokens=3) as stream:
        assert stream.response.headers["x-edgecache"] == "exact"
        streamed = stream.get_final_message()
    assert "".join(b.text for b in streamed.content) == text  # type: ignore[union-attr]
    assert engine_calls(server) == calls


def test_a_follower_of_a_smaller_max_tokens_is_cut_from_the_running_engine_call(server: Server) -> None:
    # The leader runs 1,000 tokens (the end token masked); a request for 10 joins it while it runs and is served
    # the engine's own 10-token answer, cut live from the leader's stream.
    c = client(server)
    request: dict = {"model": MODEL, "messages": [{"role": "user", "content": "Count from one to a thousand."}],
                     "temperature": 0, "extra_body": {"ignore_eos": True}}
    reference = c.chat.completions.create(**request, max_tokens=10, extra_headers=BYPASS).choices[0]
    calls = engine_calls(server)
    with c.chat.completions.with_streaming_response.create(**request, max_tokens=1000, stream=True) as leader:
        assert leader.headers["x-edgecache"] == "miss"
        stream = leader.parse()
        next(iter(stream))  # the engine call is under way
        follower = c.chat.completions.with_raw_response.create(**request, max_tokens=10)
        assert follower.headers["x-edgecache"] == "shared"
        answer = follower.parse()
    assert answer.choices[0].message.content == reference.message.content
    assert (answer.choices[0].finish_reason, answer.usage.completion_tokens) == ("length", 10)
    assert engine_calls(server) == calls  # none finished: the follower made none, the leader left early (aborted)
