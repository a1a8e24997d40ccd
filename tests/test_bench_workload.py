"""Smoke test of the headline benchmark's workload generator (edgecache/bench/workload.py): deterministic with a seed,
proportions roughly as configured, every request well-formed, mixed max_tokens, the FAQ held apart from the trace,
and the false-hit judge. No server, no model: fast."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from edgecache.bench import workload
from edgecache.semantic.learner import SemanticLearner

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
    seen_question, seen_group = set(), {}
    for r in reqs:
        if r.kind == "repeat":
            assert r.question() in seen_question  # word for word an earlier question
        elif r.kind == "paraphrase":
            assert r.question() not in seen_question  # other words ...
            assert r.group in seen_group.get(r.tenant, set())  # ... same intent / origin as an earlier request
        seen_question.add(r.question())
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
    counts = Counter(r.question() for r in reqs if r.kind == "repeat")
    assert max(counts.values()) > 5 * (sum(counts.values()) / len(counts))


def test_each_tenant_sends_a_few_max_tokens_and_questions_come_with_several(reqs):
    values = set(workload.WorkloadConfig().max_tokens)
    by_tenant: dict[str, set[int]] = {}
    by_question: dict[tuple, set[int]] = {}
    for r in reqs:
        by_tenant.setdefault(r.tenant, set()).add(r.max_tokens)
        by_question.setdefault(r.question(), set()).add(r.max_tokens)
    assert all(2 <= len(v) <= 3 and v <= values for v in by_tenant.values())
    assert len({frozenset(v) for v in by_tenant.values()}) > 1  # tenants differ (seed 7)
    assert sum(len(v) > 1 for v in by_question.values()) > 50  # the cache must serve across max_tokens
    one = workload.generate(workload.WorkloadConfig(requests=300, seed=7, max_tokens=(8,)))
    assert {r.max_tokens for r in one} == {8}


def test_the_faq_is_held_apart_from_the_trace_and_grouped_with_written_answers(reqs):
    cfg = workload.WorkloadConfig(requests=N, seed=7)
    taught, trace = workload.split_banking(cfg)
    assert set(taught) == set(trace) and len(taught) == 77
    for intent in taught:
        assert taught[intent] and trace[intent] and not set(taught[intent]) & set(trace[intent])
        n = len(taught[intent]) + len(trace[intent])
        assert abs(len(taught[intent]) - 0.7 * n) <= 1
    lines = workload.teaching_lines(cfg)
    asked = {r.text for r in reqs}
    banking = [t for t in workload.TENANTS if t.source == "banking77"]
    assert {x["tenant"] for x in lines} == {t.id for t in banking}
    assert len(lines) == len(banking) * sum(len(v) for v in taught.values())
    answers: dict[tuple[str, str], set[str]] = {}
    for x in lines:
        assert x["messages"][1]["content"] not in asked  # every trace question is a new phrasing
        assert "max_tokens" not in x and x["answer"] and x["group"] in taught
        answers.setdefault((x["tenant"], x["group"]), set()).add(x["answer"])
    assert all(len(v) == 1 for v in answers.values())  # one written answer per group
    assert len({a for v in answers.values() for a in v}) == len(answers)  # and no two groups share one
    for r in reqs:
        if r.scenario == "support":
            assert r.text in trace[r.group[4:]]
    other = workload.teaching_lines(workload.WorkloadConfig(requests=N, seed=8))
    assert {x["messages"][1]["content"] for x in other} != {x["messages"][1]["content"] for x in lines}


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
        assert body["temperature"] == 0 and body["stream"] is True and body["max_tokens"] in (8, 12, 16, 24, 32)
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
    largest = {t: max(r.max_tokens for r in reqs if r.tenant == t) for t in {r.tenant for r in reqs}}
    assert all("answer" not in x and x["max_tokens"] == largest[x["tenant"]] for x in lines)
    import tomllib

    parsed = tomllib.loads(workload.tenants_toml())
    assert "bypass" in parsed["plans"]["bench"]["policies"]
    assert {t["id"] for t in parsed["tenants"]} == {t.id for t in workload.TENANTS}
    assert all(len(k) >= 8 for t in parsed["tenants"] for k in t["keys"])


def test_the_judge_tells_right_hits_from_false_ones():
    def req(idx: int, tenant: str, group: str, text: str, max_tokens: int = 8) -> workload.Request:
        return workload.Request(idx=idx, t=0.0, tenant=tenant, scenario="support", system="s", text=text,
                                group=group, kind="new", max_tokens=max_tokens)

    reqs = [req(0, "a", "b77:card_arrival", "where is my card", 32), req(1, "a", "b77:card_arrival", "card not here"),
            req(2, "a", "b77:top_up_failed", "top up failed"), req(3, "b", "b77:card_arrival", "my card?"),
            req(4, "a", "b77:card_arrival", "card arrival?"), req(5, "a", "b77:top_up_failed", "top-up broke"),
            req(6, "a", "b77:card_arrival", "my card is late")]  # its off-phase request failed: no answer
    answer_of = {0: "Your card is on its way to you.", 1: "Cards take a week.", 2: "Try the top up again.",
                 3: "Member, your card is coming.", 4: "Cards take a few days.", 5: "Top ups can fail."}
    by_group = workload.group_answers(reqs, answer_of)
    written = {("a", "b77:top_up_failed"): "Top up failed: Acme Bank can help with this."}

    def hit(idx: int, answer: str, outcome: str = "semantic") -> dict:
        return {"idx": idx, "outcome": outcome, "answer": answer, "similarity": "0.95"}

    results = [
        hit(1, "Cards take a week.", "exact"),  # the engine's own answer
        hit(4, "Your card is on its way"),  # another request of its group's answer, cut at its max_tokens
        hit(4, "Try the top up again."),  # another group's answer: false
        hit(4, "Member, your card is coming."),  # another tenant's answer of the same intent: false
        hit(5, "Top up failed: Acme"),  # the group's written answer, cut
        hit(2, "Top up failed: Acme Bank can help with this.", "exact"),  # a repeat of that semantic hit
        hit(1, "Top up failed: Acme"),  # another group's written answer: false
        hit(6, "Try the top up again."),  # not its group's, but the engine's own answer to it is not known
        {"idx": 2, "outcome": "miss", "answer": "anything", "similarity": None},  # misses are not judged
    ]
    without = workload.judge_hits(reqs, results, answer_of, by_group)
    assert without["semantic_hits"] == 6 and without["hits"] == 8 and without["unjudged"] == 1
    # Without the written answers (cold and warm phases), the taught answer is nobody's.
    assert without["false"] == 4 and without["false_all"] == 5
    judged = workload.judge_hits(reqs, results, answer_of, by_group, written)
    assert judged["false"] == 3 and judged["true"] == 2 and judged["false_all"] == 3
    assert judged["by_outcome"]["exact"] == {"hits": 2, "false": 0, "identical_to_engine": 1, "unjudged": 0}
    assert judged["false_rate"] == 0.5 and judged["false_rate_all"] == round(3 / 8, 4) and judged["unjudged"] == 1
    assert {e["answer"] for e in judged["examples"]} == {"Try the top up again.", "Member, your card is coming.",
                                                         "Top up failed: Acme"}


def test_the_offline_replay_of_the_taught_phase_judges_what_the_learner_serves(tmp_path):
    # A small bank (six intents of 36 questions) whose intents "a" and "b" mean nearly the same to the embedder and
    # are warmed in different sends: taught send by send, neither learns the other's questions come near, and "b"'s
    # questions are served "a"'s answer; taught against the lines sent before, none is.
    for name in ("gptcache_mock_data.json", "mooncake_conversation_trace.jsonl"):
        (tmp_path / name).symlink_to(workload.DATA_DIR / name)
    words = [f"{a} {b}" for a in ("card", "transfer", "refund", "limit", "account", "statement")
             for b in ("please", "today", "now", "again", "soon", "here")]
    intents = ("a", "b", "c", "d", "e", "f")
    with (tmp_path / "banking77_train.csv").open("w") as f:
        f.write("text,category\n" + "".join(f"help with my {w} {i},{i}\n" for i in intents for w in words))
    cfg = workload.WorkloadConfig(requests=600, seed=3, data_dir=tmp_path)
    reqs = workload.generate(cfg)
    rng = np.random.default_rng(0)
    direction = {i: rng.normal(size=32) for i in intents}
    direction["b"] = direction["a"] + rng.normal(scale=0.05, size=32)
    texts = {line["messages"][-1]["content"]: line["group"] for line in workload.teaching_lines(cfg)}
    texts.update((r.text, r.group[4:]) for r in reqs if r.group.startswith("b77:"))
    vectors = {}
    for text, intent in sorted(texts.items()):
        v = direction[intent] + rng.normal(scale=0.35, size=32)
        vectors[text] = (v / np.linalg.norm(v)).astype(np.float32)
    lines = workload.teaching_lines(cfg)
    sends = [[x for x in lines if x["group"] in part] for part in (("a", "c", "e"), ("b", "d", "f"))]
    banking = [r for r in reqs if r.group.startswith("b77:")]
    out = {}
    for apart in (True, False):
        out[apart] = workload.replay_taught(reqs, sends, vectors.__getitem__, SemanticLearner(), target=0.01,
                                            prior_cut=0.85, apart=apart)
        tenants = out[apart]["tenants"].values()
        assert out[apart]["lookups"] + sum(t.get("exact", 0) for t in tenants) == len(banking)
        assert out[apart]["wrong"] <= out[apart]["served"] <= out[apart]["lookups"]
    assert out[True]["wrong"] > 0 and all(e["served_group"] in ("b77:a", "b77:b")
                                          for t in out[True]["tenants"].values() for e in t["wrong_examples"])
    assert out[False]["wrong"] == 0 and out[False]["served"] > 0


def test_the_bounds_price_each_miss_at_its_own_cost():
    """The own-cost bound prices the requests a phase computed at their off-phase usage; the priced engine-seconds
    price a phase's calls at their own usage. A phase that hits only the cheap requests has a lower own-cost bound
    than 1/(1-h)."""
    fit = {"ready": True, "call_s": 0.1, "prefill_s_per_token": 0.01, "decode_s_per_token": 0.1}

    def res(idx, outcome, prompt=10, cached=0, completion=9):
        return {"idx": idx, "outcome": outcome, "prompt_tokens": prompt, "cached_tokens": cached,
                "completion_tokens": completion}

    # Off: request 0 is cheap (0.1 + 0.1 + 0.1 = 0.3 s), request 1 dear (0.1 + 0.1 + 2.0 = 2.2 s).
    off = [res(0, "miss", completion=1), res(1, "miss", completion=20)]
    assert workload.priced_s(off[0], fit) == pytest.approx(0.3)
    assert workload.priced_s({"idx": 0, "outcome": "miss", "completion_tokens": None}, fit) is None
    raw = {"off": off,
           "cheap_hit": [res(0, "exact"), res(1, "miss", cached=10, completion=20)],  # h = 0.5, 1/(1-h) = 2
           "dear_hit": [res(0, "miss"), res(1, "exact")]}
    bounds = workload.own_cost_bounds(raw, fit)
    assert bounds["off"] == pytest.approx(1.0)
    assert bounds["cheap_hit"] == pytest.approx(2.5 / 2.2, abs=1e-3)  # below 2: the hit was the cheap one
    assert bounds["dear_hit"] == pytest.approx(2.5 / 0.3, abs=1e-3)
    priced = workload.priced_engine_s(raw, fit)
    assert priced["off"] == pytest.approx(2.5)
    assert priced["cheap_hit"] == pytest.approx(0.1 + 0.0 + 2.0)  # its own usage: the prompt came from the prefix
    assert priced["dear_hit"] == pytest.approx(0.1 + 0.1 + 0.9)
    assert workload.own_cost_bounds(raw, {"ready": False}) == {name: None for name in raw}
