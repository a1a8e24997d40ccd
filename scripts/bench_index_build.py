"""Building a large semantic index: vectors per second through SemanticIndex, one at a time vs in batches on
threads, measured side by side in one run, then a full --vectors build with the batched road.

1. --compare vectors added one by one (`SemanticIndex.add`: a commit and a single-threaded insert each) and the
   same vectors with `add_many` in batches of --batch (one transaction and one usearch insert on all cores each):
   vectors/s of both and the ratio.
2. --vectors (default 1M) with `add_many`: total time, then a reopen (the mapping checked, the index file loaded)
   and the recall of 200 stored vectors searched for themselves (k=1).

Random unit vectors of the cpu profile's embedder width (512, USE multilingual), in its index dtype (f16), into a
real SQLite mapping and real usearch indexes in a temp dir (removed at the end).

  python scripts/bench_index_build.py --vectors 1000000 --compare 20000
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgecache.semantic_index import SemanticIndex  # noqa: E402

DIM = 512


def unit_vectors(n: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, DIM), dtype=np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def one_by_one(root: Path, n: int) -> float:
    ix = SemanticIndex(root, dim=DIM, embedder_version="bench", max_vectors=10**7)
    vecs = unit_vectors(n, 1)
    started = time.perf_counter()
    for i in range(n):
        ix.add("t", "s", vecs[i], f"store-{i}", f"prompt {i}")
    seconds = time.perf_counter() - started
    ix.close()
    return seconds


def batched(root: Path, n: int, batch: int, *, report: bool = False) -> float:
    ix = SemanticIndex(root, dim=DIM, embedder_version="bench", max_vectors=10**7)
    started = time.perf_counter()
    for start in range(0, n, batch):
        size = min(batch, n - start)
        ix.add_many("t", "s", unit_vectors(size, 1 + start), [f"store-{i}" for i in range(start, start + size)],
                    [f"prompt {i}" for i in range(start, start + size)])
        if report and (start // batch) % 4 == 3:
            done = start + size
            print(f"  {done:8d} vectors, {done / (time.perf_counter() - started):7.0f}/s", flush=True)
    ix.save()
    seconds = time.perf_counter() - started
    ix.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vectors", type=int, default=1_000_000)
    parser.add_argument("--compare", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=50_000)
    args = parser.parse_args()
    print(f"cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="bench-index-") as tmp:
        root = Path(tmp)
        single = one_by_one(root / "single", args.compare)
        many = batched(root / "many", args.compare, min(args.batch, args.compare))
        print(f"{args.compare} vectors one by one: {single:7.1f} s = {args.compare / single:7.0f}/s")
        print(f"{args.compare} vectors add_many:   {many:7.1f} s = {args.compare / many:7.0f}/s")
        print(f"add_many / one by one: {single / many:.1f}x")
        if args.vectors:
            print(f"building {args.vectors} vectors with add_many (batches of {args.batch}):")
            seconds = batched(root / "full", args.vectors, args.batch, report=True)
            print(f"{args.vectors} vectors: {seconds:7.1f} s ({seconds / 60:.1f} min) = {args.vectors / seconds:7.0f}/s")
            started = time.perf_counter()
            ix = SemanticIndex(root / "full", dim=DIM, embedder_version="bench", max_vectors=10**7)
            sample = np.random.default_rng(7).choice(args.vectors, 200, replace=False)
            # Vector i of the build came from batch start b = i - i % batch with seed 1 + b.
            found = 0
            for i in sample:
                start = i - i % args.batch
                vec = unit_vectors(min(args.batch, args.vectors - start), 1 + start)[i - start]
                hit = ix.search("t", "s", vec, k=1)
                found += bool(hit) and hit[0].store_key == f"store-{i}"
            print(f"reopen + 200 searches: {time.perf_counter() - started:.1f} s; recall@1 of stored vectors: "
                  f"{found / 200:.3f}; repairs at open: {len(ix.repairs)}")
            ix.close()


if __name__ == "__main__":
    main()
