"""Measure the semantic lookup path (embedder -> index -> threshold -> guard) against plain cosine, side by side.

Protocols (see issue 3, "Measure"):

  --pairs PATH     TSV ``s1<TAB>s2<TAB>label`` (1 = same meaning): s1 is the only cached entry, s2 is looked up.
                   hit_rate = hits on label-1 pairs / label-1 pairs; false_hit_rate = hits on label-0 / all pairs.
                   A JSON list of {"origin", "similar"} (GPTCache's mock data) is read as retrieval instead: every
                   distinct origin is cached in one index, each similar is looked up; a hit on its own origin is
                   true, on any other origin false.
  --intents PATH   CSV ``text,category`` or JSON lines {"text", "intent"} (intent ``oos`` = out of scope): the first
                   ``--per-intent`` texts of each in-scope intent (seeded shuffle) are cached, all others looked up.

The baseline is the same embedder and index with the guard off (top-1 candidate only). The last line printed is
one JSON object: n, hit_rate, false_hit_rate, threshold, embedder, hit_rate_at_1pct, baseline_hit_rate_at_1pct.

  python scripts/eval_semantic.py --pairs ../shared/data/pawsx_zh_test.tsv --scenario knowledge
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgecache import guard  # noqa: E402
from edgecache.embedders import Embedder, default_threshold, load_embedder  # noqa: E402
from edgecache.semantic_index import SemanticIndex  # noqa: E402

K = 1  # candidates per search: only the nearest one may be served


class Lookups:
    """Per lookup: the similarity our path would serve at and whether that hit would be right; same for baseline."""

    def __init__(self) -> None:
        self.ours_sim: list[float] = []
        self.ours_ok: list[bool] = []
        self.base_sim: list[float] = []
        self.base_ok: list[bool] = []
        self.positive: list[bool] = []  # a lookup that has a right answer in the cache

    def add(self, ours: tuple[float, bool], base: tuple[float, bool], positive: bool) -> None:
        self.ours_sim.append(ours[0])
        self.ours_ok.append(ours[1])
        self.base_sim.append(base[0])
        self.base_ok.append(base[1])
        self.positive.append(positive)


def rates(sim: np.ndarray, ok: np.ndarray, n_pos: int, thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """hit_rate and false_hit_rate at every threshold (vectorised over the sweep)."""
    hits = sim[None, :] >= thresholds[:, None] - 1e-9
    true_hits = (hits & ok[None, :]).sum(axis=1)
    false_hits = (hits & ~ok[None, :]).sum(axis=1)
    return true_hits / max(n_pos, 1), false_hits / max(len(sim), 1)


def best_at(hit: np.ndarray, fhr: np.ndarray, thresholds: np.ndarray, max_fhr: float) -> tuple[float, float]:
    allowed = fhr <= max_fhr + 1e-12
    if not allowed.any():
        return 0.0, 1.0
    i = int(np.argmax(np.where(allowed, hit, -1.0)))
    return float(hit[i]), float(thresholds[i])


def serve(index: SemanticIndex, tenant: str, scenario: str, vec: np.ndarray, query: str, rules: list[str]):
    """(ours, baseline) served candidates: the top-1 candidate, ours only if the guard allows it.

    A refused top candidate is a miss, not a reason to try the next one: the next is less similar still, and
    falling through measurably served more wrong answers (docs/notes/semantic.md).
    """
    cands = index.search(tenant, scenario, vec, K)
    base = cands[0] if cands else None
    ours = base if base is not None and guard.check(query, base.text, rules).allowed else None
    return ours, base


def run_pairs_tsv(path: Path, emb: Embedder, index: SemanticIndex, args, rules: list[str]) -> Lookups:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) >= 3 and parts[2].strip() in ("0", "1"):
                rows.append((parts[0], parts[1], parts[2].strip() == "1"))
    rows = subset(rows, args)
    v1 = embed_all(emb, [r[0] for r in rows])
    v2 = embed_all(emb, [r[1] for r in rows])
    out = Lookups()
    for i, (s1, s2, label) in enumerate(rows):
        scenario = f"pair{i}"
        if s1 == s2:  # an exact-cache hit, always served
            out.add((1.0, label), (1.0, label), label)
            continue
        index.add("eval", scenario, v1[i], f"k{i}", s1)
        ours, base = serve(index, "eval", scenario, v2[i], s2, rules)
        out.add(score(ours, label), score(base, label), label)
        index.drop("eval", scenario)
    return out


def score(cand, right: bool) -> tuple[float, bool]:
    return (-2.0, False) if cand is None else (cand.similarity, right)


def run_retrieval(pairs: list[tuple[str, str]], emb: Embedder, index: SemanticIndex, rules: list[str]) -> Lookups:
    origins = sorted({o for o, _ in pairs})
    for text, vec in zip(origins, embed_all(emb, origins)):
        index.add("eval", "retrieval", vec, text, text)
    out = Lookups()
    qv = embed_all(emb, [s for _, s in pairs])
    for (origin, similar), vec in zip(pairs, qv):
        if similar == origin:
            out.add((1.0, True), (1.0, True), True)
            continue
        ours, base = serve(index, "eval", "retrieval", vec, similar, rules)
        out.add(
            score(ours, ours is not None and ours.store_key == origin),
            score(base, base is not None and base.store_key == origin),
            True,
        )
    return out


def run_intents(path: Path, emb: Embedder, index: SemanticIndex, args, rules: list[str]) -> Lookups:
    items: list[tuple[str, str]] = []
    if path.suffix in (".jsonl", ".json"):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                obj = json.loads(line)
                items.append((obj["text"], obj.get("intent") or obj.get("category")))
    else:
        with path.open(encoding="utf-8", newline="") as f:
            for row in csv.DictReader(f):
                items.append((row["text"], row.get("category") or row.get("intent")))
    random.Random(args.seed).shuffle(items)
    stored: list[tuple[str, str]] = []
    queries: list[tuple[str, str]] = []
    per: dict[str, int] = defaultdict(int)
    for text, intent in items:
        if intent != "oos" and per[intent] < args.per_intent:
            per[intent] += 1
            stored.append((text, intent))
        else:
            queries.append((text, intent))
    if args.limit:
        queries = queries[: args.limit]
    intent_of = {}
    for (text, intent), vec in zip(stored, embed_all(emb, [t for t, _ in stored])):
        key = index.add("eval", "intents", vec, f"{intent}\x00{text}", text)
        intent_of[key] = intent
    out = Lookups()
    for (text, intent), vec in zip(queries, embed_all(emb, [t for t, _ in queries])):
        ours, base = serve(index, "eval", "intents", vec, text, rules)
        in_scope = intent != "oos"
        out.add(
            score(ours, in_scope and ours is not None and intent_of[ours.vector_key] == intent),
            score(base, in_scope and base is not None and intent_of[base.vector_key] == intent),
            in_scope,
        )
    return out


def subset(rows: list, args) -> list:
    """--half 0/1 splits a seeded shuffle in two (calibrate on one half, report on the other); --limit caps."""
    if args.half is not None:
        order = list(range(len(rows)))
        random.Random(args.seed).shuffle(order)
        keep = sorted(order[args.half :: 2])
        rows = [rows[i] for i in keep]
    return rows[: args.limit] if args.limit else rows


def embed_all(emb: Embedder, texts: list[str], batch: int = 64) -> np.ndarray:
    if not texts:
        return np.zeros((0, emb.dim), dtype=np.float32)
    return np.concatenate([emb.embed(texts[i : i + batch]) for i in range(0, len(texts), batch)])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--pairs", type=Path)
    src.add_argument("--intents", type=Path)
    p.add_argument("--scenario", default="default", help="whose default threshold to use")
    p.add_argument("--threshold", type=float, help="override the scenario's calibrated threshold")
    p.add_argument("--embedder", default=None, help="registered embedder name (default: the CPU default)")
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-intent", type=int, default=3)
    p.add_argument("--half", type=int, choices=(0, 1), help="use one half of a seeded split (pairs protocol)")
    p.add_argument("--rules", default=",".join(guard.DEFAULT_RULES), help="guard rules, comma-separated, or 'none'")
    p.add_argument("--dtype", default="f16", choices=("f16", "i8"))
    args = p.parse_args(argv)
    rules = [] if args.rules == "none" else [r for r in args.rules.split(",") if r]

    emb = load_embedder(args.embedder, threads=1)
    threshold = args.threshold if args.threshold is not None else default_threshold(emb.version, args.scenario)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        index = SemanticIndex(tmp, dim=emb.dim, embedder_version=emb.version, dtype=args.dtype, max_vectors=10**6)
        try:
            if args.pairs is not None and args.pairs.suffix == ".json":
                data = json.loads(args.pairs.read_text(encoding="utf-8"))
                pairs = subset([(d["origin"], d["similar"]) for d in data], args)
                res = run_retrieval(pairs, emb, index, rules)
            elif args.pairs is not None:
                res = run_pairs_tsv(args.pairs, emb, index, args, rules)
            else:
                res = run_intents(args.intents, emb, index, args, rules)
        finally:
            index.close()
    elapsed = time.perf_counter() - t0

    pos = np.array(res.positive)
    n_pos = int(pos.sum())
    sweep = np.round(np.arange(0.0, 1.0005, 0.001), 3)
    ours = rates(np.array(res.ours_sim), np.array(res.ours_ok), n_pos, sweep)
    base = rates(np.array(res.base_sim), np.array(res.base_ok), n_pos, sweep)
    at = int(np.argmin(np.abs(sweep - threshold)))
    ours_1, ours_t1 = best_at(*ours, sweep, 0.01)
    base_1, base_t1 = best_at(*base, sweep, 0.01)
    ours_01, _ = best_at(*ours, sweep, 0.001)
    base_01, _ = best_at(*base, sweep, 0.001)
    print(f"embedder {emb.version}  lookups {len(pos)} ({n_pos} with a right answer)  rules {rules or 'none'}")
    print(f"{'':28}{'ours (guard)':>16}{'plain cosine':>16}")
    print(f"{'hit rate @ t=' + format(threshold, '.3f'):28}{ours[0][at]:16.3f}{base[0][at]:16.3f}")
    print(f"{'false-hit rate @ t':28}{ours[1][at]:16.4f}{base[1][at]:16.4f}")
    print(f"{'best hit rate, FHR<=1%':28}{ours_1:16.3f}{base_1:16.3f}   (t = {ours_t1:.3f} / {base_t1:.3f})")
    print(f"{'best hit rate, FHR<=0.1%':28}{ours_01:16.3f}{base_01:16.3f}")
    ratio = ours_1 / base_1 if base_1 else float("inf")
    print(f"ratio at 1%: {ratio:.2f}x   ({elapsed:.1f} s)")
    result = {
        "n": len(pos),
        "hit_rate": round(float(ours[0][at]), 4),
        "false_hit_rate": round(float(ours[1][at]), 4),
        "threshold": threshold,
        "embedder": emb.version,
        "hit_rate_at_1pct": round(ours_1, 4),
        "baseline_hit_rate_at_1pct": round(base_1, 4),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
