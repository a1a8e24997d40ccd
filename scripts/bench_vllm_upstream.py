"""What relaying through EdgeCache costs in front of a real vLLM: time to first token direct to vLLM against through
`edgecache serve --upstream`, on misses.

vLLM's CPU build serves the shipped SmolLM2 (``edgecache.bench.vllm``: installed into ``.vllm-venv/`` when missing),
with prefix caching on; EdgeCache fronts it with the semantic layer off, so a request asked once is a miss that
goes to vLLM. Each prompt is sent once to each arm, streamed, one request at a time, the two arms alternating which
goes first. No request reuses another's prefix at vLLM: every prompt opens with its own ticket number, and the arms
send different cache salts (the direct arm its own, EdgeCache its tenant's), so both arms prefill the whole prompt.

Two prompt sizes: a short question, and the same under a long system prompt (~1,300 tokens) that is new each time.
Reported per size and arm: TTFT median and p90 (ms), and the median of the per-prompt difference (through - direct).

    python scripts/bench_vllm_upstream.py --requests 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from edgecache.bench.harness import free_port, percentile, start_server, stop_process, wait_ready
from edgecache.bench.vllm import MODEL, VENV, VLLMServer, prepare

POLICIES = " ".join(f"Policy {i}: rockets of series {i} ship within {i % 7 + 1} days and carry a {i % 3 + 1}-year "
                    "warranty." for i in range(60))


def body(i: int, size: str) -> dict[str, Any]:
    ticket = f"Ticket {i:04d}."
    messages = [{"role": "user", "content": f"{ticket} Which rockets ship fastest, and why?"}]
    if size == "long":
        messages.insert(0, {"role": "system", "content": f"{ticket} You are the support assistant of ACME Rockets. "
                                                         + POLICIES})
    return {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 16, "stream": True}


def ttft(url: str, payload: dict[str, Any]) -> float:
    """Seconds from sending the request to its first content token."""
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=payload, timeout=300) as resp:
        if resp.status_code != 200:
            raise SystemExit(f"{url} answered {resp.status_code}: {resp.read()[:300]!r}")
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if event.get("choices") and event["choices"][0].get("delta", {}).get("content"):
                    elapsed = time.perf_counter() - start
                    for _ in lines:  # read the rest: the next request starts on an idle engine
                        pass
                    return elapsed
    raise SystemExit(f"{url} streamed no content")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20, help="prompts per size (each sent to both arms)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured requests per arm first")
    parser.add_argument("--venv", type=Path, default=VENV)
    args = parser.parse_args()

    python, model_dir = prepare(args.venv, log=sys.stderr)
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    vllm = VLLMServer(python, model_dir, root / "vllm.log").start()
    port = free_port()
    front_url = f"http://127.0.0.1:{port}"
    with (root / "front.log").open("ab") as log:
        front = start_server(["--upstream", vllm.api, "--port", str(port), "--data-dir", str(root / "data")],
                             env={"EDGECACHE_SEMANTIC__ENABLED": "false"}, log=log, clean_env=True)
    try:
        wait_ready(front_url, front, timeout=120)
        arms = {"direct": vllm.url, "through": front_url}
        salts = {"direct": {"cache_salt": "bench-direct"}, "through": {}}
        for n in range(args.warmup):
            for arm, url in arms.items():
                ttft(url, {**body(90_000 + n, "short"), **salts[arm]})
        figures: dict[str, dict[str, list[float]]] = {}
        for size in ("short", "long"):
            times: dict[str, list[float]] = {"direct": [], "through": []}
            for i in range(args.requests):
                order = ("direct", "through") if i % 2 == 0 else ("through", "direct")
                for arm in order:
                    times[arm].append(ttft(arms[arm], {**body(i + (10_000 if size == "long" else 0), size),
                                                       **salts[arm]}))
            figures[size] = times
        requests = vllm.requests_served()
    finally:
        stop_process(front)
        vllm.stop()

    print(f"vLLM requests served: {requests}; logs in {root}", file=sys.stderr)
    print("| prompt | arm | TTFT median (ms) | TTFT p90 (ms) |")
    print("| --- | --- | --- | --- |")
    report: dict[str, Any] = {}
    for size, times in figures.items():
        for arm, values in times.items():
            print(f"| {size} | {arm} | {1000 * statistics.median(values):.1f} | {1000 * percentile(values, 0.9):.1f} |")
        deltas = [t - d for t, d in zip(times["through"], times["direct"], strict=True)]
        report[size] = {arm: round(1000 * statistics.median(v), 1) for arm, v in times.items()}
        report[size]["overhead_median_ms"] = round(1000 * statistics.median(deltas), 1)
    for size in figures:
        print(f"{size}: through - direct, median of the per-prompt differences: "
              f"{report[size]['overhead_median_ms']:.1f} ms")
    print(json.dumps({"requests_per_size": args.requests, **report}))


if __name__ == "__main__":
    main()
