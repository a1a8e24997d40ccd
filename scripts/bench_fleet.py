"""A fleet against one box on the same trace: per-node caches vs the shared Redis layer, side by side in one run.

The seed-like workload of ``scripts/workload.py`` (tenants, repeats, paraphrases, bursts) is replayed three times
against real ``edgecache serve`` processes (llama.cpp CPU engine, the real embedder):

1. one node;
2. three nodes with their own caches (``store.backend = disk``) behind a round-robin balancer;
3. three nodes sharing one redis-server (``--redis``) behind the same balancer; with ``--cluster``, a local Redis
   Cluster of three primaries instead (the nodes are given one node's URL, as in production).

For each: hit rate, engine calls (summed over nodes), QPS and TTFT p50/p99. Then the exact-hit throughput of one
node with the Redis store against one with the local store (the same hot request, back to back).

    python scripts/bench_fleet.py [--requests 300] [--concurrency 8] [--hot 2000] [--cluster]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from edgecache.bench import workload
from edgecache.bench.harness import free_port, percentile, start_server, wait_ready
from edgecache.bench.redis_servers import RedisCluster, RedisServer
from edgecache.bench.workload import send


def start_node(work: Path, name: str, redis_url: str | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    (work / "tenants.toml").write_text(workload.tenants_toml())
    args = ["--profile", "cpu", "--port", str(port), "--data-dir", str(work / name),
            *(["--redis", redis_url] if redis_url else [])]
    log = (work / f"{name}.log").open("w")
    return start_server(args, env={"EDGECACHE_TENANTS_FILE": str(work / "tenants.toml")}, log=log,
                        clean_env=True), f"http://127.0.0.1:{port}"


def engine_calls(url: str) -> int:
    import httpx

    text = httpx.get(url + "/metrics", timeout=30, headers={"authorization": f"Bearer {workload.ADMIN_KEY}"}).text
    match = re.search(r"^edgecache_engine_calls_total (\S+)$", text, re.M)
    return int(float(match.group(1))) if match else 0


async def replay(urls: list[str], reqs: list[workload.Request], concurrency: int) -> tuple[list[dict], float]:
    """At the trace's arrival times, request i to node i mod len(urls): a round-robin balancer."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    results: list[dict] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        start = time.perf_counter()

        async def one(i: int, req: workload.Request) -> None:
            try:
                results.append(await send(client, urls[i % len(urls)], req, None))
            finally:
                sem.release()

        tasks = []
        for i, req in enumerate(reqs):
            delay = req.t - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            await sem.acquire()
            tasks.append(asyncio.create_task(one(i, req)))
        await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


async def hot_hits(url: str, req: workload.Request, n: int, concurrency: int) -> float:
    """Exact hits per second: one stored request, sent ``n`` times, ``concurrency`` at a time."""
    import httpx

    body, headers = req.body(stream=False), req.headers(None)
    async with httpx.AsyncClient(timeout=60) as client:
        first = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
        first.raise_for_status()
        sem = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with sem:
                r = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
                assert r.headers.get("x-edgecache") == "exact", r.headers.get("x-edgecache")

        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return n / (time.perf_counter() - start)


def hot_side_by_side(work: Path, redis_url: str, hot: workload.Request,
                     args: argparse.Namespace) -> tuple[float, float]:
    """One node with the local store and one with the Redis store, up together; alternating rounds of the same hot
    exact hit on each, the median round of each (the box's load drifts; alternating spreads it evenly)."""
    procs = [start_node(work, "hot-local", None), start_node(work, "hot-redis", redis_url)]
    try:
        for proc, url in procs:
            wait_ready(url, proc)
        rounds: dict[str, list[float]] = {"local": [], "redis": []}
        for _ in range(3):
            for name, (_, url) in zip(("local", "redis"), procs):
                rounds[name].append(asyncio.run(hot_hits(url, hot, args.hot, args.concurrency)))
        return sorted(rounds["local"])[1], sorted(rounds["redis"])[1]
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            proc.wait(timeout=60)


def summary(results: list[dict], wall: float, calls: int) -> dict:
    served = [r for r in results if r["outcome"] in ("exact", "semantic", "shared", "miss")]
    hits = [r for r in served if r["outcome"] != "miss"]
    ttfts = [r["ttft_s"] for r in served]
    return {"hit_rate": len(hits) / len(served) if served else 0.0, "engine_calls": calls,
            "errors": len(results) - len(served), "qps": len(results) / wall,
            "ttft_p50_ms": percentile(ttfts, 0.5) * 1000, "ttft_p99_ms": percentile(ttfts, 0.99) * 1000}


def run_config(work: Path, name: str, nodes: int, redis_url: str | None, reqs: list[workload.Request],
               args: argparse.Namespace) -> dict:
    procs = [start_node(work, f"{name}-{i}", redis_url) for i in range(nodes)]
    try:
        for proc, url in procs:
            wait_ready(url, proc)
        urls = [url for _, url in procs]
        results, wall = asyncio.run(replay(urls, reqs, args.concurrency))
        return summary(results, wall, sum(engine_calls(u) for u in urls))
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=10.0, help="offered requests/s")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--hot", type=int, default=2000, help="exact hits for the hot-hit comparison (0: skip)")
    parser.add_argument("--cluster", action="store_true",
                        help="share a local Redis Cluster (3 primaries) instead of one redis-server")
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is not installed (apt-get install redis-server redis-tools)")
    reqs = workload.generate(workload.WorkloadConfig(requests=args.requests, seed=args.seed, rate=args.rate))
    hot = reqs[0]
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        work = Path(tmp)
        # The fleet tests' servers: one redis-server, or three in cluster mode joined by redis-cli --cluster create.
        redis = (RedisCluster(work / "redis-cluster") if args.cluster else RedisServer(work / "redis")).start()
        redis_url = redis.url
        try:
            one = run_config(work, "one", 1, None, reqs, args)
            local = run_config(work, "local", 3, None, reqs, args)
            shared = run_config(work, "redis", 3, redis_url, reqs, args)
            local_hot, redis_hot = hot_side_by_side(work, redis_url, hot, args) if args.hot else (0.0, 0.0)
        finally:
            redis.kill()
    print(f"bench_fleet: {args.requests} requests (seed {args.seed}, {args.rate}/s offered, concurrency "
          f"{args.concurrency}), round-robin over the nodes; the shared store: "
          f"{'a Redis Cluster of 3 primaries' if args.cluster else 'one redis-server'}")
    print(f"{'':24}{'hit rate':>10}{'engine calls':>14}{'errors':>8}{'QPS':>8}{'TTFT p50':>10}{'TTFT p99':>10}")
    shared_label = "3 nodes, Redis Cluster" if args.cluster else "3 nodes, shared Redis"
    for label, row in (("1 node", one), ("3 nodes, own caches", local), (shared_label, shared)):
        print(f"{label:24}{row['hit_rate']:>10.3f}{row['engine_calls']:>14}{row['errors']:>8}{row['qps']:>8.1f}"
              f"{row['ttft_p50_ms']:>8.1f}ms{row['ttft_p99_ms']:>8.1f}ms")
    print(f"hit rate, shared Redis vs one node: {100 * (shared['hit_rate'] - one['hit_rate']):+.1f} points; "
          f"engine calls: {100 * (shared['engine_calls'] / max(1, one['engine_calls']) - 1):+.1f} %")
    if local_hot and redis_hot:
        print(f"hot exact hit, one node each, side by side (median of 3 alternating rounds): Redis store "
              f"{redis_hot:.0f}/s, local store {local_hot:.0f}/s (ratio {redis_hot / local_hot:.2f})")


if __name__ == "__main__":
    main()
