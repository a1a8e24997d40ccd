"""What the access log costs on the hit path: exact hits per second with the log off, on (batched, the default) and
on with a write per line, side by side in one run, in rounds so a busy box's noise spreads over all three.

In process (the app behind httpx's ASGI transport, a fake engine: hits never reach it), so the figure is the
app's own cost per hit, the log's included; the log writes to a file like a server's would.

    python scripts/bench_access_log.py [--requests 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from edgecache.http.app import create_app
from edgecache.settings import resolve_settings
from edgecache.bench.engines import FakeEngine

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "a cached question"}], "temperature": 0,
        "max_tokens": 16}


async def hits_per_second(variant: str, requests: int, data_dir: str) -> float:
    settings = resolve_settings("cpu", {"data_dir": data_dir, "semantic.enabled": False,
                                        "server.access_log": variant != "off"}, environ={})
    app = create_app(settings, engine=FakeEngine())
    async with app.lifespan():
        rt = app.state.runtime
        while not rt.ready:
            await asyncio.sleep(0.01)
        if variant == "per-line":
            app.state.front.access_log.max_batch = 1
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench") as client:
            await client.post("/v1/chat/completions", json=BODY)  # the miss that makes the rest hits
            started = time.perf_counter()
            for _ in range(requests):
                resp = await client.post("/v1/chat/completions", json=BODY)
                assert resp.headers["x-edgecache"] == "exact"
            elapsed = time.perf_counter() - started
        app.state.front.access_log.flush()
    return requests / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    variants = ("off", "batched", "per-line")
    rates: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        handler = logging.FileHandler(Path(tmp) / "access.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        access = logging.getLogger("edgecache.access")
        access.addHandler(handler)
        access.setLevel(logging.INFO)
        access.propagate = False
        for round_ in range(args.rounds):
            for variant in variants:
                rates[variant].append(asyncio.run(hits_per_second(variant, args.requests,
                                                                  f"{tmp}/data-{variant}-{round_}")))
        lines = sum(1 for _ in open(Path(tmp) / "access.log", encoding="utf-8"))
    off = statistics.median(rates["off"])
    print(f"exact hits/s, median of {args.rounds} rounds of {args.requests} (in process, one client):")
    for variant in variants:
        rate = statistics.median(rates[variant])
        print(f"  access log {variant:9s} {rate:8.0f} /s   off/this = {off / rate:.2f}x")
    print(f"  ({lines} lines written to the log file)")


if __name__ == "__main__":
    main()
