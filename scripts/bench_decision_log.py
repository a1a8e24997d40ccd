"""What the decision log costs a semantic lookup: lookups per second with the log off and on, side by side in one
run, in alternating rounds so a busy box's noise spreads over both; and the event loop's own cost of one record
(encode + hand-over to the writer thread).

In process (the app behind httpx's ASGI transport, the real embedder and index, a fake engine): every request is a
new wording of a stored prompt, so each one embeds, searches, decides and (log on) appends a decision.

    python scripts/bench_decision_log.py [--requests 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgecache.app import create_app  # noqa: E402
from edgecache.decision_log import DecisionLog, record_lookup  # noqa: E402
from edgecache.semantic_cache import Lookup, SemanticHit  # noqa: E402
from edgecache.settings import resolve_settings  # noqa: E402
from tests.fakes import FakeEngine  # noqa: E402


def body(text: str) -> dict[str, object]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": text}], "temperature": 0,
            "max_tokens": 16}


async def lookups_per_second(log_on: bool, requests: int, data_dir: str, offset: int) -> float:
    settings = resolve_settings("cpu", {"data_dir": data_dir, "semantic.enabled": True,
                                        "semantic.decision_log_bytes": 64 << 20 if log_on else 0}, environ={})
    app = create_app(settings, engine=FakeEngine())
    async with app.lifespan():
        rt = app.state.runtime
        while not rt.ready:
            await asyncio.sleep(0.01)
        assert (rt.decisions is not None) == log_on
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench") as client:
            await client.post("/v1/chat/completions", json=body("How do I reset my password?"))
            while len(rt.inflight):
                await asyncio.sleep(0.01)
            started = time.perf_counter()
            for i in range(requests):
                # A new wording each time (never an exact hit): every request runs the semantic lookup.
                await client.post("/v1/chat/completions", json=body(f"How do I reset my password? #{offset + i}"))
            elapsed = time.perf_counter() - started
    return requests / elapsed


def record_cost_us(n: int = 20000) -> float:
    """The loop's cost of one decision record, in microseconds (the file write happens on the writer thread)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = DecisionLog(Path(tmp), max_bytes=64 << 20)
        lookup = Lookup(vector=np.zeros(4, dtype=np.float32), similarity=0.91, refusal="below_threshold",
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
    rates: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for variant in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
                rate = asyncio.run(lookups_per_second(variant == "on", args.requests,
                                                      f"{tmp}/{variant}-{round_}", round_ * args.requests))
                rates[variant].append(rate)
                print(f"round {round_ + 1} log {variant}: {rate:.0f} semantic lookups/s", flush=True)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    per_record = record_cost_us()
    print(f"median: off {off:.0f}/s, on {on:.0f}/s, on/off {on / off:.3f}; one record on the loop "
          f"{per_record:.1f} us")


if __name__ == "__main__":
    main()
