"""The seed-like mixed workload of the headline benchmark (scripts/bench_workload.py), reproducible with a seed.

Built only from the data folder (:data:`edgecache.bench.harness.DATA`; see SOURCES.txt there):
- banking77_train.csv (text,category): customer-service queries grouped by intent. A banking tenant's new request
  is a query of some intent; a paraphrase is another query of the same intent (its group is the intent).
- gptcache_mock_data.json ([{origin, similar}]): a knowledge tenant's new request is an origin; its paraphrase is
  the ChatGPT rewrite ("similar") of an origin asked earlier (its group is the pair's index).
- mooncake_conversation_trace.jsonl: arrival times (ms) of a real hour of LLM traffic; a window of consecutive
  timestamps is taken and scaled to the requested mean rate, keeping the trace's burstiness.

Request kinds (fractions of all requests, configurable): ``repeat`` (an earlier question again, word for word, drawn
Zipf by first-appearance rank, from any of its tenant's clients), ``paraphrase`` (same intent / origin as an earlier
request, other words), ``burst`` (a new request sent k times at the same instant: identical concurrent requests),
``new`` (the rest). Every tenant has its own shared system prompt; every request uses temperature 0.

``max_tokens`` is mixed as real clients send it: each tenant's clients use 2-3 of the configured values (drawn with
the seed), and each request (a repeat too) takes one of its tenant's, so one question arrives with several limits.

The FAQ split: each banking77 intent's texts are split, with the seed, into a taught part (``teach_share`` of them)
and a trace part; the trace draws its banking questions from the trace part only, so a tenant that teaches the
taught part (:func:`teaching_lines`, grouped by intent, each group with its written answer) meets the trace's
questions as new phrasings. The GPTCache-pairs tenants teach nothing (a pair has two phrasings, both in the trace).
"""

from __future__ import annotations

import csv
import json
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from edgecache.bench.harness import DATA as DATA_DIR
from edgecache.semantic.guard import check
from edgecache.semantic.learner import SemanticLearner
from edgecache.semantic.teaching import GroupedLines

MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Tenant:
    id: str
    key: str
    source: str  # "banking77" | "gptcache"
    scenario: str
    weight: float
    company: str
    system: str


def _tenant(id_: str, key: str, source: str, scenario: str, weight: float, company: str, role: str,
            rules: list[str]) -> Tenant:
    system = (f"You are the {role} of {company}. Answer in one or two short sentences, politely and precisely. "
              + " ".join(f"Rule {i + 1}: {r}" for i, r in enumerate(rules)))
    return Tenant(id_, key, source, scenario, weight, company, system)


TENANTS: tuple[Tenant, ...] = (
    _tenant("acme-bank", "sk-acme-bank-bench", "banking77", "support", 0.35,
        "Acme Bank", "customer support assistant",
        ["never ask for a full card number or a PIN.", ("for lost or stolen cards, tell the customer to freeze the "
         "card in the app first."), "transfers between Acme accounts are free; card top-ups take up to an hour.",
         "refer disputes to the disputes team."]),
    _tenant("globex-bank", "sk-globex-bank-bench", "banking77", "support", 0.25,
        "Globex Credit Union", "member services chatbot",
        ["members are called members, never customers.", "branch hours are 9 to 5 on weekdays.",
         "exchange rates are updated every minute on weekdays.", "do not give investment advice."]),
    _tenant("initech", "sk-initech-bench", "gptcache", "knowledge", 0.25,
        "Initech", "internal knowledge assistant",
        ["explain technical terms simply.", "prefer facts over opinions.", "cite no sources.",
         "say you are unsure when you are."]),
    _tenant("umbrella", "sk-umbrella-bench", "gptcache", "knowledge", 0.15,
        "Umbrella Labs", "research helpdesk",
        ["be concise.", "use metric units.", "avoid marketing language.", "answer in English."]),
)
ADMIN_KEY = "sk-admin-bench-0001"


@dataclass(frozen=True)
class Request:
    idx: int
    t: float  # arrival, seconds from the start of the run
    tenant: str
    scenario: str
    system: str
    text: str
    group: str  # the intent ("b77:card_arrival") or GPTCache pair ("gpt:17") the question belongs to
    kind: str  # new | repeat | paraphrase | burst
    burst: int = -1  # burst id, -1 when not in a burst
    max_tokens: int = 8

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.text}]

    def body(self, stream: bool = True) -> dict:
        return {"model": MODEL, "messages": self.messages(), "max_tokens": self.max_tokens, "temperature": 0,
                "stream": stream}

    def headers(self, policy: str | None = None) -> dict[str, str]:
        key = next(t.key for t in TENANTS if t.id == self.tenant)
        h = {"authorization": f"Bearer {key}", "x-edgecache-scenario": self.scenario}
        if policy:
            h["x-edgecache-policy"] = policy
        return h

    def identity(self) -> tuple[str, str, str, str, int]:
        """What makes two requests identical (the request's inputs, ``max_tokens`` included)."""
        return (*self.question(), self.max_tokens)

    def question(self) -> tuple[str, str, str, str]:
        """What makes two requests ask the same question (whatever ``max_tokens`` their clients send)."""
        return (self.tenant, self.scenario, self.system, self.text)


@dataclass
class WorkloadConfig:
    requests: int = 5000
    seed: int = 0
    repeat: float = 0.40
    paraphrase: float = 0.20
    burst: float = 0.10
    burst_size: tuple[int, int] = (3, 6)
    zipf_s: float = 1.0
    rate: float = 50.0  # mean offered requests/s after scaling the Mooncake timestamps
    max_tokens: tuple[int, ...] = (8, 12, 16, 24, 32)  # the values clients send; each tenant's use 2-3 of them
    teach_share: float = 0.7  # of each banking77 intent's texts: the tenants' FAQ, never in the trace
    data_dir: Path = field(default_factory=lambda: DATA_DIR)


def load_banking(data_dir: Path) -> dict[str, list[str]]:
    by_intent: dict[str, list[str]] = defaultdict(list)
    with open(data_dir / "banking77_train.csv", newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            text = " ".join(row["text"].split())
            if text:
                by_intent[row["category"]].append(text)
    return {k: sorted(set(v)) for k, v in sorted(by_intent.items())}


def load_pairs(data_dir: Path) -> list[tuple[str, str]]:
    pairs = json.loads((data_dir / "gptcache_mock_data.json").read_text(encoding="utf-8"))
    seen, out = set(), []
    for p in pairs:  # one pair per distinct origin, so an origin's group is unambiguous
        origin, similar = " ".join(p["origin"].split()), " ".join(p["similar"].split())
        if origin and similar and origin not in seen and origin != similar:
            seen.add(origin)
            out.append((origin, similar))
    return out


def load_arrivals(data_dir: Path, n: int, rng: random.Random, rate: float) -> list[float]:
    stamps = []
    with open(data_dir / "mooncake_conversation_trace.jsonl", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                stamps.append(json.loads(line)["timestamp"] / 1000.0)
    stamps.sort()
    start = rng.randrange(0, max(1, len(stamps) - n))
    window = []
    for i in range(n):  # wraps around (shifted by the trace's length) when n exceeds the trace
        j = start + i
        window.append(stamps[j % len(stamps)] + (j // len(stamps)) * (stamps[-1] + 1.0))
    t0 = window[0]
    rel = [t - t0 for t in window]
    span = rel[-1] if rel[-1] > 0 else 1.0
    target = n / rate if rate > 0 else 0.0
    return [r / span * target for r in rel]


def split_banking(cfg: WorkloadConfig) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(taught, trace): each banking77 intent's texts split with the seed, ``cfg.teach_share`` of them taught (at
    least one text of each intent is left to the trace)."""
    rng = random.Random(f"faq-split-{cfg.seed}")
    taught, trace = {}, {}
    for intent, texts in load_banking(cfg.data_dir).items():
        shuffled = rng.sample(texts, len(texts))
        cut = min(len(texts) - 1, round(cfg.teach_share * len(texts)))
        taught[intent], trace[intent] = sorted(shuffled[:cut]), sorted(shuffled[cut:])
    return taught, trace


def tenant_max_tokens(cfg: WorkloadConfig, rng: random.Random) -> dict[str, list[int]]:
    """Each tenant's clients' ``max_tokens`` values: 2-3 of ``cfg.max_tokens`` (all of them when fewer)."""
    values = sorted(set(cfg.max_tokens))
    return {t.id: sorted(rng.sample(values, min(len(values), rng.randint(2, 3)))) for t in TENANTS}


def generate(cfg: WorkloadConfig) -> list[Request]:
    """The workload: ``cfg.requests`` requests, in arrival order, a pure function of ``cfg``."""
    rng = random.Random(cfg.seed)
    banking = split_banking(cfg)[1]
    intents = list(banking)
    limits = tenant_max_tokens(cfg, rng)
    unused_b = {k: rng.sample(v, len(v)) for k, v in banking.items()}  # shuffled, popped from the end
    pairs = load_pairs(cfg.data_dir)
    pair_order = rng.sample(range(len(pairs)), len(pairs))
    # Intents are themselves skewed (a few intents dominate real support traffic): Zipf over a shuffled order.
    intent_w = [1.0 / (r + 1) ** 0.8 for r in range(len(intents))]
    intent_rank = rng.sample(intents, len(intents))
    tenants = list(TENANTS)
    tenant_w = [t.weight for t in tenants]

    distinct: list[Request] = []  # first appearances, the pool repeats draw from (Zipf by rank)
    asked: dict[str, list[Request]] = defaultdict(list)  # tenant -> its distinct requests (paraphrase sources)
    out: list[dict] = []
    n_bursts = 0
    p_new = max(0.0, 1.0 - cfg.repeat - cfg.paraphrase - cfg.burst)
    kinds = ["repeat", "paraphrase", "burst", "new"]
    weights = [cfg.repeat, cfg.paraphrase, cfg.burst / ((cfg.burst_size[0] + cfg.burst_size[1]) / 2), p_new]

    def new_item(tenant: Tenant) -> tuple[str, str] | None:
        if tenant.source == "banking77":
            for _ in range(20):
                intent = rng.choices(intent_rank, intent_w)[0]
                if unused_b[intent]:
                    return unused_b[intent].pop(), f"b77:{intent}"
            return None
        while pair_order:
            i = pair_order.pop()
            return pairs[i][0], f"gpt:{i}"
        return None

    def paraphrase_of(src: dict) -> tuple[str, str] | None:
        group = src["group"]
        if group.startswith("b77:"):
            pool = unused_b[group[4:]]
            return (pool.pop(), group) if pool else None
        i = int(group[4:])
        similar = pairs[i][1]
        if any(d["text"] == similar and d["tenant"] == src["tenant"] for d in asked[src["tenant"]]):
            return None
        return similar, group

    def add(tenant: Tenant, text: str, group: str, kind: str, burst: int = -1, first: bool = True,
            max_tokens: int | None = None) -> dict:
        item = {"tenant": tenant.id, "scenario": tenant.scenario, "system": tenant.system, "text": text,
                "group": group, "kind": kind, "burst": burst,
                "max_tokens": max_tokens or rng.choice(limits[tenant.id])}
        out.append(item)
        if first:
            distinct.append(item)
            asked[tenant.id].append(item)
        return item

    while len(out) < cfg.requests:
        kind = rng.choices(kinds, weights)[0]
        tenant = rng.choices(tenants, tenant_w)[0]
        if kind == "repeat" and distinct:
            w = [1.0 / (r + 1) ** cfg.zipf_s for r in range(len(distinct))]
            src = rng.choices(distinct, w)[0]
            out.append({**src, "kind": "repeat", "burst": -1, "max_tokens": rng.choice(limits[src["tenant"]])})
            continue
        if kind == "paraphrase" and asked[tenant.id]:
            src = rng.choice(asked[tenant.id])
            made = paraphrase_of(src)
            if made:
                add(tenant, made[0], made[1], "paraphrase")
                continue
        made = new_item(tenant)
        if made is None:
            continue
        if kind == "burst":
            k = min(rng.randint(*cfg.burst_size), cfg.requests - len(out))
            first = add(tenant, made[0], made[1], "burst", n_bursts)
            for _ in range(k - 1):
                add(tenant, made[0], made[1], "burst", n_bursts, first=False, max_tokens=first["max_tokens"])
            n_bursts += 1
        else:
            add(tenant, made[0], made[1], "new")

    out = out[:cfg.requests]
    times = load_arrivals(cfg.data_dir, len(out), rng, cfg.rate)
    reqs = []
    for i, item in enumerate(out):
        t = times[i]
        if item["burst"] >= 0 and i > 0 and out[i - 1]["burst"] == item["burst"]:
            t = reqs[-1].t  # a burst's members arrive together
        reqs.append(Request(idx=i, t=t, **item))
    return reqs


def warmup_lines(reqs: list[Request]) -> list[dict]:
    """A prompts file built from the pool: each distinct new question (not the paraphrases), as `edgecache warmup`
    lines without answers, so the warmup runs them through the engine, at the largest ``max_tokens`` its tenant's
    clients send (an answer computed at the largest serves the smaller ones, cut)."""
    largest: dict[str, int] = {}
    for r in reqs:
        largest[r.tenant] = max(largest.get(r.tenant, 0), r.max_tokens)
    seen, lines = set(), []
    for r in reqs:
        if r.kind in ("new", "burst") and r.question() not in seen:
            seen.add(r.question())
            lines.append({"messages": r.messages(), "scenario": r.scenario, "tenant": r.tenant,
                          "max_tokens": largest[r.tenant]})
    return lines


def faq_answer(tenant: Tenant, intent: str) -> str:
    """The written answer of a banking tenant's FAQ group: it opens with the intent's own words (so even its first
    few tokens name the group) and is longer than most clients' ``max_tokens`` (so it is served cut, too)."""
    words = intent.strip("?").replace("_", " ")
    return (f"{words[0].upper()}{words[1:]}: {tenant.company} can help with this. In the app, open Help, choose "
            f"\"{words}\" and follow the steps shown there. If that does not settle it, reply here and a member of "
            f"our team will take it from there.")


def teaching_lines(cfg: WorkloadConfig) -> list[dict]:
    """The banking tenants' FAQs as a prompts file: every taught text of :func:`split_banking` (none of them in the
    trace), one line each, grouped by intent, each line with its group's written answer (:func:`faq_answer`) and no
    ``max_tokens`` (a written answer serves every client's limit). The GPTCache-pairs tenants teach nothing."""
    taught = split_banking(cfg)[0]
    lines = []
    for t in TENANTS:
        if t.source != "banking77":
            continue
        for intent, texts in taught.items():
            answer = faq_answer(t, intent)
            lines += [{"messages": [{"role": "system", "content": t.system}, {"role": "user", "content": text}],
                       "scenario": t.scenario, "tenant": t.id, "group": intent, "answer": answer} for text in texts]
    return lines


HITS = ("exact", "semantic", "shared")


def group_answers(reqs: list[Request], answer_of: dict[int, str]) -> dict[tuple[str, str], set[str]]:
    """(tenant, group) -> the engine's answers (phase 1) to the group's requests."""
    out: dict[tuple[str, str], set[str]] = defaultdict(set)
    for idx, answer in answer_of.items():
        out[(reqs[idx].tenant, reqs[idx].group)].add(answer)
    return out


def judge_hits(reqs: list[Request], results: list[dict], answer_of: dict[int, str],
               by_group: dict[tuple[str, str], set[str]], written: dict[tuple[str, str], str] | None = None) -> dict:
    """Every hit of a phase judged: right when its answer is the engine's answer to
    that request, or the beginning of an answer of the query's own group (``by_group``, plus the group's written
    answer in ``written``); otherwise false, unless the engine's answer to the query's question is not known (each
    of its requests failed in the off phase): then it is counted ``unjudged``. ``false`` and ``semantic_hits``
    count the semantic hits (the layer that can be wrong); ``by_outcome`` counts every hit, exact ones included (a
    semantic hit is stored under its query's key, so a repeat of it is an exact hit of the same answer)."""
    known = {reqs[idx].question() for idx in answer_of}
    written = written or {}
    answers_of_tenant: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for (tenant, group), answers in by_group.items():
        answers_of_tenant[tenant] += [(a, group) for a in answers]
    for (tenant, group), answer in written.items():
        answers_of_tenant[tenant].append((answer, group))
    by_outcome = {o: {"hits": 0, "false": 0, "identical_to_engine": 0, "unjudged": 0} for o in HITS}
    shared = 0
    examples = []
    for r in results:
        if r["outcome"] not in HITS:
            continue
        q, answer = reqs[r["idx"]], r["answer"]
        row = by_outcome[r["outcome"]]
        row["hits"] += 1
        if answer == answer_of.get(r["idx"]):
            row["identical_to_engine"] += 1
            continue
        own = by_group.get((q.tenant, q.group), set()) | ({written[(q.tenant, q.group)]}
                                                           if (q.tenant, q.group) in written else set())
        if any(a.startswith(answer) for a in own):
            shared += any(g != q.group and a.startswith(answer) for a, g in answers_of_tenant[q.tenant])
            continue
        if q.question() not in known:
            row["unjudged"] += 1
            continue
        row["false"] += 1
        if len(examples) < 5:
            examples.append({"outcome": r["outcome"], "query": q.text, "tenant": q.tenant, "group": q.group,
                             "max_tokens": q.max_tokens, "answer": answer, "similarity": r["similarity"],
                             "answer_groups": sorted({g for a, g in answers_of_tenant[q.tenant]
                                                      if a.startswith(answer)})[:3]})
    sem = by_outcome["semantic"]
    hits = sum(row["hits"] for row in by_outcome.values())
    wrong = sum(row["false"] for row in by_outcome.values())
    return {"semantic_hits": sem["hits"], "true": sem["hits"] - sem["false"] - sem["unjudged"], "false": sem["false"],
            "false_rate": round(sem["false"] / sem["hits"], 4) if sem["hits"] else 0.0,
            "hits": hits, "false_all": wrong, "false_rate_all": round(wrong / hits, 4) if hits else 0.0,
            "unjudged": sum(row["unjudged"] for row in by_outcome.values()),
            "true_but_shared_answer": shared, "by_outcome": by_outcome, "examples": examples}


def tenants_toml() -> str:
    lines = ['[plans.bench]', 'store_bytes = "1GB"', 'max_concurrent_misses = 2',
             'policies = ["default", "no-store", "no-cache", "exact-only", "bypass", "reuse"]', '']
    for t in TENANTS:
        lines += ["[[tenants]]", f'id = "{t.id}"', 'plan = "bench"', f'keys = ["{t.key}"]', ""]
    lines += ["[admin]", f'keys = ["{ADMIN_KEY}"]', ""]
    return "\n".join(lines)


def summary(reqs: list[Request]) -> dict:
    kinds: dict[str, int] = defaultdict(int)
    tenants: dict[str, int] = defaultdict(int)
    for r in reqs:
        kinds[r.kind] += 1
        tenants[r.tenant] += 1
    n = len(reqs)
    return {"requests": n, "distinct": len({r.identity() for r in reqs}),
            "distinct_questions": len({r.question() for r in reqs}),
            "max_tokens": {t: sorted({r.max_tokens for r in reqs if r.tenant == t}) for t in sorted(tenants)},
            "kinds": {k: round(v / n, 3) for k, v in sorted(kinds.items())},
            "tenants": {k: round(v / n, 3) for k, v in sorted(tenants.items())},
            "bursts": len({r.burst for r in reqs if r.burst >= 0}),
            "duration_s": round(reqs[-1].t, 1) if reqs else 0.0}


def to_jsonl(reqs: list[Request]) -> str:
    return "".join(json.dumps(asdict(r)) + "\n" for r in reqs)


class _Done(Exception):
    pass


def _usage(rec: dict, usage: dict) -> None:
    """The answer's token counts, as the server reported them, into ``rec``."""
    rec["prompt_tokens"] = usage.get("prompt_tokens")
    rec["completion_tokens"] = usage.get("completion_tokens")
    rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


async def send(client, url: str, req, policy: str | None, *, stream: bool = True) -> dict:
    """One request of the workload (streamed unless ``stream`` is off), as a record: its outcome (the server's
    ``x-edgecache``, ``rejected`` or ``error``), similarity, time to first token, latency and answer."""
    t0 = time.perf_counter()
    ttft = None
    parts = []
    rec = {"idx": req.idx, "status": 0, "outcome": "error", "similarity": None}
    try:
        if not stream:  # TTFT is then the whole answer's latency
            r = await client.post(url + "/v1/chat/completions", json=req.body(stream=False),
                                  headers=req.headers(policy))
            rec["status"] = r.status_code
            rec["outcome"] = r.headers.get("x-edgecache", "error") if r.status_code == 200 else (
                "rejected" if r.status_code == 429 else "error")
            rec["similarity"] = r.headers.get("x-edgecache-similarity")
            if r.status_code == 200:
                parts.append(r.json()["choices"][0]["message"]["content"] or "")
                _usage(rec, r.json().get("usage") or {})
            raise _Done
        body = {**req.body(stream=True), "stream_options": {"include_usage": True}}  # not part of the key
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=req.headers(policy)) as r:
            rec["status"] = r.status_code
            rec["outcome"] = r.headers.get("x-edgecache", "error") if r.status_code == 200 else (
                "rejected" if r.status_code == 429 else "error")
            rec["similarity"] = r.headers.get("x-edgecache-similarity")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["outcome"] = "error"
                    continue
                if chunk.get("usage"):
                    _usage(rec, chunk["usage"])
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        parts.append(text)
    except _Done:
        pass
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        rec["outcome"] = "error"
        rec["exc"] = repr(exc)[:200]
    rec["latency_s"] = time.perf_counter() - t0
    rec["ttft_s"] = ttft if ttft is not None else rec["latency_s"]
    rec["answer"] = "".join(parts)
    return rec


def replay_taught(reqs: list[Request], sends: list[list[dict]], vector_of: Callable[[str], np.ndarray],
                  learner: SemanticLearner, *, target: float, prior_cut: float, labels: bool = False,
                  apart: bool = False) -> dict:
    """The taught phase's semantic lookups of the banking tenants, through the server's learner alone (no server, no
    engine): each of ``sends`` (the FAQ's lines as ``edgecache warmup`` sends them) is taught as the server teaches a
    send (:class:`~edgecache.semantic.teaching.GroupedLines` of each tenant's index, on float16 vectors as the index
    keeps them; ``apart``: each send on its own lines only, without naming its variants), then the trace is asked.
    A question asked before is an exact hit (its answer was stored); any other is looked up: the nearest of the
    tenant's index (the FAQ, and every question the engine answered so far), past the guard, decided as a box whose
    engine is busy decides, as the benchmark's is: no exploration (an unsure candidate on its point estimate) and no
    label (a busy box labels no refusal; ``labels``: every refused candidate labelled with the truth instead, as a box
    whose labeler can tell). A served candidate is wrong when its group is not the query's. Simplified: a stored
    answer serves every ``max_tokens`` of its question, and a question in flight is already stored."""
    out: dict = {"tenants": {}}
    for tenant in [t for t in TENANTS if t.source == "banking77"]:
        grouped = GroupedLines()
        keys: list[str] = []
        texts: list[str] = []
        groups: list[str] = []
        for send in sends:
            mine = [(line["messages"][-1]["content"], line["group"]) for line in send if line["tenant"] == tenant.id]
            if not mine:
                continue
            for text, group in mine:
                keys.append(f"faq:{text}")
                texts.append(text)
                groups.append(f"b77:{group}")
            vectors = {f"faq:{text}": vector_of(text).astype(np.float16).astype(np.float32) for text, _ in mine}
            if apart:
                taught = GroupedLines().add(list(vectors), [group for _, group in mine], vectors)
                learner.teach(tenant.id, tenant.scenario, taught.classes, taught.labels, prior_cut=prior_cut)
            else:
                vectors.update((key, vector_of(key[4:]).astype(np.float16).astype(np.float32))
                               for key in grouped.lines())
                taught = grouped.add([f"faq:{text}" for text, _ in mine], [group for _, group in mine], vectors)
                learner.teach(tenant.id, tenant.scenario, taught.classes, taught.labels, variants=taught.variants,
                              prior_cut=prior_cut)
        matrix = np.stack([vector_of(text) for text in texts]).astype(np.float16).astype(np.float32)
        answered: set[str] = set()
        counts: dict[str, int] = defaultdict(int)
        wrong: list[dict] = []
        for r in reqs:
            if r.tenant != tenant.id:
                continue
            if r.text in answered:
                counts["exact"] += 1
                continue
            answered.add(r.text)
            counts["lookups"] += 1
            query = vector_of(r.text)
            similarities = matrix @ query
            j = int(np.argmax(similarities))
            similarity = float(similarities[j])
            right = groups[j] == r.group
            if not check(r.text, texts[j]).allowed:
                counts["guard"] += 1
                decision = None
            else:
                decision = learner.decide(tenant.id, tenant.scenario, keys[j], similarity, target,
                                          prior_cut=prior_cut, may_explore=False)
                counts[f"{decision.action}:{decision.reason}"] += 1
            if decision is not None and decision.action == "serve":
                counts["served"] += 1
                if not right:
                    counts["wrong"] += 1
                    wrong.append({"query": r.text, "group": r.group, "served_group": groups[j],
                                  "similarity": round(similarity, 3), "error": round(decision.error, 4)})
                continue
            if decision is not None and labels:
                learner.record(tenant.id, tenant.scenario, keys[j], similarity, right, prior_cut=prior_cut,
                               decision=decision)
                if right:
                    learner.link(tenant.id, tenant.scenario, f"trace:{r.idx}", keys[j])
            keys.append(f"trace:{r.idx}")
            texts.append(r.text)
            groups.append(r.group)
            matrix = np.vstack([matrix, query.astype(np.float16).astype(np.float32)[None]])
        state = learner.taught_state(tenant.id, tenant.scenario, target)
        out["tenants"][tenant.id] = {**dict(sorted(counts.items())), "wrong_examples": wrong[:5],
                                     "taught": state.describe() if state else None}
    lookups = sum(t["lookups"] for t in out["tenants"].values())
    served = sum(t.get("served", 0) for t in out["tenants"].values())
    bad = sum(t.get("wrong", 0) for t in out["tenants"].values())
    out.update(lookups=lookups, served=served, wrong=bad, hit_rate=round(served / lookups, 4) if lookups else 0.0,
               wrong_per_lookup=round(bad / lookups, 4) if lookups else 0.0,
               wrong_per_hit=round(bad / served, 4) if served else 0.0)
    return out


def priced_s(result: dict, fit: dict) -> float | None:
    """What one request's engine call costs by the ledger's ``fit`` (a call, its prompt tokens computed, its
    completion tokens) at the usage recorded for it; None where none was."""
    if result.get("completion_tokens") is None:
        return None
    return (fit["call_s"] + fit["prefill_s_per_token"] * (result["prompt_tokens"] - result["cached_tokens"])
            + fit["decode_s_per_token"] * result["completion_tokens"])


def own_cost_bounds(raw: dict[str, list[dict]], fit: dict) -> dict[str, float | None]:
    """Each phase's bound with hits free and each miss as costly as its request was with caches off: the off phase's
    engine-seconds for the whole trace over its seconds for the requests the phase computed, each request priced
    by :func:`priced_s` at its off-phase usage. Unlike 1/(1-h) it does not assume the misses cost what an average
    request does (a taught FAQ serves short answers and leaves the longer ones to the engine)."""
    if not fit.get("ready"):
        return {name: None for name in raw}
    cost = {r["idx"]: c for r in raw["off"] if (c := priced_s(r, fit)) is not None}
    total = sum(cost.values())
    bounds: dict[str, float | None] = {}
    for name, results in raw.items():
        missed = sum(cost.get(r["idx"], 0.0) for r in results if r["outcome"] == "miss")
        bounds[name] = round(total / missed, 3) if missed else None
    return bounds


def priced_engine_s(raw: dict[str, list[dict]], fit: dict) -> dict[str, float | None]:
    """Each phase's engine calls priced by :func:`priced_s` at their own usage in that phase: the engine-seconds they
    would have taken at the speed ``fit`` was measured at (the off phase's). A phase's measured engine-seconds over
    this is the engine's speed in that phase, from its own calls (it also moves where calls cost what the fit does
    not see: the same figure in every phase of a run says neither moved)."""
    if not fit.get("ready"):
        return {name: None for name in raw}
    out: dict[str, float | None] = {}
    for name, results in raw.items():
        out[name] = sum(c for r in results if r["outcome"] == "miss" and (c := priced_s(r, fit)) is not None) or None
    return out
