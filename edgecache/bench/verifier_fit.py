"""``scripts/fit_verifier.py``: fit the semantic verifier (edgecache/semantic/verifier_params.json) from the permissive
sets in the data folder (:data:`edgecache.bench.harness.DATA`).

Fit data (SOURCES.txt in that folder marks these permissive; nothing else is read):

  zh   PAWS-X zh valid + test (pairs: each pair on its own)
  en   CLINC150 train + val with out-of-scope, banking77 train (intents: 3 stored per intent, the rest looked up;
       a candidate of the same intent is a positive, any other candidate a negative, out-of-scope queries are
       negatives), GPTCache's pairs (retrieval over all origins)

Every lookup's nearest ``--candidates`` candidates become samples (features of edgecache.semantic.verifier, label = right).
Each set weighs the same. One logistic regression for both scripts (the only Chinese set, PAWS-X, is adversarial
word swaps: fitted alone, its overlap weights are degenerate), with the signs of edgecache.semantic.verifier.SIGNS, fitted by
projected gradient descent from zeros (deterministic: same data, same bytes). Each rule of the guard is a hard veto
on minimal pairs (content-unit overlap >= VETO_MIN_OVERLAP). Then each script's calibration: for each target
false-hit rate of the ladder, the lowest cut at which the false hits, averaged over the script's fit sets (each the
same weight), meet the target, run through the same decision the server makes (best-scored candidate among the
nearest, vetoes applied). (Taking the worst set instead let GPTCache's near-duplicate origins, counted false, set
the English cut: CLINC150 and banking77 then kept 2-3 % hits.)

  python scripts/fit_verifier.py            # rebuild edgecache/semantic/verifier_params.json
  python scripts/fit_verifier.py --check    # exit 1 if the rebuild differs from the shipped file
  python scripts/fit_verifier.py --loo      # also: leave-one-set-out check of the en calibration
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np

from edgecache.bench.harness import DATA
from edgecache.bench.semantic_eval import Case, load_cases, verifier_decisions
from edgecache.semantic.verifier import FEATURES, SIGNS, ScriptModel, Verifier, VerifierParams, features
from edgecache.semantic.verifier import SHIPPED_PARAMS as SHIPPED

#: Target false-hit rates the calibration table covers (scenarios pick one; between two, the stricter applies).
TARGETS: tuple[float, ...] = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05)
#: (script, protocol, file, options): the permissive fit sets.
FIT_SETS: tuple[tuple[str, str, str, dict], ...] = (
    ("zh", "pairs", "pawsx_zh_valid.tsv", {}),
    ("zh", "pairs", "pawsx_zh_test.tsv", {}),
    ("en", "intents", "clinc150_train_val.jsonl", {"splits": {"train", "val", "oos_train", "oos_val"}}),
    ("en", "intents", "banking77_train.csv", {}),
    ("en", "pairs", "gptcache_mock_data.json", {}),
)
#: A guard rule that fires on a pair sharing at least this much of its content units (Jaccard) refuses outright:
#: the rule's difference is then the pair's whole difference (20 vs 50 dollars, cancel / not cancel, 狗咬了人 / 人咬了狗).
VETO_MIN_OVERLAP = 0.5
VETO_RULES: tuple[str, ...] = ("numbers", "entities", "negation", "antonyms", "order", "code")


class CachedEmbedder:
    """The embedder with its vectors kept in an .npz per text hash, so refits skip the embedding."""

    def __init__(self, emb, cache_dir: Path | None) -> None:
        self.emb, self.dim, self.version = emb, emb.dim, emb.version
        self.path = None if cache_dir is None else cache_dir / f"{emb.version}.npz"
        self.known: dict[str, np.ndarray] = {}
        if self.path is not None and self.path.exists():
            with np.load(self.path) as z:
                self.known = {k: z[k] for k in z.files}
        self.dirty = False

    @staticmethod
    def _key(text: str) -> str:
        return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        keys = [self._key(t) for t in texts]
        missing = [t for t, k in zip(texts, keys) if k not in self.known]
        if missing:
            for t, v in zip(missing, self.emb.embed(missing)):
                self.known[self._key(t)] = v
            self.dirty = True
        return np.stack([self.known[k] for k in keys]) if keys else np.zeros((0, self.dim), np.float32)

    def save(self) -> None:
        if self.path is not None and self.dirty:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            np.savez(self.path, **self.known)


def build_cases(emb, k: int, limit: int = 0) -> dict[str, tuple[str, list[Case]]]:
    out = {}
    for script, kind, name, options in FIT_SETS:
        cases = load_cases(kind, DATA / name, emb, k=k, seed=0, limit=limit, **options)
        if kind == "pairs" and limit:
            cases = cases[:limit]
        out[name] = (script, cases)
    return out


def samples(cases: list[Case]) -> tuple[np.ndarray, np.ndarray]:
    rows, labels = [], []
    for case in cases:
        for text, cosine, right in case.candidates:
            if text == case.query:
                continue  # identical prompts always serve; they teach the model nothing
            rows.append(features(case.query, text, cosine)[0])
            labels.append(right)
    return np.array(rows, dtype=np.float64).reshape(-1, len(FEATURES)), np.array(labels, dtype=np.float64)


def fit_logistic(x: np.ndarray, y: np.ndarray, w: np.ndarray, *, steps: int = 3000, l2: float = 1e-3,
                 lr: float = 0.05, signs: Sequence[int] | None = None) -> tuple[np.ndarray, float]:
    """Weighted logistic regression, signs held by projection after every Adam step.

    ``signs`` (one per column of ``x``, +1 / -1 / 0) defaults to :data:`edgecache.semantic.verifier.SIGNS` in feature order.
    """
    signs = np.array([SIGNS[f] for f in FEATURES] if signs is None else list(signs), dtype=np.float64)
    theta = np.zeros(x.shape[1] + 1)
    m, v = np.zeros_like(theta), np.zeros_like(theta)
    xb = np.hstack([x, np.ones((len(x), 1))])
    w = w / w.sum()
    for t in range(1, steps + 1):
        p = 1.0 / (1.0 + np.exp(-np.clip(xb @ theta, -60, 60)))
        grad = xb.T @ (w * (p - y))
        grad[:-1] += l2 * theta[:-1]
        m = 0.9 * m + 0.1 * grad
        v = 0.999 * v + 0.001 * grad * grad
        theta -= lr * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
        theta[:-1] = np.where(signs > 0, np.maximum(theta[:-1], 0), np.where(signs < 0, np.minimum(theta[:-1], 0),
                                                                           theta[:-1]))
    return theta[:-1], float(theta[-1])


def fit(sets: dict[str, tuple[str, list[Case]]], embedder: str, *, steps: int = 3000) -> VerifierParams:
    vetoes = {rule: VETO_MIN_OVERLAP for rule in VETO_RULES}
    parts = [samples(cases) for _, cases in sets.values()]
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    weight = np.concatenate([np.full(len(p[1]), 1.0 / max(len(p[1]), 1)) for p in parts])
    weights, bias = fit_logistic(x, y, weight, steps=steps)
    shared = ScriptModel(weights=[round(float(v), 6) for v in weights], bias=round(bias, 6), cuts=[])
    provisional = Verifier(VerifierParams(embedder=embedder, features=list(FEATURES), vetoes=vetoes,
                                          models={"zh": shared, "en": shared}, fitted_on=[]))
    models = {}
    for script in ("zh", "en"):
        decisions = [verifier_decisions(provisional, cases) for s, cases in sets.values() if s == script]
        cuts = [(t, mean_cut(decisions, t)) for t in TARGETS]
        models[script] = ScriptModel(weights=shared.weights, bias=shared.bias, cuts=cuts)
    return VerifierParams(embedder=embedder, features=list(FEATURES), vetoes=vetoes, models=models,
                          fitted_on=sorted({name for name in sets}))


def mean_cut(decisions: list[tuple[np.ndarray, np.ndarray]], target: float) -> float:
    """The lowest cut (0.001 grid) at which false hits, averaged over the sets, are at most ``target``."""
    grid = np.round(np.arange(0.0, 1.0005, 0.001), 3)
    rates = [((score[None, :] >= grid[:, None] - 1e-12) & ~ok[None, :]).sum(axis=1) / max(len(score), 1)
             for score, ok in decisions]
    allowed = np.nonzero(np.mean(rates, axis=0) <= target + 1e-12)[0]
    return float(grid[allowed[0]]) if len(allowed) else 1.0


def encode(params: VerifierParams) -> bytes:
    return msgspec.json.format(msgspec.json.encode(params), indent=1) + b"\n"


def leave_one_out(sets: dict[str, tuple[str, list[Case]]], params: VerifierParams) -> None:
    """For each set: the cut calibrated on the other sets of its script, and what it gives on the left-out one."""
    verifier = Verifier(params)
    decisions = {name: verifier_decisions(verifier, cases) for name, (s, cases) in sets.items()}
    for name, (script, cases) in sets.items():
        others = [n for n, (s, _) in sets.items() if s == script and n != name]
        if not others:
            continue
        for target in (0.005, 0.01):
            cut = mean_cut([decisions[n] for n in others], target)
            score, ok = decisions[name]
            served = score >= cut - 1e-12
            n_pos = sum(c.positive for c in cases)
            print(f"  leave out {name:28} target {target:.3f}: cut {cut:.3f} -> hit {(served & ok).sum() / n_pos:.3f}"
                  f"  false {(served & ~ok).sum() / len(cases):.4f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    p.add_argument("--out", type=Path, default=SHIPPED)
    p.add_argument("--candidates", type=int, default=3)
    p.add_argument("--cache", type=Path, help="keep embeddings here between runs (a directory)")
    p.add_argument("--loo", action="store_true", help="print the leave-one-set-out calibration check")
    args = p.parse_args(argv)
    if not DATA.is_dir():
        print(f"error: the data sets are not at {DATA} (shared/data beside the checkout)", file=sys.stderr)
        return 2

    from edgecache.semantic.embedders import load_embedder

    emb = CachedEmbedder(load_embedder(None, threads=1), args.cache)
    sets = build_cases(emb, args.candidates)
    emb.save()
    params = fit(sets, emb.version)
    data = encode(params)
    if args.loo:
        leave_one_out(sets, params)
    if args.check:
        same = args.out.read_bytes() == data
        print("verifier_params.json is up to date" if same else "verifier_params.json differs from a rebuild")
        return 0 if same else 1
    args.out.write_bytes(data)
    print(f"wrote {args.out} ({len(data)} bytes)")
    return 0
