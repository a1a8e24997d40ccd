"""A fleet of real `edgecache serve` processes (real llama.cpp engine, SmolLM2) on one real Redis: a miss on one
node is exact on the other, and a node killed with SIGKILL while it leads a stream fails its followers on the other
node within the lease time, after which the next request computes. Two server processes only (CI budget); the
rest of the fleet's behaviour is in tests/test_fleet.py, in-process."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from edgecache.bench.redis_servers import RedisServer
from tests.real_server import MODEL, Server

pytestmark = pytest.mark.e2e

LEASE_S = 1.0


@pytest.fixture(scope="module")
def nodes(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    redis_server.fresh()
    root = tmp_path_factory.mktemp("fleet-e2e")
    env = {"EDGECACHE_STORE__REDIS_LEASE_S": str(LEASE_S), "EDGECACHE_SEMANTIC__ENABLED": "false"}
    started = [Server(root / f"node{i}" / "data", "--redis", redis_server.url, env=env) for i in range(2)]
    for server in started:
        server.data_dir.parent.mkdir(parents=True, exist_ok=True)
        server.start()
    yield started
    for server in started:
        server.stop()


def body(content: str, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 12, **extra}


def test_a_miss_on_one_node_is_exact_on_the_other(nodes: list[Server]) -> None:
    a, b = nodes
    first = httpx.post(a.url + "/v1/chat/completions", json=body("What is the capital of Italy?"), timeout=120)
    assert first.status_code == 200 and first.headers["x-edgecache"] == "miss"
    for _ in range(100):  # the answer reaches Redis a moment after the client has it
        second = httpx.post(b.url + "/v1/chat/completions", json=body("What is the capital of Italy?"), timeout=120)
        if second.headers["x-edgecache"] == "exact":
            break
    assert second.status_code == 200 and second.headers["x-edgecache"] == "exact"
    assert second.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    metrics = httpx.get(b.url + "/metrics", timeout=10).text
    assert "edgecache_engine_calls_total 0.0" in metrics


def test_killing_the_leading_node_mid_stream_fails_its_followers_then_the_next_request_computes(
        nodes: list[Server]) -> None:
    a, b = nodes
    long = body("Count from 1 to 500, separated by commas: 1, 2, 3,", max_tokens=200, stream=True)
    leader_started = threading.Event()

    def lead() -> None:
        try:
            with httpx.stream("POST", a.url + "/v1/chat/completions", json=long, timeout=120) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        leader_started.set()
        except httpx.HTTPError:
            pass  # its node is killed under it

    leader = threading.Thread(target=lead, daemon=True)
    leader.start()
    assert leader_started.wait(120)
    follower_events: list[dict] = []
    with httpx.stream("POST", b.url + "/v1/chat/completions", json=long, timeout=120) as resp:
        assert resp.status_code == 200 and resp.headers["x-edgecache"] in ("miss", "shared")
        killed = False
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            follower_events.append(json.loads(line[6:]))
            if not killed:  # B is following A's stream: kill A mid-answer
                assert a.proc is not None
                a.proc.send_signal(signal.SIGKILL)
                a.proc.wait(timeout=30)
                killed = True
    leader.join(timeout=30)
    assert killed
    last = follower_events[-1]
    assert "error" in last and "stopped before finishing" in last["error"]["message"]
    assert not any(choice.get("finish_reason") for e in follower_events for choice in e.get("choices", ()))
    # Nothing was stored: the next request computes on B (its own lease now).
    retry = httpx.post(b.url + "/v1/chat/completions", json={**long, "stream": False}, timeout=300)
    assert retry.status_code == 200 and retry.headers["x-edgecache"] == "miss"
