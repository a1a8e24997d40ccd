"""What the decision log costs a semantic lookup: lookups per second with the log off and on, side by side in one
run, in alternating rounds so a busy box's noise spreads over both; and the event loop's own cost of one record
(encode + hand-over to the writer thread).

In process (the app behind httpx's ASGI transport, the real embedder and index, a fake engine): every request is a
new wording of a stored prompt, so each one embeds, searches, decides and (log on) appends a decision. Two kinds:
``hits`` (scenario support: the wordings are served from the stored prompt) and ``misses`` (scenario default,
a number in each wording: the candidate is refused, the fake engine answers at once, and with the log on the
refused candidate is labelled: one store read and one embedding of the two answers, in the background). A real
engine spends about a second on such a miss; the fake spends nothing, so the label's share shows at its largest.

    python scripts/bench_decision_log.py [--requests 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from edgecache.http.app import create_app
from edgecache.semantic.decision_log import DecisionLog
from edgecache.semantic.lookup import Lookup, SemanticHit, record_lookup
from edgecache.settings import resolve_settings
from edgecache.bench.engines import FakeEngine


def body(text: str) -> dict[str, object]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": text}], "temperature": 0,
            "max_tokens": 16}


FILLERS = ("please", "kindly", "now", "today", "quickly", "again", "here", "soon", "simply", "exactly", "really",
           "actually", "properly", "safely", "still", "just", "then", "right", "fast", "myself")


def wording(kind: str, i: int) -> str:
    if kind == "misses":
        return f"How do I reset my password? #{i}"
    a, b, c = FILLERS[i % 20], FILLERS[(i // 20) % 20], FILLERS[(i // 400) % 20]
    return f"how do I reset my password {a} {b} {c}"


async def lookups_per_second(kind: str, log_on: bool, requests: int, data_dir: str, offset: int
                             ) -> tuple[float, dict[str, int]]:
    settings = resolve_settings("cpu", {"data_dir": data_dir, "semantic.enabled": True,
                                        "semantic.decision_log_bytes": 64 << 20 if log_on else 0}, environ={})
    app = create_app(settings, engine=FakeEngine())
    async with app.lifespan():
        rt = app.state.runtime
        while not rt.ready:
            await asyncio.sleep(0.01)
        assert (rt.decisions is not None) == log_on
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench") as client:
            headers = {"X-EdgeCache-Scenario": "support" if kind == "hits" else "default"}
            await client.post("/v1/chat/completions", json=body("how do I reset my password"), headers=headers)
            while len(rt.inflight):
                await asyncio.sleep(0.01)
            served: dict[str, int] = {}
            started = time.perf_counter()
            for i in range(requests):
                # A new wording each time (never an exact hit): every request runs the semantic lookup.
                resp = await client.post("/v1/chat/completions", json=body(wording(kind, offset + i)),
                                         headers=headers)
                served[resp.headers["x-edgecache"]] = served.get(resp.headers["x-edgecache"], 0) + 1
            while len(rt.inflight) or (rt.labels is not None and rt.labels._tasks):
                await asyncio.sleep(0.001)  # the labels under way are part of the cost
            elapsed = time.perf_counter() - started
    return requests / elapsed, served


def record_cost_us(n: int = 20000) -> float:
    """The loop's cost of one decision record, in microseconds (the file write happens on the writer thread)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = DecisionLog(Path(tmp), max_bytes=64 << 20)
        lookup = Lookup(vector=np.zeros(4, dtype=np.float32), refusal="below_threshold",
                        candidate=SemanticHit(similarity=0.91, store_key="k" * 32, vector_key=12345))
        started = time.perf_counter()
        for i in range(n):
            record_lookup(log, "acme", "support", "How do I reset my password?", lookup, served=False)
        elapsed = time.perf_counter() - started
        log.close()
    return elapsed / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("hits", "misses"):
            rates: dict[str, list[float]] = {"off": [], "on": []}
            for round_ in range(args.rounds):
                for variant in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
                    rate, served = asyncio.run(lookups_per_second(
                        kind, variant == "on", args.requests, f"{tmp}/{kind}-{variant}-{round_}",
                        round_ * args.requests))
                    rates[variant].append(rate)
                    print(f"{kind} round {round_ + 1} log {variant}: {rate:.0f} lookups/s {served}", flush=True)
            off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
            summary.append(f"{kind}: off {off:.0f}/s, on {on:.0f}/s, on/off {on / off:.3f}")
    print("median " + "; ".join(summary) + f"; one record on the loop {record_cost_us():.1f} us")


if __name__ == "__main__":
    main()
