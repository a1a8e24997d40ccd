"""A fleet behind SGLang's router against one node: what routing by prefix keeps of the engines' KV prefix cache.

The same workload runs three times, each on fresh ``edgecache serve --profile cpu`` nodes (llama.cpp and SmolLM2,
each node its own data dir; the nodes of a run share one redis-server, a fresh database per arm):

1. ``one node``: the node alone, the client talking to it directly;
2. ``cache_aware``: N nodes behind ``python -m sglang_router.launch_router --policy cache_aware``;
3. ``round_robin``: N nodes behind the same router with ``--policy round_robin``.

The workload: T tenants, each with its own long system prompt (``system_tokens`` of SmolLM2's tokenizer, counted
with the model's own vocabulary), each asking questions no other request asks, so the exact and semantic layers
have nothing to serve (the semantic layer is off): every answer is computed by an engine, and what is measured is
the engines' prefix cache. Requests are streamed, ``concurrency`` at a time, tenants in a shuffled order.

Per arm: the engines' prefix-cache hit ratio (cached prompt tokens over prompt tokens, the nodes' own counters
summed over the nodes), TTFT p50 and p99 at the client, requests refused (429, 503) or failed, and the checks that
nothing went to the wrong tenant:

- every request was answered, by an engine (no cache layer served a question asked once);
- the nodes counted each tenant's requests under that tenant, as many as the client sent with its key;
- every tenant paid a cold prefill of its own (its smallest ``cached_tokens`` is 0): all system prompts open with
  the same words, so a prefix cache shared across tenants would have handed a tenant another's opening;
- each answer's ``prompt_tokens`` is what the same request counted on the node alone: the answer was computed on
  that request's own tenant's prompt;
- the prompt and cached tokens the answers report add up to what the nodes counted.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from edgecache.bench.harness import free_port, percentile, start_server, wait_ready

MODEL = "SmolLM2-135M-Instruct"
ADMIN_KEY = "sk-admin-fleet-router-01"
ARMS = ("one node", "cache_aware", "round_robin")
# Every tenant's system prompt opens with these words: a prefix cache shared across tenants would serve them.
PREAMBLE = ("You are the customer support assistant of the company named below. Answer every question in one or "
            "two short sentences, using only the policies listed here, and say so when no policy covers it. ")

COMPANIES = ["Acme Rockets", "Globex Freight", "Initech Payroll", "Umbrella Pharmacy", "Hooli Cloud", "Stark Energy",
             "Wayne Logistics", "Tyrell Robotics", "Cyberdyne Security", "Soylent Foods", "Oscorp Labs",
             "Wonka Confectionery"]
PRODUCTS = ["starter kits", "spare parts", "annual plans", "gift cards", "premium bundles", "refill packs",
            "travel cases", "extended warranties", "monthly boxes", "repair vouchers", "charging docks", "manuals"]
REGIONS = ["the north", "the south", "the coast", "the islands", "the capital", "the mountains", "abroad",
           "the east", "the west", "the valley"]
CHANNELS = ["email", "phone", "chat", "post", "the app", "a branch visit"]
TOPICS = ["delivery times", "returns", "refunds", "warranty claims", "invoices", "discounts", "cancellations",
          "exchanges", "lost parcels", "damaged goods", "account changes", "opening hours", "payment methods",
          "loyalty points", "price matching", "gift wrapping"]
ASKS = ["How long do {t} take for {p} sent to {r}?", "What is the rule on {t} for {p} ordered from {r}?",
        "Can I arrange {t} for {p} from {r} by {c}?", "Who handles {t} for {p} in {r}?",
        "Is there a fee for {t} on {p} shipped to {r}?", "What do I need for {t} of {p} bought in {r}?"]


@dataclass(frozen=True)
class FleetConfig:
    nodes: int = 2
    tenants: int = 4
    requests: int = 80  # per arm, over all tenants
    concurrency: int = 4
    system_tokens: int = 1100
    max_tokens: int = 16
    seed: int = 0
    redis: bool = True


@dataclass(frozen=True)
class Tenant:
    id: str
    key: str
    system: str
    system_tokens: int


@dataclass(frozen=True)
class Ask:
    idx: int
    tenant: Tenant
    question: str
    max_tokens: int

    def body(self) -> dict[str, Any]:
        return {"model": MODEL, "messages": [{"role": "system", "content": self.tenant.system},
                                             {"role": "user", "content": self.question}],
                "max_tokens": self.max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.tenant.key}"}


def smollm2_token_counter() -> Callable[[str], int]:
    """How many tokens SmolLM2's own tokenizer makes of a text (its GGUF's vocabulary alone, no weights)."""
    from llama_cpp import Llama

    from edgecache.engines.llamacpp import resolve_model_path

    path, _ = resolve_model_path("smollm2")
    vocab = Llama(str(path), vocab_only=True, verbose=False)
    return lambda text: len(vocab.tokenize(text.encode(), add_bos=False, special=False))


def system_prompt(index: int, target_tokens: int, count: Callable[[str], int], rng: random.Random) -> str:
    """Tenant ``index``'s system prompt: the shared preamble, its company, then its own policies until the whole
    holds at least ``target_tokens`` tokens."""
    company = COMPANIES[index % len(COMPANIES)] + (f" {index // len(COMPANIES) + 1}" if index >= len(COMPANIES)
                                                   else "")
    text = PREAMBLE + f"The company is {company}, and these are its policies. "
    i = 0
    while count(text) < target_tokens:
        i += 1
        text += (f"Policy {i}: {rng.choice(PRODUCTS)} sent to {rng.choice(REGIONS)} arrive within "
                 f"{rng.randint(1, 14)} days; {rng.choice(TOPICS)} are handled by {rng.choice(CHANNELS)} within "
                 f"{rng.randint(1, 30)} days, and cost {rng.choice(['nothing', f'{rng.randint(2, 40)} euros'])}. ")
    return text


def build(cfg: FleetConfig, count: Callable[[str], int] | None = None) -> tuple[list[Tenant], list[Ask]]:
    """The tenants and the requests of one arm (every arm sends the same), deterministic in ``cfg.seed``: tenants
    ask as many requests each (give or take one), shuffled, and no two requests ask the same question."""
    count = count or smollm2_token_counter()
    rng = random.Random(cfg.seed)
    tenants = []
    for i in range(cfg.tenants):
        system = system_prompt(i, cfg.system_tokens, count, rng)
        tenants.append(Tenant(f"tenant{i}", f"sk-fleet-router-tenant-{i:02d}", system, count(system)))
    # Each tenant asks its share, in a shuffled order: tenants in strict turns would line up with a round robin
    # over a number of nodes that divides their number, and give every tenant a node of its own.
    order = [tenants[i % len(tenants)] for i in range(cfg.requests)]
    rng.shuffle(order)
    asks, seen = [], set()
    for idx, tenant in enumerate(order):
        while True:
            question = rng.choice(ASKS).format(t=rng.choice(TOPICS), p=rng.choice(PRODUCTS), r=rng.choice(REGIONS),
                                               c=rng.choice(CHANNELS))
            question = f"{question} (ticket {rng.randint(1000, 9999)})"
            if question not in seen:
                seen.add(question)
                break
        asks.append(Ask(idx, tenant, question, cfg.max_tokens))
    return tenants, asks


def tenants_toml(tenants: list[Tenant]) -> str:
    lines = ['[plans.fleet]', 'store_bytes = "1GB"', '']
    for t in tenants:
        lines += ["[[tenants]]", f'id = "{t.id}"', 'plan = "fleet"', f'keys = ["{t.key}"]', ""]
    return "\n".join([*lines, "[admin]", f'keys = ["{ADMIN_KEY}"]', ""])


class Router:
    """``python -m sglang_router.launch_router`` over ``workers`` on free ports (its Prometheus exporter too: its
    default port would clash between two routers); its log in ``directory``."""

    def __init__(self, directory: Path, workers: list[str], policy: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = directory / f"router-{policy}-{self.port}.log"
        self.command = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                        "--port", str(self.port), "--worker-urls", *workers, "--policy", policy,
                        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                        "--log-level", "info"]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, model: str = MODEL, timeout: float = 120) -> Router:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        # ready once it has registered the nodes under the model their /server_info names
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the router exited at start (rc {self.proc.returncode}); see {self.log_path}")
            try:
                if model in httpx.get(self.url + "/v1/models", timeout=2).text:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the router never listed the nodes' model {model!r}; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def redis_server(work: Path) -> Iterator[str]:
    """A throwaway redis-server on a free port (no persistence); its URL without the database."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server), or run without Redis")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(work)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        import socket

        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


@contextmanager
def nodes(work: Path, arm: str, n: int, redis_url: str | None) -> Iterator[list[str]]:
    """``n`` fresh nodes, each its own data dir and log under ``work``; their URLs."""
    tenants = work / "tenants.toml"
    started: list[tuple[subprocess.Popen, str, Any]] = []
    try:
        for i in range(n):
            port = free_port()
            name = f"{arm.replace(' ', '-')}-node{i}"
            log = (work / f"{name}.log").open("ab")
            args = ["--profile", "cpu", "--port", str(port), "--data-dir", str(work / name), "--tenants", str(tenants),
                    *(["--redis", redis_url] if redis_url else [])]
            proc = start_server(args, env={"EDGECACHE_SEMANTIC__ENABLED": "false"}, log=log, clean_env=True)
            started.append((proc, f"http://127.0.0.1:{port}", log))
        for proc, url, _ in started:
            wait_ready(url, proc, timeout=180)
        yield [url for _, url, _ in started]
    finally:
        for proc, _, _ in started:
            if proc.poll() is None:
                proc.terminate()
        for proc, _, log in started:
            proc.wait(timeout=60)
            log.close()


def node_counts(url: str) -> dict[str, Any]:
    """A node's engine token counters and its requests by tenant, from its /stats."""
    body = httpx.get(url + "/stats", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=30).json()
    by_tenant = {tenant: sum(n for counts in scenarios.values() for n in counts.values())
                 for tenant, scenarios in body["by_tenant"].items()}
    engine = body["engine"]
    return {"prompt_tokens": engine["prompt_tokens"], "cached_tokens": engine["cached_tokens"],
            "calls": engine["calls"], "by_tenant": by_tenant}


async def send(client: httpx.AsyncClient, url: str, ask: Ask) -> dict[str, Any]:
    """One streamed request, as a record: status, the layer that answered (``x-edgecache``), TTFT, the answer and
    the usage it reported."""
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"idx": ask.idx, "tenant": ask.tenant.id, "status": 0, "outcome": "failed", "ttft_s": None,
                           "answer": "", "prompt_tokens": None, "cached_tokens": None}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=ask.body(), headers=ask.headers()) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["outcome"] = "refused" if r.status_code in (429, 503) else "failed"
                await r.aread()
                rec["error"] = r.text[:200]
                return rec
            served, parts, done, errored = r.headers.get("x-edgecache", "?"), [], False, False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errored = True
                    rec["error"] = json.dumps(chunk["error"])[:200]
                    continue
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        if rec["ttft_s"] is None:
                            rec["ttft_s"] = time.perf_counter() - t0
                        parts.append(text)
                if chunk.get("usage"):
                    rec["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                    rec["cached_tokens"] = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            rec["answer"] = "".join(parts)
            if done and not errored and rec["prompt_tokens"] is not None:
                rec["outcome"] = served
    except httpx.HTTPError as exc:
        rec["error"] = repr(exc)[:200]
    if rec["ttft_s"] is None:  # an answer with no text: its first byte of nothing is its end
        rec["ttft_s"] = time.perf_counter() - t0
    return rec


async def replay(url: str, asks: list[Ask], concurrency: int) -> tuple[list[dict[str, Any]], float]:
    """Every request, in order, ``concurrency`` at a time (a closed loop); the records in request order."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        async def one(ask: Ask) -> dict[str, Any]:
            async with sem:
                return await send(client, url, ask)

        start = time.perf_counter()
        records = await asyncio.gather(*(one(a) for a in asks))
        return list(records), time.perf_counter() - start


def run_arm(work: Path, arm: str, cfg: FleetConfig, asks: list[Ask], redis_url: str | None) -> dict[str, Any]:
    """One arm on fresh nodes: its records, its wall time, and each node's counters before and after."""
    n = 1 if arm == "one node" else cfg.nodes
    with nodes(work, arm, n, redis_url) as urls:
        router = None if arm == "one node" else Router(work, urls, arm).start()
        try:
            before = [node_counts(u) for u in urls]
            records, wall = asyncio.run(replay(router.url if router else urls[0], asks, cfg.concurrency))
            after = [node_counts(u) for u in urls]
        finally:
            if router is not None:
                router.stop()
    return {"arm": arm, "nodes": n, "records": records, "wall_s": wall, "before": before, "after": after}


def summarize(raw: dict[str, Any], asks: list[Ask], baseline: dict[str, Any] | None = None) -> dict[str, Any]:
    """An arm's figures and checks from its records and the nodes' counter deltas. ``baseline`` (the one-node
    arm's summary) gives each request's prompt tokens to compare with."""
    records = raw["records"]
    per_node = []
    for b, a in zip(raw["before"], raw["after"]):
        per_node.append({"prompt_tokens": a["prompt_tokens"] - b["prompt_tokens"],
                         "cached_tokens": a["cached_tokens"] - b["cached_tokens"], "calls": a["calls"] - b["calls"],
                         "by_tenant": {t: n - b["by_tenant"].get(t, 0) for t, n in a["by_tenant"].items()
                                       if n - b["by_tenant"].get(t, 0)}})
    prompt = sum(p["prompt_tokens"] for p in per_node)
    cached = sum(p["cached_tokens"] for p in per_node)
    outcomes = Counter(r["outcome"] for r in records)
    answered = [r for r in records if r["status"] == 200 and r["outcome"] not in ("failed", "refused")]
    ttfts = [r["ttft_s"] for r in answered]
    sent_by_tenant = Counter(a.tenant.id for a in asks)
    on_nodes_by_tenant: Counter[str] = Counter()
    for p in per_node:
        on_nodes_by_tenant.update(p["by_tenant"])
    min_cached = {t: min((r["cached_tokens"] for r in answered if r["tenant"] == t), default=None)
                  for t in sent_by_tenant}
    checks = {
        "every request answered": len(answered) == len(asks),
        "every answer computed by an engine": outcomes["miss"] == len(answered),
        "each tenant's requests counted under it on the nodes": dict(on_nodes_by_tenant) == dict(sent_by_tenant),
        "each tenant paid its own cold prefill": all(v == 0 for v in min_cached.values()),
        "answers' tokens add up to the nodes' counts": (
            sum(r["prompt_tokens"] or 0 for r in answered) == prompt
            and sum(r["cached_tokens"] or 0 for r in answered) == cached),
    }
    if baseline is not None:
        checks["each answer computed on its own prompt (tokens as on one node)"] = all(
            r["prompt_tokens"] == baseline["prompt_tokens_by_request"].get(r["idx"]) for r in answered)
    return {
        "arm": raw["arm"], "nodes": raw["nodes"], "requests": len(records), "answered": len(answered),
        "refused": outcomes["refused"], "failed": outcomes["failed"],
        "outcomes": dict(outcomes), "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_ratio": cached / prompt if prompt else 0.0, "engine_calls": sum(p["calls"] for p in per_node),
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99), "wall_s": raw["wall_s"],
        "per_node": per_node, "checks": checks,
        "prompt_tokens_by_request": {r["idx"]: r["prompt_tokens"] for r in answered},
        "answers": {r["idx"]: r["answer"] for r in answered},
    }


def run(cfg: FleetConfig, work: Path, count: Callable[[str], int] | None = None) -> dict[str, Any]:
    """The three arms, one after the other, on the same requests; their summaries and the workload's shape."""
    tenants, asks = build(cfg, count)
    (work / "tenants.toml").write_text(tenants_toml(tenants))
    out: dict[str, Any] = {"config": cfg, "system_tokens": {t.id: t.system_tokens for t in tenants}, "arms": {}}

    def arms(redis_base: str | None) -> None:
        baseline = None
        for db, arm in enumerate(ARMS):
            raw = run_arm(work, arm, cfg, asks, f"{redis_base}/{db}" if redis_base else None)
            out["arms"][arm] = summarize(raw, asks, baseline)
            baseline = baseline or out["arms"][arm]

    if cfg.redis:
        with redis_server(work) as base:
            arms(base)
    else:
        arms(None)
    return out


def goals(result: dict[str, Any]) -> list[str]:
    """The three goals, each with its figure: cache_aware's hit ratio within 5 points of one node's, round robin's
    dilution beside it, nothing lost or served to the wrong tenant."""
    one, aware, rr = (result["arms"][a] for a in ARMS)
    gap = 100 * (one["hit_ratio"] - aware["hit_ratio"])
    ok = all(all(a["checks"].values()) for a in result["arms"].values())
    return [
        (f"cache_aware vs one node: {-gap:+.1f} points of prefix-cache hit ratio "
         f"({'within' if gap <= 5 else 'NOT within'} 5 points)"),
        (f"round_robin vs one node: {100 * (rr['hit_ratio'] - one['hit_ratio']):+.1f} points "
         f"(cached tokens lost to dilution: {one['cached_tokens'] - rr['cached_tokens']:,})"),
        f"nothing lost or served to the wrong tenant: {'yes' if ok else 'NO (see the checks)'}",
    ]


def table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    rows = [(f"{cfg.tenants} tenants (system prompts of {min(result['system_tokens'].values()):,}-"
             f"{max(result['system_tokens'].values()):,} tokens), {cfg.requests} streamed requests per arm, "
             f"concurrency {cfg.concurrency}, max_tokens {cfg.max_tokens}, {cfg.nodes} nodes behind the router, "
             f"{'one shared Redis' if cfg.redis else 'no Redis'}, semantic layer off"),
            (f"{'':14}{'nodes':>6}{'prefix hit':>12}{'cached/prompt tokens':>24}{'TTFT p50':>10}{'TTFT p99':>10}"
             f"{'refused':>9}{'failed':>8}{'checks':>8}")]
    for arm in ARMS:
        a = result["arms"][arm]
        tokens = f"{a['cached_tokens']:,}/{a['prompt_tokens']:,}"
        rows.append(f"{arm:14}{a['nodes']:>6}{100 * a['hit_ratio']:>11.1f}%{tokens:>24}"
                    f"{a['ttft_p50_s']:>9.2f}s{a['ttft_p99_s']:>9.2f}s{a['refused']:>9}{a['failed']:>8}"
                    f"{'ok' if all(a['checks'].values()) else 'FAIL':>8}")
    one = result["arms"][ARMS[0]]["answers"]
    for arm in ARMS[1:]:
        answers = result["arms"][arm]["answers"]
        same = sum(answers.get(i) == text for i, text in one.items())
        rows.append(f"{arm}: the same answer as on one node for {same} of {len(one)} requests (greedy decoding)")
    for arm in ARMS[1:]:
        spread = "; ".join(f"node{i}: " + ", ".join(f"{t} {n}" for t, n in sorted(p["by_tenant"].items()))
                           for i, p in enumerate(result["arms"][arm]["per_node"]))
        rows.append(f"{arm} requests by node: {spread}")
    for arm in ARMS:
        for check, ok in result["arms"][arm]["checks"].items():
            if not ok:
                rows.append(f"{arm}: FAILED: {check}")
    rows += goals(result)
    return "\n".join(rows)
