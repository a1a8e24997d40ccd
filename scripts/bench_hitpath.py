"""Hit-path benchmark: how close an EdgeCache exact hit comes to a bare litestar endpoint, side by side in one run.

Measures, in one run, on this machine:
  (a) a bare litestar POST endpoint returning a constant JSON body (same uvicorn, uvloop and httptools settings),
  (b) EdgeCache exact hits (the same request body every time, answered from the result store), for a plain chat
      request (asked as JSON and with ``stream: true``), a tool-call answer (tools + a forced tool_choice), a
      structured-output answer (json_schema), and the plain request asked through Anthropic's Messages API and
      OpenAI's Responses API (JSON and streamed; the same stored entry, rendered as a message or a Response; a
      Responses hit is also stored as a response, unless ``store: false``),
  (c) EdgeCache misses against the CPU engine (distinct prompts, max_tokens=8),
  (d) TTFT of a streaming request sharing a ~1.5k-token system prompt, cold (new system prompt) vs warm,
  (e) the token path: tokens/s of N concurrent streamed misses (N = 1, 16, 64) from an engine double that yields
      tokens as fast as it can, through EdgeCache (the double in process, and behind --upstream) and served bare
      (see edgecache/bench/relay.py),
and prints requests/s and p50/p99 latency for each, the ratios (b)/(a), streamed hit over JSON hit, a Messages
hit and a Responses hit over a chat hit (JSON and streamed), and the
token path's tokens/s through EdgeCache over bare at each N.

(a) and (b) are driven by wrk (Debian package `wrk`), a C load generator, so the client is not the bottleneck;
they alternate for --rounds rounds and the median round is reported. (c) and (d) use httpx: their cost is the model.

    python scripts/bench_hitpath.py [--duration 5] [--rounds 3] [--connections 16] [--hits-only | --relay-only]
"""


import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from edgecache.bench import relay
from edgecache.bench.harness import cpu_seconds, free_port, percentile, start_server, wait_ready

MODEL = "SmolLM2-135M-Instruct"
HIT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8, "temperature": 0}

TOOL_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
             "max_tokens": 48, "temperature": 0,
             "tools": [{"type": "function", "function": {
                 "name": "get_weather", "description": "The current weather in a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                                "required": ["city"]}}}],
             "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
             # A weather question is a realtime answer (ttl_tiers: 30 s): left to the classifier it expires mid-run
             # and the rows would time a miss on the CPU engine every 30 s. Pinned, they time hits only.
             "edgecache": {"ttl_tier": "static"}}
STRUCTURED_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "The weather in Oslo, as JSON."}],
                   "max_tokens": 48, "temperature": 0,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "weather", "schema": {
                       "type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                        "celsius": {"type": "integer"}},
                       "required": ["city", "celsius"]}}},
                   "edgecache": {"ttl_tier": "static"}}  # the weather again: see TOOL_BODY
STREAM_BODY = {**HIT_BODY, "stream": True}  # the same entry as HIT_BODY (stream is not in the key), streamed
# Anthropic's Messages API asking for the same generation as HIT_BODY: the same key, so the same stored entry.
MESSAGES = "/v1/messages"
MESSAGES_BODY = {"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": HIT_BODY["messages"]}
MESSAGES_STREAM_BODY = {**MESSAGES_BODY, "stream": True}
# OpenAI's Responses API asking for the same generation: the same key again. Stored as a response each time (store
# defaults to true, as OpenAI's), or not (store: false, as Codex CLI sends).
RESPONSES = "/v1/responses"
RESPONSES_BODY = {"model": MODEL, "input": HIT_BODY["messages"][0]["content"], "max_output_tokens": 8,
                  "temperature": 0}
RESPONSES_STREAM_BODY = {**RESPONSES_BODY, "stream": True}
RESPONSES_UNSTORED_BODY = {**RESPONSES_BODY, "store": False}


def bare_app():  # the baseline: nothing but litestar, uvicorn, uvloop and httptools
    from litestar import Litestar, Request, Response, post

    body = json.dumps({"id": "chatcmpl-0", "object": "chat.completion", "created": 0, "model": MODEL,
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."},
                                    "finish_reason": "stop", "logprobs": None}],
                       "usage": {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
                                 "prompt_tokens_details": {"cached_tokens": 40}}}).encode()

    @post("/v1/chat/completions", status_code=200)
    async def constant(request: Request) -> Response:
        await request.body()
        return Response(content=body, media_type="application/json", headers={"X-EdgeCache": "exact"})

    return Litestar([constant], openapi_config=None)


def run_wrk(url: str, body: dict, duration: int, connections: int, workdir: Path,
            path: str = "/v1/chat/completions", server: subprocess.Popen | None = None) -> dict[str, float]:
    """One wrk round: requests/s and latency; with ``server``, also its CPU time per request (``cpu_us``), which a
    busy box inflates far less than it cuts requests/s."""
    script = workdir / "post.lua"
    script.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                      f"wrk.body = {json.dumps(json.dumps(body))}\n")
    cpu_before = cpu_seconds(server.pid) if server is not None else 0.0
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", "-s", str(script),
                          url + path], capture_output=True, text=True, check=True).stdout
    if "Non-2xx" in out:
        raise SystemExit(f"wrk saw errors:\n{out}")

    def ms(label: str) -> float:
        value, unit = re.search(rf"^\s*{label}\s+([\d.]+)(us|ms|s)\s*$", out, re.MULTILINE).groups()
        return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]

    requests = int(re.search(r"(\d+) requests in", out).group(1))
    cpu_us = (cpu_seconds(server.pid) - cpu_before) * 1e6 / max(1, requests) if server is not None else 0.0
    return {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)), "p50_ms": ms("50%"),
            "p99_ms": ms("99%"), "cpu_us": cpu_us}


def bench_misses(url: str, n: int) -> dict[str, float]:
    latencies = []
    start = time.perf_counter()
    with httpx.Client(timeout=120) as c:
        for i in range(n):
            body = {**HIT_BODY, "messages": [{"role": "user", "content": f"Give me fact number {i} about owls."}]}
            t = time.perf_counter()
            r = c.post(url + "/v1/chat/completions", json=body)
            latencies.append((time.perf_counter() - t) * 1000)
            assert r.headers["x-edgecache"] == "miss", r.headers
    return {"rps": n / (time.perf_counter() - start), "p50_ms": percentile(latencies, 0.5),
            "p99_ms": percentile(latencies, 0.99)}


def ttft_ms(url: str, system: str, question: str) -> tuple[float, int]:
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    t = time.perf_counter()
    first = None
    cached = -1
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and first is None and '"content":"' in line and '"content":""' not in line:
                first = (time.perf_counter() - t) * 1000
            if line.startswith("data: {") and '"usage":{' in line:
                cached = json.loads(line[6:])["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first if first is not None else (time.perf_counter() - t) * 1000, cached


def system_prompt(seed: int) -> str:
    # ~1.5k SmolLM2 tokens of policy text; the seed makes each cold prompt new to the engine.
    return f"You are support agent #{seed} of ACME Rockets. " + " ".join(
        f"Policy {seed}.{i}: rockets of series {i} ship within {i % 7 + 1} days, carry a {i % 3 + 1}-year "
        f"warranty and are serviced in hangar {i % 11}." for i in range(41))


RELAY_STREAMS = (1, 16, 64)


def bench_relay(duration: int, rounds: int, tokens: int, work: Path,
                read_every_s: float = 0.0) -> dict[str, dict[str, Any]]:
    """(e): tokens/s through bare, EdgeCache in process and EdgeCache --upstream (in front of the bare server), at
    each N, rounds alternated; the median round's figures and the ratios through EdgeCache over bare."""
    ports = {name: free_port() for name in ("bare", "inprocess", "upstream")}
    procs = [subprocess.Popen([sys.executable, __file__, "--relay-server", "bare", str(ports["bare"])]),
             subprocess.Popen([sys.executable, __file__, "--relay-server", "inprocess", str(ports["inprocess"]),
                               str(work / "relay-inprocess")]),
             subprocess.Popen([sys.executable, __file__, "--relay-server", "upstream", str(ports["upstream"]),
                               str(work / "relay-upstream"), f"http://127.0.0.1:{ports['bare']}/v1"])]
    try:
        wait_ready(f"http://127.0.0.1:{ports['bare']}", procs[0], path="/v1/chat/completions", ready=(200, 405),
                   timeout=120, poll_s=0.1)
        for name in ("inprocess", "upstream"):
            wait_ready(f"http://127.0.0.1:{ports[name]}", procs[1 if name == "inprocess" else 2], timeout=120,
                       poll_s=0.1)
        for name, port in ports.items():  # each path relays every token, in order
            text = relay.sample_text(relay.run_drive(port, 1, 0.5, 32).sample)
            assert text == relay.TokenEngine.token * 32, (name, text[:200])
        out: dict[str, dict[str, Any]] = {}
        pids = {"bare": [procs[0].pid], "inprocess": [procs[1].pid], "upstream": [procs[2].pid]}
        for n in RELAY_STREAMS:
            rate: dict[str, list[float]] = {name: [] for name in ports}
            per_cpu: dict[str, list[float]] = {name: [] for name in ports}  # tokens per CPU-second of the server
            client: dict[str, list[float]] = {name: [] for name in ports}  # the client's CPU us per token
            for _ in range(rounds):
                for name, port in ports.items():
                    before = [cpu_seconds(pid) for pid in pids[name]]
                    client_before = time.process_time()
                    tally = relay.run_drive(port, n, duration, tokens, read_every_s)
                    used = sum(cpu_seconds(pid) - b for pid, b in zip(pids[name], before))
                    rate[name].append(tally.tokens_per_s)
                    per_cpu[name].append(tally.tokens / used if used else 0.0)
                    client[name].append((time.process_time() - client_before) / max(1, tally.tokens) * 1e6)
            med = {name: statistics.median(values) for name, values in rate.items()}
            cpu = {name: statistics.median(values) for name, values in per_cpu.items()}
            out[str(n)] = {"bare_tokens_per_s": round(med["bare"]),
                           "inprocess_tokens_per_s": round(med["inprocess"]),
                           "upstream_tokens_per_s": round(med["upstream"]),
                           "inprocess_over_bare": round(med["inprocess"] / med["bare"], 3),
                           "upstream_over_bare": round(med["upstream"] / med["bare"], 3),
                           # tokens per CPU-second of the serving process: bare, EdgeCache with the double in
                           # process, and EdgeCache relaying --upstream (its own process, not the upstream's)
                           "bare_tokens_per_cpu_s": round(cpu["bare"]),
                           "inprocess_tokens_per_cpu_s": round(cpu["inprocess"]),
                           "upstream_relay_tokens_per_cpu_s": round(cpu["upstream"]),
                           "inprocess_over_bare_cpu": round(cpu["inprocess"] / cpu["bare"], 3),
                           "upstream_over_bare_cpu": round(cpu["upstream"] / cpu["bare"], 3),
                           # the client shares the cores with the servers: what it took, per token, in each arm
                           "client_us_per_token": {name: round(statistics.median(values), 1)
                                                   for name, values in client.items()}}
        return out
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)


def print_relay(figures: dict[str, dict[str, Any]], tokens: int, read_every_ms: float) -> None:
    pace = f"every {read_every_ms:g} ms" if read_every_ms else "as bytes come"
    print(f"\ntoken path: N streamed misses of {tokens} tokens each from an engine double, the client reading each "
          f"stream {pace} (median round); tokens/s, and tokens per CPU-second of the serving process")
    print(f"{'N':>4}{'bare':>10}{'in process':>12}{'ratio':>8}{'--upstream':>12}{'ratio':>8}"
          f"{'bare/cpu':>10}{'in proc/cpu':>13}{'ratio':>8}{'relay/cpu':>11}{'ratio':>8}"
          f"{'client us/token (bare, in proc, upstream)':>44}")
    for n, f in figures.items():
        print(f"{n:>4}{f['bare_tokens_per_s']:>10}{f['inprocess_tokens_per_s']:>12}{f['inprocess_over_bare']:>8}"
              f"{f['upstream_tokens_per_s']:>12}{f['upstream_over_bare']:>8}{f['bare_tokens_per_cpu_s']:>10}"
              f"{f['inprocess_tokens_per_cpu_s']:>13}{f['inprocess_over_bare_cpu']:>8}"
              f"{f['upstream_relay_tokens_per_cpu_s']:>11}{f['upstream_over_bare_cpu']:>8}"
              f"{', '.join(str(f['client_us_per_token'][k]) for k in ('bare', 'inprocess', 'upstream')):>44}")


def relay_over_bare(figures: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Through EdgeCache over bare at each N: by tokens/s, and by tokens per CPU-second of the serving process."""
    return {"inprocess": {n: f["inprocess_over_bare"] for n, f in figures.items()},
            "upstream": {n: f["upstream_over_bare"] for n, f in figures.items()},
            "inprocess_cpu": {n: f["inprocess_over_bare_cpu"] for n, f in figures.items()},
            "upstream_cpu": {n: f["upstream_over_bare_cpu"] for n, f in figures.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=int, default=5, help="seconds per wrk round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--misses", type=int, default=20)
    ap.add_argument("--hits-only", action="store_true", help="skip the miss, TTFT and token path measurements")
    ap.add_argument("--relay-only", action="store_true", help="only the token path measurement (e)")
    ap.add_argument("--relay-tokens", type=int, default=256, help="tokens per stream in (e)")
    ap.add_argument("--relay-read-every-ms", type=float, default=0.0,
                    help="(e)'s client reads each stream at most this often (0: as bytes come; see relay.drive)")
    ap.add_argument("--bare-server", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--relay-server", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.bare_server:
        relay.serve(bare_app(), args.bare_server)
        return
    if args.relay_server:
        kind, port, *rest = args.relay_server
        if kind == "bare":
            relay.serve(relay.bare_app(), int(port))
        else:
            relay.serve_edgecache(Path(rest[0]), rest[1] if kind == "upstream" else None, int(port))
        return
    if args.relay_only:
        work = Path(tempfile.mkdtemp(prefix="bench-relay-"))
        try:
            figures = bench_relay(args.duration, args.rounds, args.relay_tokens, work,
                                  args.relay_read_every_ms / 1000)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print_relay(figures, args.relay_tokens, args.relay_read_every_ms)
        print(json.dumps({"relay_over_bare": relay_over_bare(figures), "relay": figures,
                          "relay_client_read_every_ms": args.relay_read_every_ms}))
        return
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is needed for the hit-path rounds: apt-get install wrk")

    work = Path(tempfile.mkdtemp(prefix="bench-hitpath-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGECACHE_")}
    bare_port, ec_port = free_port(), free_port()
    bare_url, ec_url = f"http://127.0.0.1:{bare_port}", f"http://127.0.0.1:{ec_port}"
    procs = [
        subprocess.Popen([sys.executable, __file__, "--bare-server", str(bare_port)], env=env),
        start_server(["--profile", "cpu", "--port", str(ec_port), "--data-dir", str(work / "data")],
                     env={"EDGECACHE_SERVER__LOG_LEVEL": "warning"}, clean_env=True),
    ]
    try:
        wait_ready(bare_url, procs[0], path="/v1/chat/completions", ready=(200, 405), timeout=120, poll_s=0.1)
        wait_ready(ec_url, procs[1], timeout=120, poll_s=0.1)
        for body in (HIT_BODY, TOOL_BODY, STRUCTURED_BODY):
            first = httpx.post(ec_url + "/v1/chat/completions", json=body, timeout=120)
            assert first.headers["x-edgecache"] == "miss", first.text
            assert httpx.post(ec_url + "/v1/chat/completions", json=body).headers["x-edgecache"] == "exact"
        assert httpx.post(ec_url + "/v1/chat/completions", json=STREAM_BODY).headers["x-edgecache"] == "exact"
        for body in (MESSAGES_BODY, MESSAGES_STREAM_BODY):  # one key with the chat request: a hit at once
            assert httpx.post(ec_url + MESSAGES, json=body).headers["x-edgecache"] == "exact"
        for body in (RESPONSES_BODY, RESPONSES_STREAM_BODY, RESPONSES_UNSTORED_BODY):  # the same key again
            assert httpx.post(ec_url + RESPONSES, json=body).headers["x-edgecache"] == "exact"
        tool_answer = httpx.post(ec_url + "/v1/chat/completions", json=TOOL_BODY).json()
        assert tool_answer["choices"][0]["message"]["tool_calls"], tool_answer

        bare_rounds, hit_rounds, stream_rounds, tool_rounds, structured_rounds = [], [], [], [], []
        messages_rounds, messages_stream_rounds = [], []
        responses_rounds, responses_stream_rounds, responses_unstored_rounds = [], [], []
        for _ in range(args.rounds):  # alternate, so drift on a shared machine hits all alike
            bare_rounds.append(run_wrk(bare_url, HIT_BODY, args.duration, args.connections, work, server=procs[0]))
            hit_rounds.append(run_wrk(ec_url, HIT_BODY, args.duration, args.connections, work, server=procs[1]))
            stream_rounds.append(run_wrk(ec_url, STREAM_BODY, args.duration, args.connections, work,
                                         server=procs[1]))
            tool_rounds.append(run_wrk(ec_url, TOOL_BODY, args.duration, args.connections, work, server=procs[1]))
            structured_rounds.append(run_wrk(ec_url, STRUCTURED_BODY, args.duration, args.connections, work,
                                             server=procs[1]))
            messages_rounds.append(run_wrk(ec_url, MESSAGES_BODY, args.duration, args.connections, work, MESSAGES,
                                           server=procs[1]))
            messages_stream_rounds.append(run_wrk(ec_url, MESSAGES_STREAM_BODY, args.duration, args.connections,
                                                  work, MESSAGES, server=procs[1]))
            responses_rounds.append(run_wrk(ec_url, RESPONSES_BODY, args.duration, args.connections, work, RESPONSES,
                                            server=procs[1]))
            responses_stream_rounds.append(run_wrk(ec_url, RESPONSES_STREAM_BODY, args.duration, args.connections,
                                                   work, RESPONSES, server=procs[1]))
            responses_unstored_rounds.append(run_wrk(ec_url, RESPONSES_UNSTORED_BODY, args.duration,
                                                     args.connections, work, RESPONSES, server=procs[1]))
        med = lambda rounds: sorted(rounds, key=lambda r: r["rps"])[len(rounds) // 2]
        med_cpu = lambda rounds: statistics.median(r["cpu_us"] for r in rounds)
        bare, hit, streamed = med(bare_rounds), med(hit_rounds), med(stream_rounds)
        tool, structured = med(tool_rounds), med(structured_rounds)
        messages, messages_streamed = med(messages_rounds), med(messages_stream_rounds)
        responses, responses_streamed = med(responses_rounds), med(responses_stream_rounds)
        responses_unstored = med(responses_unstored_rounds)
        api_ratios = {"messages_hit_over_chat_hit": round(messages["rps"] / hit["rps"], 3),
                      "messages_stream_hit_over_chat_stream_hit": round(messages_streamed["rps"] / streamed["rps"], 3),
                      # by the server's CPU time per request, which a busy machine disturbs less than requests/s
                      "messages_hit_over_chat_hit_cpu": round(med_cpu(hit_rounds) / med_cpu(messages_rounds), 3),
                      "messages_stream_hit_over_chat_stream_hit_cpu": round(
                          med_cpu(stream_rounds) / med_cpu(messages_stream_rounds), 3),
                      "responses_hit_over_chat_hit": round(responses["rps"] / hit["rps"], 3),
                      "responses_stream_hit_over_chat_stream_hit":
                          round(responses_streamed["rps"] / streamed["rps"], 3),
                      "responses_unstored_hit_over_chat_hit": round(responses_unstored["rps"] / hit["rps"], 3),
                      # by the server's CPU time per request (median round of each), which drifts less on a busy box
                      "responses_hit_over_chat_hit_cpu": round(med_cpu(hit_rounds) / med_cpu(responses_rounds), 3),
                      "responses_stream_hit_over_chat_stream_hit_cpu":
                          round(med_cpu(stream_rounds) / med_cpu(responses_stream_rounds), 3),
                      "responses_unstored_hit_over_chat_hit_cpu":
                          round(med_cpu(hit_rounds) / med_cpu(responses_unstored_rounds), 3)}
        api_rows = (("(m) Messages exact hit", messages), ("(m*) Messages hit, stream: true", messages_streamed),
                    ("(r) Responses exact hit (stored)", responses),
                    ("(r*) Responses hit, stream: true", responses_streamed),
                    ("(r-) Responses hit, store: false", responses_unstored))
        if args.hits_only:
            ratios = {name: round(r["rps"] / bare["rps"], 3) for name, r in
                      (("hit_over_bare", hit), ("tool_hit_over_bare", tool),
                       ("structured_hit_over_bare", structured))}
            print(f"{'':38}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'CPU us':>10}")
            for name, r in (("(a) bare litestar, constant JSON", bare), ("(b) EdgeCache exact hit", hit),
                            ("(b*) exact hit, stream: true", streamed),
                            ("(b') exact hit, tool call", tool), ("(b'') exact hit, structured", structured),
                            *api_rows):
                print(f"{name:38}{r['rps']:>10.0f}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}{r['cpu_us']:>10.1f}")
            print(json.dumps({"bare_rps": round(bare["rps"]), "hit_rps": round(hit["rps"]),
                              "stream_hit_rps": round(streamed["rps"]), **ratios,
                              "stream_hit_over_json_hit": round(streamed["rps"] / hit["rps"], 3), **api_ratios,
                              # the same ratios by the server's CPU time per request (median round of each)
                              "hit_over_bare_cpu": round(med_cpu(bare_rounds) / med_cpu(hit_rounds), 3),
                              "stream_hit_over_json_hit_cpu": round(med_cpu(hit_rounds) / med_cpu(stream_rounds),
                                                                    3)}))
            return
        miss = bench_misses(ec_url, args.misses)
        relayed = bench_relay(args.duration, args.rounds, args.relay_tokens, work, args.relay_read_every_ms / 1000)

        cold, warm, cached = [], [], []
        for seed in range(3):
            system = system_prompt(seed)
            t, _ = ttft_ms(ec_url, system, "Which hangar services series 5?")
            cold.append(t)
            t, c = ttft_ms(ec_url, system, "How long does series 8 take to ship?")
            warm.append(t)
            cached.append(c)
        prompt_tokens = httpx.post(ec_url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": system_prompt(0)},
                         {"role": "user", "content": "How long does series 8 take to ship?"}]}).json()["usage"]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nhit path on {os.cpu_count()} cores, wrk -t1 -c{args.connections}, {args.rounds} x {args.duration}s "
          f"rounds (median round)")
    print(f"{'':38}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
    for name, r in (("(a) bare litestar, constant JSON", bare), ("(b) EdgeCache exact hit", hit),
                    ("(b*) exact hit, stream: true", streamed), ("(b') exact hit, tool call", tool),
                    ("(b'') exact hit, structured", structured), *api_rows,
                    ("(c) EdgeCache miss, CPU engine, 8 tokens", miss)):
        print(f"{name:38}{r['rps']:>10.0f}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}")
    ratio = hit["rps"] / bare["rps"]
    print(f"\n(b)/(a) throughput ratio: {ratio:.2f}   (goal >= 0.8); tool-call hit {tool['rps'] / bare['rps']:.2f}, "
          f"structured hit {structured['rps'] / bare['rps']:.2f}")
    print(f"(b*)/(b) streamed hit over JSON hit: {streamed['rps'] / hit['rps']:.2f}   (goal >= 0.8)")
    print(f"(m)/(b) Messages hit over chat hit: {messages['rps'] / hit['rps']:.2f}, streamed (m*)/(b*): "
          f"{messages_streamed['rps'] / streamed['rps']:.2f}   (goal >= 0.8)")
    print(f"(r)/(b) Responses hit over chat hit: {responses['rps'] / hit['rps']:.2f}, streamed (r*)/(b*): "
          f"{responses_streamed['rps'] / streamed['rps']:.2f}, store: false {responses_unstored['rps'] / hit['rps']:.2f}"
          f"   (goal >= 0.8)")
    print(f"(b)/(c) hit vs miss throughput: {hit['rps'] / miss['rps']:.0f}x")
    print(f"\nTTFT with a shared ~{prompt_tokens['prompt_tokens']}-token system prompt (median of 3):")
    print(f"  cold {statistics.median(cold):.0f} ms   warm {statistics.median(warm):.0f} ms   "
          f"-> {statistics.median(cold) / statistics.median(warm):.1f}x faster; warm cached_tokens {cached}")
    print_relay(relayed, args.relay_tokens, args.relay_read_every_ms)
    print(json.dumps({"bare_rps": round(bare["rps"]), "hit_rps": round(hit["rps"]), "hit_over_bare": round(ratio, 3),
                      "tool_hit_over_bare": round(tool["rps"] / bare["rps"], 3),
                      "structured_hit_over_bare": round(structured["rps"] / bare["rps"], 3),
                      "stream_hit_over_json_hit": round(streamed["rps"] / hit["rps"], 3), **api_ratios,
                      "hit_p50_ms": hit["p50_ms"], "hit_p99_ms": hit["p99_ms"], "miss_rps": round(miss["rps"], 2),
                      "miss_p50_ms": round(miss["p50_ms"], 1), "ttft_cold_ms": round(statistics.median(cold)),
                      "ttft_warm_ms": round(statistics.median(warm)), "prompt_tokens": prompt_tokens["prompt_tokens"],
                      "relay_over_bare": relay_over_bare(relayed)}))


if __name__ == "__main__":
    main()
