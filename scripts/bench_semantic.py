"""Latency of a semantic lookup (embed + search) and of index search at scale, measured side by side in one run.

1. lookup at batch 1: embed one prompt, search an index of --stored real prompt vectors (p50/p99).
2. 32 concurrent lookups: each request alone on a worker thread vs micro-batched (requests arriving within
   --max-wait-ms are embedded in one call), per-request latency p50/p99 and the ratio.
3. search alone at 100k and 1M random unit vectors (usearch HNSW as the server builds it), p50/p99 of k=1.

  python scripts/bench_semantic.py --embedder use-multilingual --sizes 100000,1000000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from edgecache.semantic.cache import EmbedBatcher
from edgecache.semantic.embedders import Embedder, load_embedder
from edgecache.semantic.index import SemanticIndex, make_index

PROMPTS = [
    "How do I reset my password?",
    "北京今天天气怎么样",
    "What is the refund policy for international orders?",
    "如何在 Python 中对列表排序",
    "Why has my card payment been declined?",
    "我的快递什么时候到",
    "Explain the difference between TCP and UDP.",
    "这个月的账单在哪里查看",
]


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs) * 1000, q))


def fmt(name: str, xs: list[float]) -> str:
    return f"{name:44} p50 {pct(xs, 50):7.2f} ms   p99 {pct(xs, 99):7.2f} ms"


async def concurrent(embedder: Embedder, index: SemanticIndex, n: int, rounds: int, max_wait_s: float):
    async def lookup_alone(text: str) -> float:
        t0 = time.perf_counter()
        vec = (await asyncio.to_thread(embedder.embed, [text]))[0]
        await asyncio.to_thread(index.search, "bench", "s", vec, 1)
        return time.perf_counter() - t0

    # The server's own batcher, on one embedding thread as the semantic cache runs it.
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed")
    batcher = EmbedBatcher(embedder, executor, max_batch=n, max_wait_s=max_wait_s)

    async def lookup_batched(text: str) -> float:
        t0 = time.perf_counter()
        vec = await batcher.embed(text)
        await asyncio.to_thread(index.search, "bench", "s", vec, 1)
        return time.perf_counter() - t0

    alone: list[float] = []
    batched: list[float] = []
    for r in range(rounds):
        texts = [f"{PROMPTS[(r + i) % len(PROMPTS)]} #{r}-{i}" for i in range(n)]
        alone += await asyncio.gather(*(lookup_alone(t) for t in texts))
        batched += await asyncio.gather(*(lookup_batched(t) for t in texts))
    executor.shutdown()
    return alone, batched


def search_at_scale(size: int, dim: int, dtype: str, queries: int, threads: int) -> tuple[list[float], float, float]:
    rng = np.random.default_rng(size)
    index = make_index(dim, dtype)  # as the server builds its indexes
    t0 = time.perf_counter()
    step = 100_000
    sample = None
    for start in range(0, size, step):
        vecs = rng.normal(size=(min(step, size - start), dim)).astype(np.float32)
        vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
        index.add(np.arange(start, start + len(vecs), dtype=np.uint64), vecs, threads=threads)
        if sample is None:
            sample = vecs[:queries].copy()
    build_s = time.perf_counter() - t0
    assert sample is not None
    # Queries near stored vectors (a stored vector plus noise), as a cache lookup is.
    q = sample + rng.normal(scale=0.02, size=sample.shape).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    times, hits = [], 0
    for i, vec in enumerate(q):
        t = time.perf_counter()
        m = index.search(vec, 1)
        times.append(time.perf_counter() - t)
        hits += int(m.keys[0]) == i
    return times, hits / len(q), build_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--embedder", default=None)
    p.add_argument("--dtype", default="f16", choices=("f16", "i8"))
    p.add_argument("--stored", type=int, default=10_000, help="vectors in the index for the lookup benchmarks")
    p.add_argument("--lookups", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    p.add_argument("--sizes", default="100000,1000000")
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--threads", type=int, default=1, help="intra-op / BLAS threads of the embedder")
    args = p.parse_args()

    emb = load_embedder(args.embedder, threads=args.threads)
    print(f"embedder {emb.version} (dim {emb.dim}), index dtype {args.dtype}")
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        index = SemanticIndex(tmp, dim=emb.dim, embedder_version=emb.version, dtype=args.dtype, max_vectors=10**7)
        texts = [f"{PROMPTS[i % len(PROMPTS)]} variant {i}" for i in range(args.stored)]
        for start in range(0, len(texts), 256):
            chunk = texts[start : start + 256]
            for text, vec in zip(chunk, emb.embed(chunk)):
                index.add("bench", "s", vec, text, text)
        emb.embed(["warm-up"])

        embed_t, search_t, lookup_t = [], [], []
        for i in range(args.lookups):
            text = f"{PROMPTS[i % len(PROMPTS)]} query {i}"
            t0 = time.perf_counter()
            vec = emb.embed([text])[0]
            t1 = time.perf_counter()
            index.search("bench", "s", vec, 1)
            t2 = time.perf_counter()
            embed_t.append(t1 - t0)
            search_t.append(t2 - t1)
            lookup_t.append(t2 - t0)
        print(f"-- batch 1, index of {args.stored} prompt vectors")
        print(fmt("embed", embed_t))
        print(fmt("search (SemanticIndex, incl. SQLite mapping)", search_t))
        print(fmt("lookup = embed + search", lookup_t))
        results["lookup_p50_ms"] = pct(lookup_t, 50)
        results["lookup_p99_ms"] = pct(lookup_t, 99)

        alone, batched = asyncio.run(
            concurrent(emb, index, args.concurrency, args.rounds, args.max_wait_ms / 1000)
        )
        print(f"-- {args.concurrency} concurrent lookups x {args.rounds} rounds")
        print(fmt("each alone on a worker thread", alone))
        print(fmt(f"micro-batched (max wait {args.max_wait_ms} ms)", batched))
        print(f"{'ratio alone / batched at p50':44} {statistics.median(alone) / statistics.median(batched):.2f}x")
        results["concurrent_batched_p50_ms"] = pct(batched, 50)
        results["concurrent_batched_p99_ms"] = pct(batched, 99)
        results["concurrent_alone_p50_ms"] = pct(alone, 50)
        index.close()

    for size in [int(s) for s in args.sizes.split(",") if s]:
        times, recall, build_s = search_at_scale(size, emb.dim, args.dtype, args.queries, threads=2)
        print(f"-- search at {size:,} random unit vectors (built in {build_s:.0f} s, recall@1 {recall:.3f})")
        print(fmt("usearch search k=1", times))
        results[f"search_{size}_p50_ms"] = pct(times, 50)
        results[f"search_{size}_p99_ms"] = pct(times, 99)
    print(json.dumps({k: round(v, 3) for k, v in results.items()}))


if __name__ == "__main__":
    main()
