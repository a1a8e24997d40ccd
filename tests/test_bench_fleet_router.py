"""The router fleet benchmark (edgecache/bench/fleet_router.py, scripts/bench_fleet_router.py): its workload, its
checks (fed a fleet that crossed tenants, they fail), and one tiny run of the whole thing on real nodes behind the
real router (2 nodes, 2 tenants, 10 requests per arm, short system prompts). No timing is asserted."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from edgecache.bench import fleet_router
from edgecache.bench.fleet_router import ARMS, FleetConfig
from tests.conftest import REDIS_INSTALL, require_binary


@pytest.fixture(scope="module")
def count() -> Any:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the cpu extra installs it)")
    return fleet_router.smollm2_token_counter()


def test_the_workload_is_long_distinct_and_deterministic(count: Any) -> None:
    cfg = FleetConfig(tenants=4, requests=40)
    tenants, asks = fleet_router.build(cfg, count)
    assert [t.system_tokens for t in tenants] == [count(t.system) for t in tenants]
    assert min(t.system_tokens for t in tenants) >= 1000  # SmolLM2's tokens
    assert len({t.system for t in tenants}) == 4 and all(t.system.startswith(fleet_router.PREAMBLE) for t in tenants)
    assert len({a.question for a in asks}) == 40
    assert set(Counter(a.tenant.id for a in asks).values()) == {10}
    assert [a.tenant.id for a in asks] != [tenants[i % 4].id for i in range(40)]  # shuffled, not in turns
    again = fleet_router.build(cfg, count)
    assert [(a.tenant.id, a.question) for a in again[1]] == [(a.tenant.id, a.question) for a in asks]
    other = fleet_router.build(FleetConfig(tenants=4, requests=40, seed=1), count)
    assert [a.question for a in other[1]] != [a.question for a in asks]


def tiny_asks() -> list[Any]:
    """Four requests of two tenants (words for tokens: no tokenizer needed)."""
    return fleet_router.build(FleetConfig(tenants=2, requests=4, system_tokens=10), lambda text: len(text.split()))[1]


def record(ask: Any, prompt: int, cached: int, outcome: str = "miss", status: int = 200) -> dict:
    return {"idx": ask.idx, "tenant": ask.tenant.id, "status": status, "outcome": outcome, "ttft_s": 0.1,
            "answer": "x", "prompt_tokens": prompt, "cached_tokens": cached}


def arm_of(records: list[dict], by_tenant: dict[str, int] | None = None) -> dict[str, Any]:
    """One node's arm with these records; the node counted the answered tokens and ``by_tenant`` (by default,
    each request under its own tenant)."""
    answered = [r for r in records if r["status"] == 200]
    after = {"prompt_tokens": sum(r["prompt_tokens"] for r in answered), "calls": len(answered),
             "cached_tokens": sum(r["cached_tokens"] for r in answered),
             "by_tenant": by_tenant or dict(Counter(r["tenant"] for r in records))}
    before = {"prompt_tokens": 0, "cached_tokens": 0, "calls": 0, "by_tenant": {}}
    return {"arm": "cache_aware", "nodes": 1, "records": records, "wall_s": 1.0, "before": [before], "after": [after]}


def test_the_checks_pass_on_a_clean_arm_and_fail_on_a_crossed_one() -> None:
    asks = tiny_asks()
    first = {}
    for a in asks:
        first.setdefault(a.tenant.id, a.idx)
    clean = [record(a, 100, 0 if first[a.tenant.id] == a.idx else 90) for a in asks]
    arm = fleet_router.summarize(arm_of(clean), asks)
    assert all(arm["checks"].values()), arm["checks"]
    assert arm["hit_ratio"] == pytest.approx(180 / 400)
    assert arm["answered"] + arm["refused"] + arm["failed"] == arm["requests"] == 4

    # tenant1 warmed by tenant0's opening words: none of its requests was cold
    crossed = [record(a, 100, 0 if a.tenant.id == "tenant0" else 30) for a in asks]
    assert not fleet_router.summarize(arm_of(crossed), asks)["checks"]["each tenant paid its own cold prefill"]

    # the nodes counted a request under the wrong tenant
    cold = [record(a, 100, 0) for a in asks]
    wrong = fleet_router.summarize(arm_of(cold, {"tenant0": 3, "tenant1": 1}), asks)
    assert not wrong["checks"]["each tenant's requests counted under it on the nodes"]

    # an answer from a cache layer, a refusal, and prompt tokens unlike the one-node arm's
    mixed = [record(asks[0], 100, 0, outcome="exact"), record(asks[1], 100, 0),
             record(asks[2], 0, 0, outcome="refused", status=429), record(asks[3], 100, 0)]
    baseline = {"prompt_tokens_by_request": {0: 100, 1: 100, 2: 100, 3: 120}}
    arm = fleet_router.summarize(arm_of(mixed), asks, baseline)
    assert (arm["answered"], arm["refused"], arm["failed"]) == (3, 1, 0)
    assert not arm["checks"]["every request answered"]
    assert not arm["checks"]["every answer computed by an engine"]
    assert not arm["checks"]["each answer computed on its own prompt (tokens as on one node)"]

    # the answers' tokens do not add up to what the node counted
    raw = arm_of(cold)
    raw["after"][0]["cached_tokens"] += 7
    assert not fleet_router.summarize(raw, asks)["checks"]["answers' tokens add up to the nodes' counts"]


@pytest.mark.e2e
def test_a_tiny_run_through_the_real_router(tmp_path: Path, count: Any) -> None:
    pytest.importorskip("sglang_router", reason="sglang-router is not installed (the dev extra installs it)")
    require_binary("redis-server", REDIS_INSTALL)
    cfg = FleetConfig(nodes=2, tenants=2, requests=10, concurrency=2, system_tokens=200, max_tokens=4)
    result = fleet_router.run(cfg, tmp_path, count)
    assert list(result["arms"]) == list(ARMS)
    _, asks = fleet_router.build(cfg, count)
    sent = Counter(a.tenant.id for a in asks)
    for name, arm in result["arms"].items():
        assert arm["checks"] and all(arm["checks"].values()), (name, arm["checks"])
        assert arm["nodes"] == len(arm["per_node"]) == (1 if name == "one node" else 2)
        assert arm["requests"] == arm["answered"] + arm["refused"] + arm["failed"] == 10
        assert arm["outcomes"] == {"miss": 10}
        assert arm["engine_calls"] == 10
        by_tenant: Counter[str] = Counter()
        for node in arm["per_node"]:
            by_tenant.update(node["by_tenant"])
        assert by_tenant == sent
        assert 0 < arm["cached_tokens"] < arm["prompt_tokens"]
        assert arm["hit_ratio"] == arm["cached_tokens"] / arm["prompt_tokens"]
    # the same requests everywhere: the same prompt tokens in every arm
    assert len({arm["prompt_tokens"] for arm in result["arms"].values()}) == 1
    # both nodes served behind round robin
    assert all(node["calls"] > 0 for node in result["arms"]["round_robin"]["per_node"])
    text = fleet_router.table(result)
    for name in ARMS:
        assert name in text
    assert "nothing lost or served to the wrong tenant: yes" in text
