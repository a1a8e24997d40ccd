"""How many CPU threads the llama.cpp engine should use on a box that also serves hits.

For each ``engine.threads`` value, side by side in one run: start a real server (cpu profile, the real SmolLM2
engine, the real embedder), keep a stream of exact hits going from a few clients (what a cache box does all day),
and time a handful of distinct 32-token misses meanwhile. Prints each setting's median miss latency and hit rate
per second, as ratios to the best setting.

    python scripts/bench_threads.py [--threads 1,2] [--misses 3] [--hit-clients 4]

Default threads: 1 and the core count (and cores-1 when that differs from both).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import tempfile
import time

import httpx

from edgecache.bench.harness import free_port, start_server, stop_process

MODEL = "SmolLM2-135M-Instruct"  # what the cpu profile's default model is called on the wire


def body(text: str, max_tokens: int) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "temperature": 0,
            "max_tokens": max_tokens}


async def measure(threads: int, misses: int, hit_clients: int, data_dir: str) -> tuple[float, float]:
    port = free_port()
    server = start_server(["--profile", "cpu", "--port", str(port), "--data-dir", data_dir],
                          env={"EDGECACHE_ENGINE__THREADS": str(threads), "EDGECACHE_SERVER__ACCESS_LOG": "false"},
                          log=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            for _ in range(1200):
                try:
                    if (await client.get("/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError("the server did not become ready")
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            hit = {**body("What is an inference cache?", 8), "model": model}
            await client.post("/v1/chat/completions", json=hit)  # now every repeat is an exact hit
            stop = asyncio.Event()
            hits = 0

            async def hit_load() -> None:
                nonlocal hits
                while not stop.is_set():
                    resp = await client.post("/v1/chat/completions", json=hit)
                    hits += resp.headers.get("x-edgecache") == "exact"

            load = [asyncio.create_task(hit_load()) for _ in range(hit_clients)]
            started = time.perf_counter()
            latencies = []
            for n in range(misses):
                miss = {**body(f"Write one sentence about the number {n} and the sea, run {threads}.", 32),
                        "model": model}
                t0 = time.perf_counter()
                resp = await client.post("/v1/chat/completions", json=miss)
                latencies.append(time.perf_counter() - t0)
                assert resp.headers["x-edgecache"] == "miss", resp.text
            elapsed = time.perf_counter() - started
            stop.set()
            await asyncio.gather(*load)
        return statistics.median(latencies), hits / elapsed
    finally:
        stop_process(server, timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cores = os.cpu_count() or 1
    default = sorted({1, max(1, cores - 1), cores})
    parser.add_argument("--threads", default=",".join(map(str, default)))
    parser.add_argument("--misses", type=int, default=3)
    parser.add_argument("--hit-clients", type=int, default=4)
    args = parser.parse_args()
    settings = [int(t) for t in args.threads.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for threads in settings:
            results[threads] = asyncio.run(measure(threads, args.misses, args.hit_clients, f"{tmp}/d{threads}"))
    best_miss = min(r[0] for r in results.values())
    best_hits = max(r[1] for r in results.values())
    print(f"{cores} cores; {args.misses} distinct 32-token misses while {args.hit_clients} clients send exact hits:")
    for threads, (miss_s, hits_s) in results.items():
        print(f"  engine.threads={threads}: miss p50 {miss_s:6.2f} s ({miss_s / best_miss:4.1f}x the best)   "
              f"hits {hits_s:7.0f}/s ({hits_s / best_hits:4.2f}x the best)")


if __name__ == "__main__":
    main()
