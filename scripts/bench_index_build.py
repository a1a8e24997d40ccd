"""Building a large semantic index: vectors per second through SemanticIndex, one at a time vs in batches on
threads, measured side by side in one run, then a full --vectors build with the batched road.

1. --compare vectors added one by one (`SemanticIndex.add`: a commit and a single-threaded insert each) and the
   same vectors with `add_many` in batches of --batch (one transaction and one usearch insert on all cores each):
   vectors/s of both and the ratio.
2. --vectors (default 1M) with `add_many`: total time, then a reopen (the mapping checked, the index file loaded)
   and the recall of 200 stored vectors searched for themselves (k=1).

Random unit vectors of the cpu profile's embedder width (512, USE multilingual), in its index dtype (f16), into a
real SQLite mapping and real usearch indexes in a temp dir (removed at the end). Random vectors are the hard case
for a graph index (no neighbourhoods to exploit): real prompt vectors build several times faster.

3. --real-texts DIR: every distinct text of the sets in DIR (../shared/data: about 90k prompts, zh and en) embedded
   with the default embedder, then an index of them built with the shipped index settings (inner product,
   expansion_add 64, expansion_search 128) and with the earlier ones (cosine, usearch's default expansion_add 128,
   expansion_search 64), side by side: vectors/s, and recall@1 of the exact nearest neighbour and search time for
   1,000 held-out texts (brute force as the truth).
   --random-settings N: the same two settings side by side on N random unit vectors (recall@1 of 500 stored
   vectors searched for themselves).
4. --like-real N (with --real-texts): N vectors built around the real ones (each a real prompt vector plus noise of
   norm 0.25, a paraphrase's distance) through `add_many`, as a tenant's large cache of real traffic would be.

  python scripts/bench_index_build.py --vectors 1000000 --compare 20000 --real-texts ../shared/data
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from edgecache.semantic.index import SemanticIndex, make_index

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


def real_vectors(data_dir: Path) -> np.ndarray:
    import csv
    import json

    from edgecache.semantic.embedders import load_embedder

    texts: list[str] = []
    for path in sorted(data_dir.glob("*.tsv")):
        for line in path.read_text(encoding="utf-8").splitlines():
            texts += line.split("\t")[:2]
    for path in sorted(data_dir.glob("*.jsonl")):
        texts += [json.loads(line).get("text", "") for line in path.read_text(encoding="utf-8").splitlines()]
    for path in sorted(data_dir.glob("*.csv")):
        with path.open(encoding="utf-8") as f:
            texts += [row.get("text", "") for row in csv.DictReader(f)]
    unique = [t for t in dict.fromkeys(texts) if t.strip()]
    embedder = load_embedder()
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        parts = list(pool.map(embedder.embed, [unique[i:i + 512] for i in range(0, len(unique), 512)]))
    print(f"embedded {len(unique)} distinct texts from {data_dir} in {time.perf_counter() - started:.0f} s")
    return np.concatenate(parts)


def settings_side_by_side(label: str, base: np.ndarray, queries: np.ndarray, truth: np.ndarray) -> None:
    """Build ``base`` with the earlier index settings and with the shipped ones (make_index), one after the other:
    build rate, recall@1 of ``truth`` for ``queries`` and search time."""
    from usearch.index import Index

    shipped = make_index(base.shape[1], "f16")
    earlier = Index(ndim=base.shape[1], metric="cos", dtype="f16", connectivity=16, expansion_add=128,
                    expansion_search=64)
    rates = {}
    for name, index in (("earlier", earlier), ("shipped", shipped)):
        started = time.perf_counter()
        index.add(np.arange(len(base), dtype=np.uint64), base, threads=0)
        seconds = time.perf_counter() - started
        started = time.perf_counter()
        found = index.search(queries, 1, threads=1)
        search_ms = (time.perf_counter() - started) / len(queries) * 1000
        recall = float(np.mean(found.keys[:, 0] == truth))
        rates[name] = len(base) / seconds
        print(f"{len(base)} {label}, {name} ({index.metric.name.lower()}, expansion_add {index.expansion_add}, "
              f"expansion_search {index.expansion_search}): built at {rates[name]:6.0f}/s; recall@1 "
              f"{recall:.3f}, {search_ms:.2f} ms a search")
    print(f"{label}: shipped / earlier build rate: {rates['shipped'] / rates['earlier']:.2f}x")


def real_side_by_side(data_dir: Path) -> np.ndarray:
    vecs = real_vectors(data_dir)
    held_out = np.random.default_rng(0).choice(len(vecs), 1000, replace=False)
    stored = np.ones(len(vecs), dtype=bool)
    stored[held_out] = False
    base, queries = vecs[stored], vecs[held_out]
    settings_side_by_side("real vectors (recall of the exact nearest)", base, queries,
                          np.argmax(queries @ base.T, axis=1))
    return vecs


def random_side_by_side(n: int) -> None:
    base = unit_vectors(n, 0)
    picked = np.random.default_rng(1).choice(n, 500, replace=False)
    settings_side_by_side("random vectors (recall of stored vectors searched for themselves)", base, base[picked],
                          picked)


def like_real(real: np.ndarray, n: int, start: int, seed: int) -> np.ndarray:
    """Vectors ``start .. start + n`` of a large cache that looks like the real prompts: each a real prompt vector
    plus noise of norm 0.25 (cosine ~0.97 to it, as a paraphrase), so neighbourhoods are real ones."""
    rng = np.random.default_rng(seed + start)
    base = real[np.arange(start, start + n) % len(real)]
    noise = rng.standard_normal(base.shape, dtype=np.float32)
    noise *= 0.25 / np.linalg.norm(noise, axis=1, keepdims=True)
    out = base + noise
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def like_real_build(root: Path, real: np.ndarray, total: int, batch: int) -> None:
    ix = SemanticIndex(root / "like-real", dim=real.shape[1], embedder_version="bench", max_vectors=10**7)
    started = time.perf_counter()
    for start in range(0, total, batch):
        size = min(batch, total - start)
        ix.add_many("t", "s", like_real(real, size, start, 1), [f"store-{i}" for i in range(start, start + size)],
                    [f"prompt {i}" for i in range(start, start + size)])
        if (start // batch) % 4 == 3:
            done = start + size
            print(f"  {done:8d} vectors, {done / (time.perf_counter() - started):7.0f}/s", flush=True)
    ix.save()
    seconds = time.perf_counter() - started
    ix.close()
    print(f"{total} real-like vectors (SQLite mapping + index, shipped settings): {seconds:7.1f} s "
          f"({seconds / 60:.1f} min) = {total / seconds:7.0f}/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vectors", type=int, default=1_000_000)
    parser.add_argument("--compare", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=50_000)
    parser.add_argument("--real-texts", type=Path, default=None,
                        help="a directory of the shared data sets: also build an index of their real prompt vectors")
    parser.add_argument("--random-settings", type=int, default=0,
                        help="build this many random vectors with the earlier and the shipped index settings")
    parser.add_argument("--like-real", type=int, default=0,
                        help="with --real-texts: then build this many vectors around the real ones (paraphrase-like)")
    args = parser.parse_args()
    print(f"cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="bench-index-") as tmp:
        root = Path(tmp)
        if args.compare:
            single = one_by_one(root / "single", args.compare)
            many = batched(root / "many", args.compare, min(args.batch, args.compare))
            print(f"{args.compare} vectors one by one: {single:7.1f} s = {args.compare / single:7.0f}/s")
            print(f"{args.compare} vectors add_many:   {many:7.1f} s = {args.compare / many:7.0f}/s")
            print(f"add_many / one by one: {single / many:.1f}x")
        if args.vectors:
            print(f"building {args.vectors} vectors with add_many (batches of {args.batch}):")
            seconds = batched(root / "full", args.vectors, args.batch, report=True)
            print(f"{args.vectors} vectors: {seconds:7.1f} s ({seconds / 60:.1f} min) = {args.vectors / seconds:7.0f}/s")
            sample = np.random.default_rng(7).choice(args.vectors, 200, replace=False)
            # Vector i of the build came from batch start b = i - i % batch with seed 1 + b.
            queries = {}
            for start in sorted({int(i - i % args.batch) for i in sample}):
                batch = unit_vectors(min(args.batch, args.vectors - start), 1 + start)
                queries.update({int(i): batch[i - start] for i in sample if i - i % args.batch == start})
            started = time.perf_counter()
            ix = SemanticIndex(root / "full", dim=DIM, embedder_version="bench", max_vectors=10**7)
            ix.search("t", "s", queries[int(sample[0])], k=1)  # the first lookup loads and reconciles the index
            reopened = time.perf_counter() - started
            found = 0
            for i in sample:
                hit = ix.search("t", "s", queries[int(i)], k=1)
                found += bool(hit) and hit[0].store_key == f"store-{i}"
            print(f"reopen (mapping checked, index loaded and reconciled) + first search: {reopened:.1f} s; "
                  f"recall@1 of 200 stored vectors searched for themselves: {found / 200:.3f}; "
                  f"repairs at open: {len(ix.repairs)}")
            ix.close()
        if args.random_settings:
            random_side_by_side(args.random_settings)
        if args.real_texts is not None:
            real = real_side_by_side(args.real_texts)
            if args.like_real:
                print(f"building {args.like_real} vectors like the real prompts (batches of {args.batch}):")
                like_real_build(root, real, args.like_real, args.batch)


if __name__ == "__main__":
    main()
