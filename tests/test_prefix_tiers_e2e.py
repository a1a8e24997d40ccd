"""The prefix cache's tiers through a real `edgecache serve` with tenants, with the real client SDKs: a restart keeps
a tenant's prefix (served from disk, counted by tier in the ledger), another tenant never reads it, `edgecache flush
--tenant` drops it in every tier; Anthropic's ``cache_control`` usage on JSON and on streams; OpenAI's
``prompt_cache_retention``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from typer.testing import CliRunner

from cli.main import app
from tests.real_server import LONG_SYSTEM, MODEL, Server

pytestmark = pytest.mark.e2e

TENANTS = """
[plans.team]
prefix_cache_share = 0.5

[[tenants]]
id = "acme"
plan = "team"
keys = ["sk-acme-0001"]

[[tenants]]
id = "beta"
plan = "team"
keys = ["sk-beta-0001"]

[admin]
keys = ["sk-admin-0001"]
"""
ADMIN = {"Authorization": "Bearer sk-admin-0001"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prefix-tiers")
    (root / "tenants.toml").write_text(TENANTS)
    return root / "data"


@pytest.fixture(scope="module")
def server(data_dir: Path) -> Iterator[Server]:
    srv = Server(data_dir, "--tenants", str(data_dir.parent / "tenants.toml"),
                 env={"EDGECACHE_SEMANTIC__ENABLED": "false"}).start()
    yield srv
    srv.stop()


def chat(server: Server, key: str, question: str, **extra: object) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    return client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, extra_body=extra or None,
                                          messages=[{"role": "system", "content": LONG_SYSTEM},
                                                    {"role": "user", "content": question}])


def engine_state(server: Server) -> dict:
    return httpx.get(server.url + "/stats", headers=ADMIN, timeout=10).json()["engine_state"]


def settled(server: Server) -> dict:
    """The engine's figures once the disk writes under way are done."""
    for _ in range(200):
        state = engine_state(server)
        if state["prefix_cache_disk_writes_pending"] == 0:
            return state
        time.sleep(0.05)
    pytest.fail("the disk writes never finished")


def cached(answer: openai.types.chat.ChatCompletion) -> int:
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    return answer.usage.prompt_tokens_details.cached_tokens or 0


def test_e2e_a_restart_keeps_a_tenants_prefix_on_disk_and_no_other_tenant_reads_it(server: Server) -> None:
    first = chat(server, "sk-acme-0001", "Which rockets ship fastest?")
    assert cached(first) == 0
    server.stop()  # SIGTERM: the writes under way finish first
    server.start()
    assert engine_state(server)["prefix_cache_disk_entries"] >= 1
    beta = chat(server, "sk-beta-0001", "Which rockets ship fastest?")
    assert cached(beta) == 0  # the same prompt, another tenant: computed, never read from acme's state
    after = chat(server, "sk-acme-0001", "Which rockets carry the longest warranty?")
    assert first.usage is not None and cached(after) > first.usage.prompt_tokens - 40  # the long system prompt
    state = engine_state(server)
    assert state["prefix_cache_hits_disk"] == 1
    stats = httpx.get(server.url + "/stats", headers={"Authorization": "Bearer sk-acme-0001"}, timeout=10).json()
    assert stats["ledger"]["total"]["kv_prefix"]["by_tier"]["disk"]["prompt_tokens"] == cached(after)
    assert "beta" not in str(stats)
    assert set(stats["prefix_cache"]) == {"acme"} and stats["prefix_cache"]["acme"]["disk"] > 0
    admin = httpx.get(server.url + "/stats", headers=ADMIN, timeout=10).json()
    assert set(admin["prefix_cache"]) == {"acme", "beta"}
    metrics = httpx.get(server.url + "/metrics", headers=ADMIN, timeout=10).text
    assert 'edgecache_engine_prefix_cache_bytes{tenant="acme",tier="disk"}' in metrics
    assert 'edgecache_saved_kv_prefix_tokens_total{scenario="default",tenant="acme",tier="disk"}' in metrics

    settled(server)
    flushed = CliRunner().invoke(app, ["flush", "--url", server.url, "--key", "sk-admin-0001", "--tenant", "acme"])
    assert flushed.exit_code == 0 and "KV prefix states" in flushed.output, flushed.output
    kv_dirs = list((server.data_dir / "kv").glob("*/*"))
    assert len(kv_dirs) == 1  # beta's directory; acme's went with its states
    again = chat(server, "sk-acme-0001", "Which rockets ship within a week?")
    assert cached(again) == 0


def test_e2e_cache_control_usage_says_what_was_written_and_read_on_json_and_streams(server: Server) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="sk-beta-0001", max_retries=0)
    # Unlike the chats' system prompt from its first words, so that no earlier state of beta's holds a part of it.
    system = [{"type": "text", "text": "Answer in few words. " + LONG_SYSTEM,
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]

    def turn(question: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "text", "text": question,
                                              "cache_control": {"type": "ephemeral"}}]}]

    counted = client.messages.count_tokens(model=MODEL, system=system, messages=turn("Do rockets of series 3 fly?"))
    first = client.messages.create(model=MODEL, system=system, messages=turn("Do rockets of series 3 fly?"),
                                   max_tokens=4, extra_body={"temperature": 0})
    usage = first.usage
    assert usage.cache_read_input_tokens < 20  # at most a template's header the context still held
    assert usage.cache_creation is not None
    assert usage.cache_creation.ephemeral_1h_input_tokens > 500  # the system turn
    assert usage.cache_creation.ephemeral_5m_input_tokens > 5  # the question's turn
    assert usage.cache_creation_input_tokens == (usage.cache_creation.ephemeral_1h_input_tokens
                                                 + usage.cache_creation.ephemeral_5m_input_tokens)
    assert usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens == \
        counted.input_tokens

    later = turn("Tell me whether the rockets of series 4 can fly at night.")
    with client.messages.stream(model=MODEL, system=system, messages=later,
                                max_tokens=4, extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message().usage
    total = client.messages.count_tokens(model=MODEL, system=system, messages=later).input_tokens
    assert streamed.cache_read_input_tokens >= usage.cache_creation.ephemeral_1h_input_tokens
    assert streamed.cache_creation_input_tokens > 5  # the new question's turn
    assert streamed.input_tokens + streamed.cache_creation_input_tokens + streamed.cache_read_input_tokens == total
    # The split by ttl is in message_delta's usage (the SDK keeps message_start's, sent before the counts are known).
    raw = httpx.post(server.url + "/v1/messages", headers={"x-api-key": "sk-beta-0001"}, timeout=120, json={
        "model": MODEL, "system": system, "max_tokens": 4, "temperature": 0, "stream": True,
        "messages": turn("Tell me whether the rockets of series 5 can land on the moon.")})
    events = [json.loads(line[6:]) for line in raw.text.splitlines() if line.startswith("data: ")]
    start = next(e for e in events if e["type"] == "message_start")["message"]["usage"]
    end = next(e for e in events if e["type"] == "message_delta")["usage"]
    assert start["cache_creation"] is None
    assert end["cache_creation"]["ephemeral_1h_input_tokens"] == 0 and end["cache_creation"]["ephemeral_5m_input_tokens"] > 5
    assert end["cache_creation_input_tokens"] == end["cache_creation"]["ephemeral_5m_input_tokens"]


def barrier(server: Server, n: int) -> None:
    """A short request of another tenant: the engine runs one generation at a time and saves a prompt's state
    before it takes the next, so once this is answered every earlier save is done (and its write queued)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-beta-0001", max_retries=0)
    client.chat.completions.create(model=MODEL, max_tokens=1, temperature=0,
                                   messages=[{"role": "user", "content": f"ping {n}"}])


def test_e2e_retention_in_memory_is_never_written_and_24h_is(server: Server) -> None:
    barrier(server, 0)
    before = settled(server)["prefix_cache_disk_writes"]
    # Questions long enough (over the profile's prefix_cache_min_tokens new tokens) that each saves a state.
    storms = "Storms: " + " ".join(f"is a rocket of series {i} insured against storm damage at the pad?"
                                   for i in range(8))
    hail = "Hail: " + " ".join(f"is a rocket of series {i} insured against hail in transit?" for i in range(8))
    chat(server, "sk-acme-0001", storms, prompt_cache_retention="in_memory")
    barrier(server, 1)
    assert settled(server)["prefix_cache_disk_writes"] == before
    chat(server, "sk-acme-0001", hail, prompt_cache_retention="24h", prompt_cache_key="conversation-1")
    barrier(server, 2)
    assert settled(server)["prefix_cache_disk_writes"] == before + 1
