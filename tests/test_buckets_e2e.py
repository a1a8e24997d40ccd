"""Buckets for sampled requests end to end: the real `edgecache serve` (cpu profile, llama.cpp, SmolLM2) with a
tenants file, driven by the openai and anthropic SDKs. Requests send no temperature (the APIs' default of 1, as Codex
and Claude Code send none), so every engine call is a real sample. The ledger counts the engine calls."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.real_server import MODEL, Server

pytestmark = pytest.mark.e2e

PLAIN_KEY = "sk-plain-bucket-e2e-01"    # a plan with no bucket: the header asks for one
AGENTS_KEY = "sk-agents-bucket-e2e-01"  # a plan that keeps 2 answers per sampled request


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("buckets_e2e")
    tenants = root / "tenants.toml"
    tenants.write_text('[plans.plain]\n\n[plans.agents]\nbucket_size = 2\n\n'
                       f'[[tenants]]\nid = "plain"\nplan = "plain"\nkeys = ["{PLAIN_KEY}"]\n\n'
                       f'[[tenants]]\nid = "agents"\nplan = "agents"\nkeys = ["{AGENTS_KEY}"]\n')
    srv = Server(root / "data", "--tenants", str(tenants), env={"EDGECACHE_SEMANTIC__ENABLED": "false"}).start()
    yield srv
    srv.stop()


def sdk(server: Server, key: str, headers: dict[str, str] | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, default_headers=headers or {})


def ledger(server: Server, key: str) -> dict[str, Any]:
    """The tenant's own ledger row (its key sees only its tenant)."""
    body = httpx.get(server.url + "/stats", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
    return body["ledger"]["total"]  # type: ignore[no-any-return]


def engine_calls(server: Server, key: str) -> int:
    """Engine calls spent on the tenant's misses: metered when the engine's answer ends, before the client has it."""
    return int(ledger(server, key)["spent"]["miss"]["calls"])


def slots(header: str) -> list[int]:
    served, _ = header.split("/")
    return [int(s) for s in served.split(",")]


def settle(server: Server, key: str, exact: int) -> dict[str, Any]:
    """The tenant's ledger once it counts ``exact`` exact hits (a streamed answer is booked after its last frame)."""
    deadline = time.monotonic() + 60
    while (total := ledger(server, key))["requests"].get("exact", 0) < exact:
        assert time.monotonic() < deadline, total
        time.sleep(0.05)
    return total


def test_a_bucket_of_three_reaches_the_engine_three_times_then_never(server: Server) -> None:
    c = sdk(server, PLAIN_KEY, {"X-EdgeCache-Bucket-Size": "3"})
    request: dict[str, Any] = dict(model=MODEL, max_tokens=12,
                                   messages=[{"role": "user", "content": "Suggest a name for a cat."}])
    before = engine_calls(server, PLAIN_KEY)
    stored: dict[int, str] = {}
    for expected in (1, 2, 3):
        raw = c.chat.completions.with_raw_response.create(**request)
        assert raw.headers["x-edgecache"] == "miss" and raw.headers["x-edgecache-bucket"] == f"{expected}/3"
        stored[expected] = raw.parse().choices[0].message.content or ""
    assert engine_calls(server, PLAIN_KEY) == before + 3

    for _ in range(6):
        raw = c.chat.completions.with_raw_response.create(**request)
        assert raw.headers["x-edgecache"] == "exact", raw.headers
        (slot,) = slots(raw.headers["x-edgecache-bucket"])
        assert raw.parse().choices[0].message.content == stored[slot]

    # A stream replays a stored answer.
    raw_stream = c.chat.completions.with_raw_response.create(**request, stream=True)
    assert raw_stream.headers["x-edgecache"] == "exact"
    (slot,) = slots(raw_stream.headers["x-edgecache-bucket"])
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in raw_stream.parse() if chunk.choices)
    assert streamed == stored[slot]

    # n = 2: two different slots, each choice the answer its slot holds.
    raw = c.chat.completions.with_raw_response.create(**request, n=2)
    assert raw.headers["x-edgecache"] == "exact"
    first, second = slots(raw.headers["x-edgecache-bucket"])
    assert first != second
    assert [choice.message.content for choice in raw.parse().choices] == [stored[first], stored[second]]

    assert engine_calls(server, PLAIN_KEY) == before + 3
    total = settle(server, PLAIN_KEY, exact=8)
    assert total["miss_reasons"]["bucket_filling"] >= 3
    assert total["saved"]["exact"]["completion_tokens"] > 0


def test_a_bad_bucket_size_is_a_400(server: Server) -> None:
    before = engine_calls(server, PLAIN_KEY)
    for value in ("21", "two", "-1"):
        c = sdk(server, PLAIN_KEY, {"X-EdgeCache-Bucket-Size": value})
        with pytest.raises(openai.BadRequestError) as refused:
            c.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
        assert refused.value.status_code == 400
        assert refused.value.body["param"] == "X-EdgeCache-Bucket-Size"  # type: ignore[index]
    assert engine_calls(server, PLAIN_KEY) == before


def test_the_plans_bucket_serves_every_api(server: Server) -> None:
    """The agents plan keeps 2 answers with no header: filled through Chat, then served on Messages too (one key
    for the same generation asked through either API), streamed as Anthropic's events."""
    question = "Give me a one-line motto for a bakery."
    c = sdk(server, AGENTS_KEY)
    before = engine_calls(server, AGENTS_KEY)
    stored = {}
    for expected in (1, 2):
        raw = c.chat.completions.with_raw_response.create(model=MODEL, max_tokens=12,
                                                          messages=[{"role": "user", "content": question}])
        assert raw.headers["x-edgecache"] == "miss" and raw.headers["x-edgecache-bucket"] == f"{expected}/2"
        stored[expected] = raw.parse().choices[0].message.content
    assert engine_calls(server, AGENTS_KEY) == before + 2

    served = c.chat.completions.with_raw_response.create(model=MODEL, max_tokens=12,
                                                         messages=[{"role": "user", "content": question}])
    assert served.headers["x-edgecache"] == "exact"
    assert served.parse().choices[0].message.content == stored[slots(served.headers["x-edgecache-bucket"])[0]]

    claude = anthropic.Anthropic(base_url=server.url, api_key=AGENTS_KEY, max_retries=0)
    with claude.messages.with_streaming_response.create(
            model=MODEL, max_tokens=12, messages=[{"role": "user", "content": question}], stream=True) as raw_events:
        assert raw_events.headers["x-edgecache"] == "exact"
        (slot,) = slots(raw_events.headers["x-edgecache-bucket"])
        events = list(raw_events.parse())
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert text == stored[slot]
    # A caller who wants a new sample asks for no bucket.
    fresh = c.chat.completions.with_raw_response.create(model=MODEL, max_tokens=12,
                                                        messages=[{"role": "user", "content": question}],
                                                        extra_headers={"X-EdgeCache-Bucket-Size": "0"})
    assert fresh.headers["x-edgecache"] == "miss" and "x-edgecache-bucket" not in fresh.headers
    assert engine_calls(server, AGENTS_KEY) == before + 3


def test_tenants_never_share_a_bucket(server: Server) -> None:
    """The agents tenant's bucket for a question is not the plain tenant's, even with the same header."""
    question = "Name a colour of the sea."
    agents = sdk(server, AGENTS_KEY, {"X-EdgeCache-Bucket-Size": "1"})
    plain = sdk(server, PLAIN_KEY, {"X-EdgeCache-Bucket-Size": "1"})
    request: dict[str, Any] = dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": question}])
    assert agents.chat.completions.with_raw_response.create(**request).headers["x-edgecache"] == "miss"
    assert plain.chat.completions.with_raw_response.create(**request).headers["x-edgecache"] == "miss"
    assert agents.chat.completions.with_raw_response.create(**request).headers["x-edgecache"] == "exact"
