"""The agent trace of ``scripts/bench_agents.py`` and the maths of its report: tenants x agent sessions whose long,
Claude Code-like prompts grow turn by turn, interleaved, with one restart of the server in the middle.

- **A session's prompt.** A system message: a part shared by every session of the tenant (instructions and the
  first tool definitions), then the session's own part (its project notes, its files, more tools), about
  ``prompt_tokens`` tokens in all; all of it synthetic text drawn from a seed, so a trace is a pure function of its
  :class:`TraceConfig`. Turn ``k`` sends the system message, the user messages of turns ``0..k`` and, between
  them, the answers the server gave to the earlier turns (known only at run time), so each turn's prompt extends
  the previous one.
- **The order.** Round ``r`` is every session's turn ``r``; within a round the sessions go in turns, tenants
  alternating (tenant 0's session 0, tenant 1's session 0, tenant 0's session 1, ...), so two requests in a row
  never share a tenant when there are two tenants or more. The server restarts after :func:`restart_round` rounds:
  the next round is what the restart costs.
- **Token counts.** :func:`estimate_tokens` is SmolLM2's tokenizer on this text, measured (about
  :data:`CHARS_PER_TOKEN` characters a token); the server's usage gives the true counts at run time.

The report (:func:`summarize`, :func:`goals`) works on plain records, one per request, so that it is tested without
a model.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from edgecache.bench.harness import percentile

MODEL = "SmolLM2-135M-Instruct"
ADMIN_KEY = "sk-admin-agents-bench-01"
#: A tenant of its own for the RAM-hit probes: one short request under its salt moves the engine's live context off
#: the session before the session's next turn, so that turn loads its prefix from the prefix cache.
PROBE_TENANT = "probe"
#: Characters a token of this synthetic text with SmolLM2's tokenizer: a system message's estimate is within 2 % of
#: the tokenizer's count (20 sessions); the user messages (paths, numbers) run ~15 % over it.
CHARS_PER_TOKEN = 4.6
#: The tiers a request's cached tokens are put down to (see :func:`tier_of`).
TIERS = ("ram", "disk", "context", "miss", "unknown")

_VOCABULARY = (
    "agent build cache call check class code commit config context data debug deploy diff directory edit engine "
    "error event file fix format function handler index input key layer line list load log loop message method "
    "model module node output package parse patch path plan prompt query read record request result return review "
    "route run schema script search server session shell source state step store stream string task test token "
    "tool trace type update user value version worker write always before carefully clearly exactly first never "
    "only quickly safely then when with without after every each new old small large local remote current "
    "previous next empty valid broken slow fast long short"
)
_WORDS = tuple(_VOCABULARY.split())
_TOOL_VERBS = ("read", "write", "edit", "search", "list", "run", "fetch", "diff", "grep", "glob", "patch", "test")
_TOOL_NOUNS = ("file", "files", "notebook", "shell", "tests", "url", "todo", "task", "branch", "symbol", "log", "env")
_PARAM_TYPES = ("string", "integer", "boolean", "array", "object")


@dataclass(frozen=True)
class TraceConfig:
    tenants: int = 2
    sessions: int = 3  # per tenant
    turns: int = 3
    prompt_tokens: int = 3500  # the system message (instructions + tools + the session's notes)
    turn_tokens: int = 150  # each turn's new user message
    shared_share: float = 0.2  # the part of the system message every session of a tenant shares
    max_tokens: int = 16
    seed: int = 0
    probes: int = 2  # follow-up turns sent after the trace to time RAM hits (not part of the trace)


@dataclass(frozen=True)
class Tenant:
    id: str
    key: str


@dataclass(frozen=True)
class Session:
    tenant: str
    index: int
    system: str
    users: tuple[str, ...]  # one per turn
    probe_users: tuple[str, ...] = field(default=())  # the follow-ups of the RAM-hit probes

    @property
    def name(self) -> str:
        return f"{self.tenant}/s{self.index}"

    def messages(self, turn: int, answers: Sequence[str], *, probe: int | None = None) -> list[dict[str, str]]:
        """Turn ``turn``'s messages: the system message, then each earlier turn's user message and answer
        (``answers[i]`` for turn ``i``), then this turn's user message (``probe``: the probe follow-up instead,
        after all ``turn`` turns)."""
        if len(answers) < turn:
            raise ValueError(f"turn {turn} needs the {turn} earlier answers, got {len(answers)}")
        out = [{"role": "system", "content": self.system}]
        for i in range(turn):
            out += [{"role": "user", "content": self.users[i]}, {"role": "assistant", "content": answers[i]}]
        out.append({"role": "user", "content": self.probe_users[probe] if probe is not None else self.users[turn]})
        return out


@dataclass(frozen=True)
class Step:
    """One request of the trace: session ``session`` (an index into :func:`sessions`) at turn ``turn``."""
    seq: int
    turn: int
    session: int
    tenant: str


def estimate_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def tenants(cfg: TraceConfig) -> list[Tenant]:
    """The trace's tenants, each with a key of its own (the seed is in it: two traces' tenants never share a key)."""
    return [Tenant(f"agents-t{i}", f"sk-agents-t{i}-{cfg.seed}-{random.Random(f'{cfg.seed}:key:{i}').getrandbits(64):016x}")
            for i in range(cfg.tenants)]


def _sentence(rng: random.Random, low: int, high: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(low, high))]
    return " ".join(words).capitalize() + "."


def _tool(rng: random.Random, n: int) -> str:
    name = f"{rng.choice(_TOOL_VERBS)}_{rng.choice(_TOOL_NOUNS)}_{n}"
    lines = [f"## Tool {name}", f"Description: {_sentence(rng, 18, 40)} {_sentence(rng, 8, 20)}", "Parameters:"]
    for p in range(rng.randint(2, 5)):
        req = "required" if p == 0 or rng.random() < 0.4 else "optional"
        lines.append(f"- {rng.choice(_WORDS)}_{p} ({rng.choice(_PARAM_TYPES)}, {req}): {_sentence(rng, 6, 16)}")
    return "\n".join(lines)


def _grow(parts: list[str], target_tokens: int, make, sep: str = "\n\n") -> None:
    """Append ``make(i)`` to ``parts`` until ``sep.join(parts)`` reaches ``target_tokens`` (bounded: at most 10,000
    parts)."""
    for i in range(10_000):
        if estimate_tokens(sep.join(parts)) >= target_tokens:
            return
        parts.append(make(i))


def _tenant_part(cfg: TraceConfig, tenant: str) -> str:
    rng = random.Random(f"{cfg.seed}:tenant:{tenant}")
    parts = [f"You are a coding agent working for {tenant}. You help with software engineering tasks in the "
             "user's repository, with the tools below. " + " ".join(_sentence(rng, 10, 24) for _ in range(6))]
    _grow(parts, max(1, round(cfg.prompt_tokens * cfg.shared_share)), lambda i: _tool(rng, i))
    return "\n\n".join(parts)


def _session_part(cfg: TraceConfig, tenant: str, index: int, shared: str) -> str:
    rng = random.Random(f"{cfg.seed}:session:{tenant}:{index}")
    notes = " ".join(_sentence(rng, 10, 24) for _ in range(4))
    parts = [f"# Session {tenant}-{index}\nWorking directory: /home/{tenant}/project-{index}\nProject notes: {notes}"]
    target = max(1, cfg.prompt_tokens - estimate_tokens(shared))

    def more(i: int) -> str:
        if i % 3 == 2:
            return (f"### File src/{rng.choice(_WORDS)}_{i}.py\n"
                    + "\n".join(f"def {rng.choice(_WORDS)}_{j}({rng.choice(_WORDS)}):  # {_sentence(rng, 5, 12)}"
                                for j in range(rng.randint(3, 8))))
        return _tool(rng, 100 + i)

    _grow(parts, target, more)
    return "\n\n".join(parts)


def _user_message(rng: random.Random, tokens: int, label: str) -> str:
    parts = [f"{label}: {_sentence(rng, 8, 20)}", "Tool result:"]
    _grow(parts, tokens, lambda i: f"  {rng.choice(_WORDS)}/{rng.choice(_WORDS)}_{i}.py:{rng.randint(1, 999)}: "
                                   + _sentence(rng, 5, 14), sep="\n")
    return "\n".join(parts)


def sessions(cfg: TraceConfig) -> list[Session]:
    """Every session of the trace, tenant by tenant: a pure function of ``cfg``."""
    out = []
    for tenant in tenants(cfg):
        shared = _tenant_part(cfg, tenant.id)
        for s in range(cfg.sessions):
            rng = random.Random(f"{cfg.seed}:turns:{tenant.id}:{s}")
            system = shared + "\n\n" + _session_part(cfg, tenant.id, s, shared)
            users = tuple(_user_message(rng, cfg.turn_tokens, f"Turn {t + 1} of session {tenant.id}-{s}")
                          for t in range(cfg.turns))
            probes = tuple(_user_message(rng, cfg.turn_tokens, f"Follow-up {p + 1} of session {tenant.id}-{s}")
                           for p in range(cfg.probes))
            out.append(Session(tenant.id, s, system, users, probes))
    return out


def schedule(cfg: TraceConfig) -> list[Step]:
    """The order the requests go out in: by turn, then by session index, then by tenant."""
    steps = []
    for turn in range(cfg.turns):
        for s in range(cfg.sessions):
            for t in range(cfg.tenants):
                steps.append(Step(len(steps), turn, t * cfg.sessions + s, f"agents-t{t}"))
    return steps


def restart_round(cfg: TraceConfig) -> int:
    """The server restarts once this many rounds (turns of every session) are done: half the turns, rounded up, and
    at least one round is left after it (none when there is a single turn)."""
    return min(cfg.turns - 1, max(1, math.ceil(cfg.turns / 2))) if cfg.turns > 1 else cfg.turns


def tenants_toml(cfg: TraceConfig) -> str:
    """A tenants file: each tenant (and the probe tenant) with its own key, a plan allowing the policy sent."""
    lines = ['[plans.agents]', 'store_bytes = "1GB"', 'max_concurrent_misses = 2',
             'policies = ["default", "no-store", "no-cache", "exact-only", "bypass"]', '']
    for t in [*tenants(cfg), probe_tenant(cfg)]:
        lines += ["[[tenants]]", f'id = "{t.id}"', 'plan = "agents"', f'keys = ["{t.key}"]', ""]
    lines += ["[admin]", f'keys = ["{ADMIN_KEY}"]', ""]
    return "\n".join(lines)


def probe_tenant(cfg: TraceConfig) -> Tenant:
    return Tenant(PROBE_TENANT, f"sk-agents-probe-{cfg.seed}")


def trace_summary(cfg: TraceConfig) -> dict[str, Any]:
    """Estimated tokens: each session's system message, and its first and last turn's prompt (answers left out)."""
    out = []
    for s in sessions(cfg):
        system = estimate_tokens(s.system)
        out.append({"session": s.name, "system_tokens": system,
                    "last_turn_tokens": system + sum(estimate_tokens(u) for u in s.users) + cfg.max_tokens
                    * (cfg.turns - 1)})
    return {"sessions": out, "requests": cfg.tenants * cfg.sessions * cfg.turns, "restart_after_round": restart_round(cfg)}


# ---- the report ----

def tier_of(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None, cached_tokens: int) -> str:
    """Where a request's cached tokens came from, from the engine's counters read around it (requests run one at a
    time): ``disk`` when ``prefix_cache_hits_disk`` moved, else ``ram`` when ``prefix_cache_hits_ram`` moved, else
    ``context`` (the engine's live context, no saved state loaded); ``miss`` when nothing was cached; ``unknown``
    when the engine does not report the two counters."""
    if cached_tokens <= 0:
        return "miss"
    keys = ("prefix_cache_hits_disk", "prefix_cache_hits_ram")
    if not before or not after or any(not isinstance(before.get(k), int | float) or
                                      not isinstance(after.get(k), int | float) for k in keys):
        return "unknown"
    if after["prefix_cache_hits_disk"] > before["prefix_cache_hits_disk"]:
        return "disk"
    if after["prefix_cache_hits_ram"] > before["prefix_cache_hits_ram"]:
        return "ram"
    return "context"


def summarize(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """A set of request records (``ttft_s``, ``engine_s``, ``prompt_tokens``, ``cached_tokens``, ``tier``): TTFT p50
    and p99, engine-seconds spent, the cached share of prompt tokens, requests by tier."""
    recs = [r for r in records if r.get("ok", True)]
    ttfts = [r["ttft_s"] for r in recs]
    prompt = sum(r["prompt_tokens"] for r in recs)
    cached = sum(r["cached_tokens"] for r in recs)
    engine = [r["engine_s"] for r in recs]
    return {"requests": len(recs), "ttft_p50_s": _round(percentile(ttfts, 0.5)),
            "ttft_p99_s": _round(percentile(ttfts, 0.99)),
            "engine_s": None if not recs or any(e is None for e in engine) else round(sum(engine), 3),
            "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_share": round(cached / prompt, 4) if prompt else None,
            "tiers": {tier: n for tier, n in sorted(Counter(r["tier"] for r in recs).items())}}


def _round(x: float, digits: int = 3) -> float | None:
    return None if math.isnan(x) else round(x, digits)


def phase_report(records: Sequence[Mapping[str, Any]], probes: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """A phase: all its trace requests, the turns right after the restart, and the RAM-hit reference (the TTFT
    median of the probes served from RAM; of those served from any saved state when the tiers are unknown)."""
    ram = [p["ttft_s"] for p in probes if p.get("ok", True) and p["tier"] == "ram"]
    if not ram:
        ram = [p["ttft_s"] for p in probes if p.get("ok", True) and p["tier"] == "unknown"]
    return {"all": summarize(records), "after_restart": summarize(r for r in records if r["after_restart"]),
            "ram_hit_ttft_s": _round(percentile(ram, 0.5)) if ram else None,
            "probe_tiers": [p["tier"] for p in probes]}


def restart_turns(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The turns right after the restart, each with its share of its prefix (the session's previous prompt) that
    came from the cache."""
    out = []
    for r in records:
        if r["after_restart"]:
            prefix = r.get("prefix_tokens") or 0
            out.append({"session": r["session"], "tier": r["tier"], "ttft_s": r["ttft_s"],
                        "prefix_tokens": prefix, "cached_tokens": r["cached_tokens"],
                        "prefix_cached": round(r["cached_tokens"] / prefix, 4) if prefix else None})
    return out


def goals(phases: Mapping[str, Mapping[str, Any]], records: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """The goals, each True, False or None (not measured: a phase missing, or no figure to compare with):

    - ``restart_turns_from_disk``: with the tiers on, every session's turn after the restart loaded its prefix from
      disk, at least 90 % of it;
    - ``restart_ttft_le_5x_ram_hit``: each of those turns' TTFT is at most 5x the RAM-hit reference;
    - ``engine_s_le_half_ram_only``: the tiers on spent at most half the engine-seconds of RAM only;
    - ``ttft_p50_below_vllm``: the tiers on's TTFT p50 is below vLLM's on the same trace.
    """
    out: dict[str, Any] = {"restart_turns_from_disk": None, "restart_ttft_le_5x_ram_hit": None,
                           "engine_s_le_half_ram_only": None, "ttft_p50_below_vllm": None}
    on = phases.get("tiers_on")
    if on is None:
        return out
    turns = restart_turns(records.get("tiers_on", ()))
    if turns:
        out["restart_turns_from_disk"] = all(t["tier"] == "disk" and t["prefix_cached"] is not None
                                             and t["prefix_cached"] >= 0.9 for t in turns)
        ram = on.get("ram_hit_ttft_s")
        if ram:
            out["restart_ttft_le_5x_ram_hit"] = all(t["ttft_s"] <= 5 * ram for t in turns)
    off = phases.get("ram_only")
    if off is not None and on["all"]["engine_s"] is not None and off["all"]["engine_s"]:
        out["engine_s_le_half_ram_only"] = on["all"]["engine_s"] <= 0.5 * off["all"]["engine_s"]
    vllm = phases.get("vllm")
    if vllm is not None and on["all"]["ttft_p50_s"] is not None and vllm["all"]["ttft_p50_s"] is not None:
        out["ttft_p50_below_vllm"] = on["all"]["ttft_p50_s"] < vllm["all"]["ttft_p50_s"]
    return out


PHASE_TITLES = {"ram_only": "tiers off (RAM only)", "tiers_on": "tiers on (RAM + disk)", "vllm": "vLLM (direct)"}


def table(phases: Mapping[str, Mapping[str, Any]]) -> str:
    """The phases side by side, as a Markdown table: the whole trace, and the turns right after the restart."""
    names = [p for p in PHASE_TITLES if p in phases]

    def cell(value: Any, fmt: str = "{}") -> str:
        return "-" if value is None else fmt.format(value)

    rows: list[list[str]] = []
    for part, label in (("all", "trace"), ("after_restart", "after restart")):
        rows += [
            [f"{label}: requests"] + [cell(phases[p][part]["requests"]) for p in names],
            [f"{label}: TTFT p50 (s)"] + [cell(phases[p][part]["ttft_p50_s"], "{:.3f}") for p in names],
            [f"{label}: TTFT p99 (s)"] + [cell(phases[p][part]["ttft_p99_s"], "{:.3f}") for p in names],
            [f"{label}: engine-s spent"] + [cell(phases[p][part]["engine_s"], "{:.1f}") for p in names],
            [f"{label}: cached share of prompt tokens"] + [cell(phases[p][part]["cached_share"], "{:.1%}")
                                                         for p in names],
            [f"{label}: requests by tier"] + [" / ".join(f"{k} {v}" for k, v in phases[p][part]["tiers"].items())
                                              or "-" for p in names],
        ]
    rows.append(["RAM-hit TTFT, probes (s)"] + [cell(phases[p].get("ram_hit_ttft_s"), "{:.3f}") for p in names])
    lines = ["| | " + " | ".join(PHASE_TITLES[p] for p in names) + " |",
             "|---|" + "---:|" * len(names)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
