"""The agent trace of scripts/bench_agents.py (edgecache/bench/agents.py): deterministic with a seed, sizes as
configured, turns that grow, sessions and tenants' keys distinct, the interleaving; and the report's maths. No
server, no model: fast."""

from __future__ import annotations

import dataclasses
import itertools
import math
import tomllib
from collections import Counter

import pytest

from edgecache.bench import agents

CFG = agents.TraceConfig(tenants=2, sessions=3, turns=3, prompt_tokens=3500, turn_tokens=150, seed=5)


@pytest.fixture(scope="module")
def sessions() -> list[agents.Session]:
    return agents.sessions(CFG)


def test_same_seed_same_trace_other_seed_other(sessions):
    assert agents.sessions(CFG) == sessions
    other = agents.sessions(dataclasses.replace(CFG, seed=6))
    assert all(a.system != b.system and a.users != b.users for a, b in zip(other, sessions, strict=True))


def test_sizes_in_range(sessions):
    assert len(sessions) == CFG.tenants * CFG.sessions
    for s in sessions:
        assert len(s.users) == CFG.turns and len(s.probe_users) == CFG.probes
        system = agents.estimate_tokens(s.system)
        assert CFG.prompt_tokens <= system <= 1.1 * CFG.prompt_tokens, (s.name, system)
        assert "## Tool " in s.system  # tool definitions, as an agent's system prompt carries them
        for user in (*s.users, *s.probe_users):
            assert CFG.turn_tokens <= agents.estimate_tokens(user) <= 1.3 * CFG.turn_tokens
    quick = agents.sessions(agents.TraceConfig(tenants=1, sessions=2, turns=2, prompt_tokens=600, turn_tokens=80))
    assert all(600 <= agents.estimate_tokens(s.system) <= 800 for s in quick)


def test_the_estimate_is_the_tokenizers_ratio():
    assert agents.estimate_tokens("x" * 46) == math.ceil(46 / agents.CHARS_PER_TOKEN) == 10
    assert agents.estimate_tokens("") == 0


def test_turns_grow_and_each_extends_the_last(sessions):
    s = sessions[0]
    answers = ["first answer", "second answer", "third"]
    prompts = [s.messages(t, answers[:t]) for t in range(CFG.turns)]
    for t, messages in enumerate(prompts):
        assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * t + ["user"]
        assert messages[-1]["content"] == s.users[t]
        if t:
            previous = prompts[t - 1]
            assert messages[:len(previous)] == previous  # the previous prompt is a prefix of this one
            assert messages[len(previous)] == {"role": "assistant", "content": answers[t - 1]}
            assert len("".join(m["content"] for m in messages)) > len("".join(m["content"] for m in previous))
    with pytest.raises(ValueError):
        s.messages(2, ["only one answer"])
    probe = s.messages(CFG.turns, answers, probe=1)
    assert probe[:-1] == prompts[-1][:-1] + [{"role": "user", "content": s.users[-1]},
                                             {"role": "assistant", "content": answers[-1]}]
    assert probe[-1]["content"] == s.probe_users[1] and s.probe_users[1] not in s.users


def test_sessions_differ_and_share_only_their_tenants_part(sessions):
    systems = [s.system for s in sessions]
    assert len(set(systems)) == len(systems)
    every_turn = [u for s in sessions for u in (*s.users, *s.probe_users)]
    assert len(set(every_turn)) == len(every_turn)  # every prompt is new: the exact store never has it

    def common(a: str, b: str) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    by_tenant: dict[str, list[str]] = {}
    for s in sessions:
        by_tenant.setdefault(s.tenant, []).append(s.system)
    shared = [common(a, b) for systems in by_tenant.values() for a in systems for b in systems if a is not b]
    assert all(0.1 * len(systems[0]) < n < 0.4 * len(systems[0]) for n in shared)  # shared_share 0.2
    across = common(by_tenant["agents-t0"][0], by_tenant["agents-t1"][0])
    assert across < 100  # two tenants share no more than the opening words


def test_tenants_keys_are_distinct_and_in_the_tenants_file():
    tenants = agents.tenants(CFG)
    assert [t.id for t in tenants] == ["agents-t0", "agents-t1"]
    keys = [t.key for t in tenants] + [agents.probe_tenant(CFG).key, agents.ADMIN_KEY]
    assert len(set(keys)) == len(keys)
    assert {t.key for t in agents.tenants(dataclasses.replace(CFG, seed=6))}.isdisjoint(keys)
    parsed = tomllib.loads(agents.tenants_toml(CFG))
    assert {t["id"]: t["keys"] for t in parsed["tenants"]} == {
        "agents-t0": [tenants[0].key], "agents-t1": [tenants[1].key], agents.PROBE_TENANT: [keys[2]]}
    assert parsed["admin"]["keys"] == [agents.ADMIN_KEY]
    assert "no-cache" in parsed["plans"]["agents"]["policies"]


def test_the_order_is_round_robin_by_turn_with_tenants_alternating(sessions):
    steps = agents.schedule(CFG)
    assert [s.seq for s in steps] == list(range(CFG.tenants * CFG.sessions * CFG.turns))
    assert [s.turn for s in steps] == sorted(s.turn for s in steps)
    for turn in range(CFG.turns):
        round_ = [s for s in steps if s.turn == turn]
        assert sorted(s.session for s in round_) == list(range(len(sessions)))  # every session once a round
    assert all(a.tenant != b.tenant for a, b in itertools.pairwise(steps))
    assert all(sessions[s.session].tenant == s.tenant for s in steps)
    assert [(s.tenant, sessions[s.session].index) for s in steps[:4]] == [
        ("agents-t0", 0), ("agents-t1", 0), ("agents-t0", 1), ("agents-t1", 1)]
    one = agents.schedule(dataclasses.replace(CFG, tenants=1, sessions=2, turns=2))
    assert [(s.turn, s.session) for s in one] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize(("turns", "restart"), [(1, 1), (2, 1), (3, 2), (4, 2), (5, 3)])
def test_the_restart_leaves_rounds_on_both_sides(turns, restart):
    assert agents.restart_round(dataclasses.replace(CFG, turns=turns)) == restart


def test_tier_of_reads_the_counters():
    before = {"prefix_cache_hits_ram": 3, "prefix_cache_hits_disk": 1}
    assert agents.tier_of(before, {"prefix_cache_hits_ram": 3, "prefix_cache_hits_disk": 2}, 500) == "disk"
    assert agents.tier_of(before, {"prefix_cache_hits_ram": 4, "prefix_cache_hits_disk": 2}, 500) == "disk"
    assert agents.tier_of(before, {"prefix_cache_hits_ram": 4, "prefix_cache_hits_disk": 1}, 500) == "ram"
    assert agents.tier_of(before, dict(before), 500) == "context"
    assert agents.tier_of(before, {"prefix_cache_hits_ram": 9, "prefix_cache_hits_disk": 9}, 0) == "miss"
    assert agents.tier_of({"prefix_cache_hits": 1}, {"prefix_cache_hits": 2}, 500) == "unknown"
    assert agents.tier_of(None, None, 500) == "unknown"


def rec(ttft: float, prompt: int, cached: int, tier: str, *, after: bool = False, engine: float | None = 1.0,
        prefix: int = 0, session: str = "t/s0", ok: bool = True) -> dict:
    return {"ttft_s": ttft, "prompt_tokens": prompt, "cached_tokens": cached, "tier": tier, "after_restart": after,
            "engine_s": engine, "prefix_tokens": prefix, "session": session, "ok": ok}


def test_summary_maths():
    records = [rec(10.0, 1000, 0, "miss", engine=10.0), rec(1.0, 1100, 1000, "ram", engine=0.5),
               rec(2.0, 1200, 1100, "disk", after=True, engine=1.5, prefix=1100),
               rec(99.0, 5000, 0, "miss", ok=False, engine=99.0)]  # a failed request counts nowhere
    s = agents.summarize(records)
    assert s["requests"] == 3
    assert s["ttft_p50_s"] == 2.0 and s["ttft_p99_s"] == 10.0
    assert s["engine_s"] == 12.0
    assert s["prompt_tokens"] == 3300 and s["cached_tokens"] == 2100 and s["cached_share"] == round(2100 / 3300, 4)
    assert s["tiers"] == {"disk": 1, "miss": 1, "ram": 1}
    assert agents.summarize([rec(1.0, 10, 0, "miss", engine=None)])["engine_s"] is None
    empty = agents.summarize([])
    assert empty["requests"] == 0 and empty["ttft_p50_s"] is None and empty["cached_share"] is None
    report = agents.phase_report(records, [rec(0.4, 1, 1, "ram"), rec(0.8, 1, 1, "ram"), rec(0.6, 1, 1, "ram"),
                                           rec(0.1, 1, 0, "miss")])
    assert report["after_restart"]["requests"] == 1 and report["after_restart"]["engine_s"] == 1.5
    assert report["ram_hit_ttft_s"] == 0.6  # nearest-rank median of the RAM probes, misses left out
    assert agents.phase_report(records, [rec(0.5, 1, 1, "unknown")])["ram_hit_ttft_s"] == 0.5
    assert agents.phase_report(records, [rec(0.5, 1, 1, "context")])["ram_hit_ttft_s"] is None
    assert agents.restart_turns(records) == [{"session": "t/s0", "tier": "disk", "ttft_s": 2.0,
                                              "prefix_tokens": 1100, "cached_tokens": 1100, "prefix_cached": 1.0}]


def phases_of(on: list[dict], off: list[dict], vllm: list[dict], probes: list[dict]) -> tuple[dict, dict]:
    records = {"tiers_on": on, "ram_only": off, "vllm": vllm}
    reports = {"tiers_on": agents.phase_report(on, probes), "ram_only": agents.phase_report(off),
               "vllm": agents.phase_report(vllm)}
    return reports, records


def test_goals_pass_and_fail_on_their_figures():
    off = [rec(30.0, 3000, 0, "miss", engine=30.0), rec(31.0, 3200, 0, "miss", engine=31.0, after=True)]
    vllm = [rec(20.0, 3000, 0, "miss", engine=20.0), rec(21.0, 3200, 0, "miss", engine=21.0, after=True)]
    probes = [rec(1.0, 3300, 3200, "ram")]
    good_on = [rec(30.0, 3000, 0, "miss", engine=28.0),
               rec(4.0, 3200, 2950, "disk", after=True, engine=1.0, prefix=3000, session="t/s0"),
               rec(5.0, 3200, 2800, "disk", after=True, engine=1.0, prefix=3000, session="t/s1")]
    reports, records = phases_of(good_on, off, vllm, probes)
    assert agents.goals(reports, records) == {"restart_turns_from_disk": True, "restart_ttft_le_5x_ram_hit": True,
                                              "engine_s_le_half_ram_only": True, "ttft_p50_below_vllm": True}
    # One session's turn after the restart caught under 90 % of its prefix, one from RAM, one too slow.
    for bad in (rec(4.0, 3200, 2600, "disk", after=True, prefix=3000), rec(4.0, 3200, 2950, "ram", after=True,
                                                                            prefix=3000)):
        reports, records = phases_of(good_on[:2] + [bad], off, vllm, probes)
        assert agents.goals(reports, records)["restart_turns_from_disk"] is False
    reports, records = phases_of(good_on[:2] + [rec(5.1, 3200, 2950, "disk", after=True, prefix=3000)], off, vllm,
                                 probes)
    assert agents.goals(reports, records)["restart_ttft_le_5x_ram_hit"] is False
    spendy = [rec(30.0, 3000, 0, "miss", engine=29.0)] + good_on[1:]
    reports, records = phases_of(spendy, off, vllm, probes)
    assert agents.goals(reports, records)["engine_s_le_half_ram_only"] is False  # 31 > 0.5 x 61
    fast_vllm = [rec(0.5, 3000, 0, "miss"), rec(0.5, 3200, 0, "miss", after=True)]
    reports, records = phases_of(good_on, off, fast_vllm, probes)
    assert agents.goals(reports, records)["ttft_p50_below_vllm"] is False


def test_goals_not_measured_are_none():
    on = [rec(4.0, 3200, 2950, "disk", after=True, prefix=3000)]
    assert set(agents.goals({}, {}).values()) == {None}
    reports = {"tiers_on": agents.phase_report(on, [])}
    out = agents.goals(reports, {"tiers_on": on})
    assert out["restart_turns_from_disk"] is True
    assert out["restart_ttft_le_5x_ram_hit"] is None  # no RAM-hit reference
    assert out["engine_s_le_half_ram_only"] is None and out["ttft_p50_below_vllm"] is None


def test_the_table_sets_the_phases_side_by_side():
    records = [rec(2.0, 1000, 0, "miss"), rec(1.0, 1000, 900, "disk", after=True, prefix=950)]
    text = agents.table({"vllm": agents.phase_report(records), "tiers_on": agents.phase_report(records),
                         "ram_only": agents.phase_report(records)})
    lines = text.splitlines()
    assert lines[0] == "| | tiers off (RAM only) | tiers on (RAM + disk) | vLLM (direct) |"
    assert all(line.count("|") == 5 for line in lines)
    rows = {line.strip("| ").split(" | ")[0]: line for line in lines[2:]}
    assert "45.0%" in rows["trace: cached share of prompt tokens"]
    assert "90.0%" in rows["after restart: cached share of prompt tokens"]
    assert "disk 1 / miss 1" in rows["trace: requests by tier"]
    assert Counter(rows["RAM-hit TTFT, probes (s)"].strip("| ").split(" | "))["-"] == 3
