"""Agents' long prompts through a restart: the engine's KV prefix cache in RAM only, with its disk tier, and vLLM
directly, on one trace, side by side in one run.

The trace (``edgecache.bench.agents``): T tenants x S agent sessions, each with a Claude Code-like system message
(instructions and tool definitions, a part shared by the tenant's sessions, the rest the session's own) of
--prompt-tokens, then turns that grow: each turn appends the answer to the previous one and a new user message.
The sessions go round-robin by turn (tenants alternating), so together they hold several times the RAM budget of
the prefix cache (by default 6 sessions' ~90 MB states against 256 MiB for the box, half of it a tenant's share:
each tenant keeps one state in RAM, and a session's next turn finds its own gone); the server restarts once in the
middle (SIGTERM, then a start on the same data dir). Every request
is a streamed chat completion, temperature 0, --max-tokens, with ``X-EdgeCache-Policy: no-cache`` (the exact store
never answers; every prompt is new anyway) and the semantic layer off.

Phases, each on a fresh data dir, one `edgecache serve --profile cpu` each (context 8192, prefix cache
--ram-budget):
  ram_only  the disk tier off (engine.prefix_cache_disk_bytes = 0);
  tiers_on  the disk tier on (--disk-budget);
  vllm      the same trace straight to vLLM's CPU build (edgecache.bench.vllm: installed into --vllm-venv when
            missing; prefix caching on, each tenant's cache_salt), restarted at the same point. Where vLLM cannot be
            installed or started, the script says so and reports the other phases.
Reported per phase, for the whole trace and for the turns right after the restart: TTFT p50 and p99 (first
streamed content, measured here), engine-seconds spent (EdgeCache: its ledger's spent engine-seconds, read from
/stats around each request; vLLM: the requests' latencies, one at a time), the cached share of prompt tokens
(usage.prompt_tokens_details.cached_tokens) and the requests by tier: the engine's counters prefix_cache_hits_ram
and prefix_cache_hits_disk, read around each request (``context``: cached in the engine's live context, no state
loaded; ``unknown``: the engine has no such counters). After each EdgeCache phase, --probes follow-ups of the last
session, each after a short request of another tenant, time a RAM hit: the reference of the restart goal.

Goals: after the restart every session's next turn is served from disk, >= 90 % of its prefix cached, TTFT <= 5x
a RAM hit's; engine-seconds with the tiers <= 0.5x RAM only's; TTFT p50 with the tiers below vLLM's.

    python scripts/bench_agents.py [--tenants 2 --sessions 3 --turns 3 --prompt-tokens 3500] [--json out.json]
    python scripts/bench_agents.py --quick          # 1 tenant, 2 sessions, 600-token prompts, 2 turns

On a 2-core box the defaults take about 20 minutes (llama.cpp prefills SmolLM2 at ~110 prompt tokens/s, so most of
it is the RAM-only phase's cold turns; vLLM's CPU build prefills ~4x faster and starts in about a minute); --quick
takes about 3 minutes, most of it vLLM's two starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from edgecache.bench import agents
from edgecache.bench.harness import free_port, start_server, stop_process, wait_ready
from edgecache.bench.vllm import VENV, VLLMServer, VLLMUnavailable, prepare
from edgecache.settings import EngineSettings

PHASES = ("ram_only", "tiers_on", "vllm")
#: Whether this build knows the disk tier's setting (an unknown EDGECACHE_ variable is refused at start).
HAS_DISK_SETTING = "prefix_cache_disk_bytes" in EngineSettings.__struct_fields__
REQUEST_TIMEOUT_S = 900  # a guard against a hang: a cold 8k-token prefill takes ~90 s on a 2-core box
START_TIMEOUT_S = 600


def stream_chat(client: httpx.Client, url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    """One streamed chat completion: time to the first content, latency, the answer, usage's prompt and cached
    tokens, and what served it (``X-EdgeCache``)."""
    t0 = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    out: dict[str, Any] = {"ok": False, "status": 0, "served": None, "error": None}
    try:
        with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as resp:
            out["status"] = resp.status_code
            out["served"] = resp.headers.get("x-edgecache")
            if resp.status_code != 200:
                out["error"] = resp.read()[:300].decode("utf-8", "replace")
            else:
                for line in resp.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if event.get("error"):
                        out["error"] = str(event["error"])[:300]
                    if event.get("usage"):
                        usage = event["usage"]
                    for choice in event.get("choices") or ():
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            if ttft is None:
                                ttft = time.perf_counter() - t0
                            parts.append(text)
                out["ok"] = out["error"] is None and bool(usage)
                if not usage and out["error"] is None:
                    out["error"] = "the stream carried no usage"
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)[:300]
    latency = time.perf_counter() - t0
    out.update(latency_s=latency, ttft_s=ttft if ttft is not None else latency, answer="".join(parts),
               prompt_tokens=int(usage.get("prompt_tokens") or 0),
               cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
    return out


class EdgeCacheTarget:
    """`edgecache serve` on a data dir of its own, started again on the same dir at the restart."""

    def __init__(self, root: Path, cfg: agents.TraceConfig, args: argparse.Namespace, disk_bytes: str | None) -> None:
        self.root, self.args = root, args
        root.mkdir(parents=True, exist_ok=True)
        (root / "tenants.toml").write_text(agents.tenants_toml(cfg))
        self.keys = {t.id: t.key for t in [*agents.tenants(cfg), agents.probe_tenant(cfg)]}
        self.env = {"EDGECACHE_TENANTS_FILE": str(root / "tenants.toml"),
                    "EDGECACHE_ENGINE__CONTEXT_TOKENS": str(args.context_tokens),
                    "EDGECACHE_ENGINE__PREFIX_CACHE_BYTES": args.ram_budget,
                    "EDGECACHE_SEMANTIC__ENABLED": "false"}
        if disk_bytes is not None:
            self.env["EDGECACHE_ENGINE__PREFIX_CACHE_DISK_BYTES"] = disk_bytes
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.starts_s: list[float] = []
        self.stats_failed = False

    def start(self) -> None:
        t0 = time.perf_counter()
        with (self.root / "server.log").open("ab") as log:
            self.proc = start_server(["--profile", self.args.profile, "--port", str(self.port), "--data-dir",
                                      str(self.root / "data")], env=self.env, log=log, clean_env=True)
        wait_ready(self.url, self.proc, timeout=START_TIMEOUT_S)
        self.starts_s.append(round(time.perf_counter() - t0, 2))

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=120)  # shutdown may still write states out
            self.proc = None

    def headers(self, tenant: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[tenant]}", "x-edgecache-policy": "no-cache"}

    def extra(self, tenant: str) -> dict[str, Any]:
        return {}

    def stats(self) -> dict[str, Any] | None:
        """The ledger's spent engine-seconds and the engine's counters; both unknown (None, {}) where /stats fails."""
        try:
            resp = httpx.get(self.url + "/stats", headers={"authorization": f"Bearer {agents.ADMIN_KEY}"}, timeout=60)
            resp.raise_for_status()
            body = resp.json()
            return {"spent_engine_s": body["ledger"]["total"]["spent_engine_s"],
                    "engine": body.get("engine_state") or {}}
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            if not self.stats_failed:
                print(f"GET /stats failed ({exc!r:.200}): engine-seconds and tiers unknown", file=sys.stderr)
            self.stats_failed = True
            return {"spent_engine_s": None, "engine": {}}


class VLLMTarget:
    """vLLM's OpenAI server, stopped and started again on the same port at the restart."""

    def __init__(self, root: Path, python: Path, model_dir: Path, kv_cache_gib: int) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.server = VLLMServer(python, model_dir, root / "vllm.log", kv_cache_gib=kv_cache_gib)
        self.url = self.server.url
        self.starts_s: list[float] = []

    def start(self) -> None:
        t0 = time.perf_counter()
        self.server.start()
        self.starts_s.append(round(time.perf_counter() - t0, 2))

    def stop(self) -> None:
        self.server.stop()

    def headers(self, tenant: str) -> dict[str, str]:
        return {}

    def extra(self, tenant: str) -> dict[str, Any]:
        return {"cache_salt": tenant}  # what EdgeCache does per tenant

    def stats(self) -> dict[str, Any] | None:
        return None


def body(cfg: agents.TraceConfig, messages: list[dict[str, str]], extra: dict[str, Any]) -> dict[str, Any]:
    return {"model": agents.MODEL, "messages": messages, "temperature": 0, "max_tokens": cfg.max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, **extra}


def measured(target: Any, client: httpx.Client, payload: dict[str, Any], tenant: str) -> dict[str, Any]:
    """One request with the server's counters read before and after it: its engine-seconds and its tier."""
    before = target.stats()
    res = stream_chat(client, target.url, payload, target.headers(tenant))
    after = target.stats()
    if before is None or after is None:  # vLLM: one request at a time, so its latency is its engine time
        res["engine_s"] = res["latency_s"]
        res["tier"] = "ram" if res["cached_tokens"] > 0 else "miss"  # vLLM's CPU KV cache lives in RAM
    else:
        spent = (before["spent_engine_s"], after["spent_engine_s"])
        res["engine_s"] = None if None in spent else round(spent[1] - spent[0], 4)
        res["tier"] = agents.tier_of(before["engine"], after["engine"], res["cached_tokens"])
        res["engine_state"] = {k: v for k, v in after["engine"].items() if k.startswith("prefix_cache")}
    return res


def run_phase(name: str, target: Any, cfg: agents.TraceConfig, probes: bool) -> dict[str, Any]:
    sessions = agents.sessions(cfg)
    steps = agents.schedule(cfg)
    restart_at = agents.restart_round(cfg)
    answers: dict[int, list[str]] = {i: [] for i in range(len(sessions))}
    prompts: dict[int, int] = {}
    records: list[dict[str, Any]] = []
    probe_records: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    target.start()
    try:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            restarted = False
            for step in steps:
                if step.turn == restart_at and not restarted:
                    print(f"[{name}] restart after round {restart_at}", file=sys.stderr, flush=True)
                    target.stop()
                    target.start()
                    restarted = True
                sess = sessions[step.session]
                payload = body(cfg, sess.messages(step.turn, answers[step.session]), target.extra(sess.tenant))
                res = measured(target, client, payload, sess.tenant)
                answers[step.session].append(res["answer"])
                rec = {"seq": step.seq, "turn": step.turn, "session": sess.name, "tenant": sess.tenant,
                       "after_restart": step.turn == restart_at, "prefix_tokens": prompts.get(step.session, 0),
                       **{k: v for k, v in res.items() if k != "answer"}}
                prompts[step.session] = res["prompt_tokens"]
                records.append(rec)
                print(f"[{name}] turn {step.turn} {sess.name}: {'ok' if res['ok'] else 'FAILED ' + str(res['error'])}"
                      f" prompt {res['prompt_tokens']} cached {res['cached_tokens']} tier {res['tier']} "
                      f"TTFT {res['ttft_s']:.2f} s engine {res['engine_s']} s served {res['served']}",
                      file=sys.stderr, flush=True)
            if probes and steps:
                last = sessions[steps[-1].session]
                probe = agents.probe_tenant(cfg)
                for p in range(cfg.probes):
                    # Another tenant's short request first: the engine's live context leaves the session.
                    stream_chat(client, target.url, body(cfg, [{"role": "user", "content": f"Say hello {p}."}], {}),
                                target.headers(probe.id))
                    payload = body(cfg, last.messages(cfg.turns, answers[steps[-1].session], probe=p), {})
                    res = measured(target, client, payload, last.tenant)
                    probe_records.append({"session": last.name, **{k: v for k, v in res.items() if k != "answer"}})
                    print(f"[{name}] probe {p} {last.name}: cached {res['cached_tokens']}/{res['prompt_tokens']} "
                          f"tier {res['tier']} TTFT {res['ttft_s']:.3f} s", file=sys.stderr, flush=True)
    finally:
        target.stop()
    report = agents.phase_report(records, probe_records)
    report.update(wall_s=round(time.perf_counter() - t0, 1), starts_s=target.starts_s,
                  failed=sum(not r["ok"] for r in records),
                  not_misses=sum(r["served"] not in (None, "miss") for r in records),
                  restart_turns=agents.restart_turns(records))
    return {"report": report, "records": records, "probes": probe_records}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = agents.TraceConfig()
    ap.add_argument("--tenants", type=int, default=d.tenants)
    ap.add_argument("--sessions", type=int, default=d.sessions, help="agent sessions per tenant")
    ap.add_argument("--turns", type=int, default=d.turns)
    ap.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, help="a session's system message")
    ap.add_argument("--turn-tokens", type=int, default=d.turn_tokens, help="each turn's new user message")
    ap.add_argument("--shared-share", type=float, default=d.shared_share,
                    help="the part of the system message a tenant's sessions share")
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens)
    ap.add_argument("--probes", type=int, default=d.probes, help="RAM-hit probes after each EdgeCache phase")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--quick", action="store_true", help="1 tenant, 2 sessions, 600-token prompts, 2 turns")
    ap.add_argument("--ram-budget", default="256MiB",
                    help="engine.prefix_cache_bytes, the box's (a 4k-token state of SmolLM2: ~90 MB; a tenant may "
                         "hold its plan's share, half by default: one such state)")
    ap.add_argument("--disk-budget", default="8GiB", help="engine.prefix_cache_disk_bytes in the tiers_on phase")
    ap.add_argument("--context-tokens", type=int, default=8192)
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--phases", default=",".join(PHASES), help="which of " + ", ".join(PHASES))
    ap.add_argument("--vllm-venv", type=Path, default=VENV)
    ap.add_argument("--vllm-kv-gib", type=int, default=1, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--work-dir", type=Path, help="where the data dirs and logs go (default: a new temp dir)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    if args.quick:
        cfg = agents.TraceConfig(tenants=1, sessions=2, turns=2, prompt_tokens=600, turn_tokens=80,
                                 max_tokens=args.max_tokens, seed=args.seed, probes=args.probes,
                                 shared_share=args.shared_share)
    else:
        cfg = agents.TraceConfig(tenants=args.tenants, sessions=args.sessions, turns=args.turns,
                                 prompt_tokens=args.prompt_tokens, turn_tokens=args.turn_tokens,
                                 shared_share=args.shared_share, max_tokens=args.max_tokens, seed=args.seed,
                                 probes=args.probes)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        ap.error(f"unknown phases {sorted(unknown)}; choose from {', '.join(PHASES)}")
    root = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-agents-"))
    summary = agents.trace_summary(cfg)
    print(f"trace: {cfg.tenants} tenants x {cfg.sessions} sessions x {cfg.turns} turns = {summary['requests']} "
          f"requests; system messages ~{min(s['system_tokens'] for s in summary['sessions'])}-"
          f"{max(s['system_tokens'] for s in summary['sessions'])} tokens, last turns ~"
          f"{max(s['last_turn_tokens'] for s in summary['sessions'])}; restart after round "
          f"{summary['restart_after_round']}; RAM budget {args.ram_budget}; work dir {root}", file=sys.stderr)

    results: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    for name in phases:
        if name == "vllm":
            try:
                python, model_dir = prepare(args.vllm_venv, log=sys.stderr)
                results[name] = run_phase(name, VLLMTarget(root / name, python, model_dir, args.vllm_kv_gib), cfg,
                                          probes=False)
            except (VLLMUnavailable, RuntimeError) as exc:
                notes.append(f"vLLM phase not run: {exc}")
                print(notes[-1], file=sys.stderr)
            continue
        if not HAS_DISK_SETTING:
            if name == "tiers_on":
                notes.append("tiers_on phase not run: this build has no engine.prefix_cache_disk_bytes (no disk tier)")
                print(notes[-1], file=sys.stderr)
                continue
            disk = None  # RAM only is all this build has
        else:
            disk = "0" if name == "ram_only" else args.disk_budget
        results[name] = run_phase(name, EdgeCacheTarget(root / name, cfg, args, disk), cfg, probes=cfg.probes > 0)

    reports = {name: r["report"] for name, r in results.items()}
    outcome = agents.goals(reports, {name: r["records"] for name, r in results.items()})
    print()
    print(f"{cfg.tenants} tenants x {cfg.sessions} sessions x {cfg.turns} turns, system messages ~{cfg.prompt_tokens} "
          f"tokens, restart after round {summary['restart_after_round']}, RAM budget {args.ram_budget}, disk "
          f"{args.disk_budget}, max_tokens {cfg.max_tokens}")
    print(agents.table(reports))
    for name, rep in reports.items():
        turns = ", ".join(f"{t['session']} {t['tier']} {t['cached_tokens']}/{t['prefix_tokens']} "
                          f"{t['ttft_s']:.2f} s" for t in rep["restart_turns"])
        print(f"{name}: wall {rep['wall_s']} s, starts {rep['starts_s']} s, failed {rep['failed']}, answered by a "
              f"cache {rep['not_misses']}; after the restart (tier, cached/prefix, TTFT): {turns or '-'}")
    for note in notes:
        print(note)
    print("goals: " + ", ".join(f"{k} {'n/a' if v is None else 'PASS' if v else 'FAIL'}" for k, v in outcome.items()))
    if args.json:
        args.json.write_text(json.dumps({"config": dataclasses.asdict(cfg), "ram_budget": args.ram_budget,
                                         "disk_budget": args.disk_budget, "trace": summary, "phases": results,
                                         "goals": outcome, "notes": notes}, indent=1))


if __name__ == "__main__":
    main()
