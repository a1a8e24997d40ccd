"""Smoke test of the headline benchmark's workload generator (edgecache/bench/workload.py): deterministic with a seed,
proportions roughly as configured, every request well-formed. No server, no model: fast."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from edgecache.bench import workload

if not (workload.DATA_DIR / "banking77_train.csv").exists():
    pytest.skip("../shared/data is not present", allow_module_level=True)

N = 2000


@pytest.fixture(scope="module")
def reqs():
    return workload.generate(workload.WorkloadConfig(requests=N, seed=7))


def test_same_seed_same_workload_other_seed_other(reqs):
    again = workload.generate(workload.WorkloadConfig(requests=N, seed=7))
    assert workload.to_jsonl(again) == workload.to_jsonl(reqs)
    other = workload.generate(workload.WorkloadConfig(requests=N, seed=8))
    assert workload.to_jsonl(other) != workload.to_jsonl(reqs)


def test_proportions_roughly_as_configured(reqs):
    assert len(reqs) == N
    kinds = Counter(r.kind for r in reqs)
    assert abs(kinds["repeat"] / N - 0.40) < 0.05
    assert abs(kinds["burst"] / N - 0.10) < 0.04
    assert 0.10 < kinds["paraphrase"] / N <= 0.22  # a paraphrase falls back to a new request when none is left
    tenants = Counter(r.tenant for r in reqs)
    assert set(tenants) == {t.id for t in workload.TENANTS}
    assert min(tenants.values()) > 0.08 * N


def test_repeats_paraphrases_and_bursts_mean_what_they_say(reqs):
    seen_identity, seen_group = set(), {}
    for r in reqs:
        if r.kind == "repeat":
            assert r.identity() in seen_identity  # byte-for-byte an earlier request
        elif r.kind == "paraphrase":
            assert r.identity() not in seen_identity  # other words ...
            assert r.group in seen_group.get(r.tenant, set())  # ... same intent / origin as an earlier request
        seen_identity.add(r.identity())
        seen_group.setdefault(r.tenant, set()).add(r.group)
    bursts: dict[int, list] = {}
    for r in reqs:
        if r.burst >= 0:
            bursts.setdefault(r.burst, []).append(r)
    assert bursts
    for members in bursts.values():
        assert len({m.identity() for m in members}) == 1 and len({m.t for m in members}) == 1
        assert len(members) >= 2 or members[-1].idx == N - 1  # only the last burst may be cut short
    # Repeats are skewed (Zipf): the most repeated request is far above the average.
    counts = Counter(r.identity() for r in reqs if r.kind == "repeat")
    assert max(counts.values()) > 5 * (sum(counts.values()) / len(counts))


def test_every_request_is_well_formed(reqs):
    keys = {t.id: t.key for t in workload.TENANTS}
    systems = {t.id: t.system for t in workload.TENANTS}
    times = [r.t for r in reqs]
    assert times == sorted(times) and times[0] == 0.0
    assert abs(times[-1] - N / workload.WorkloadConfig().rate) < 1e-6
    for i, r in enumerate(reqs):
        assert r.idx == i
        body = json.loads(json.dumps(r.body()))
        assert set(body) == {"model", "messages", "max_tokens", "temperature", "stream"}
        assert body["temperature"] == 0 and body["stream"] is True and 1 <= body["max_tokens"] <= 64
        assert [m["role"] for m in body["messages"]] == ["system", "user"]
        assert body["messages"][0]["content"] == systems[r.tenant]  # a shared system prompt per tenant
        assert body["messages"][1]["content"].strip() and "\n" not in body["messages"][1]["content"]
        assert r.scenario in ("support", "knowledge")
        assert r.group.startswith("b77:" if r.scenario == "support" else "gpt:")
        h = r.headers("bypass")
        assert h["authorization"] == f"Bearer {keys[r.tenant]}" and h["x-edgecache-policy"] == "bypass"
        assert h["x-edgecache-scenario"] == r.scenario and "x-edgecache-policy" not in r.headers()


def test_warmup_file_and_tenants_file(reqs):
    lines = workload.warmup_lines(reqs)
    assert lines and len(lines) == len({(x["tenant"], json.dumps(x["messages"])) for x in lines})
    assert all("answer" not in x and x["max_tokens"] == reqs[0].max_tokens for x in lines)
    import tomllib

    parsed = tomllib.loads(workload.tenants_toml())
    assert "bypass" in parsed["plans"]["bench"]["policies"]
    assert {t["id"] for t in parsed["tenants"]} == {t.id for t in workload.TENANTS}
    assert all(len(k) >= 8 for t in parsed["tenants"] for k in t["keys"])
