"""``scripts/eval_semantic.py``: measure the semantic lookup path (embedder -> index -> verifier) against plain cosine, side by side.

Protocols:

  --pairs PATH     TSV ``s1<TAB>s2<TAB>label`` (1 = same meaning): s1 is the only cached entry, s2 is looked up.
                   hit_rate = hits on label-1 pairs / label-1 pairs; false_hit_rate = hits on label-0 / all pairs.
                   A JSON list of {"origin", "similar"} (GPTCache's mock data) is read as retrieval instead: every
                   distinct origin is cached in one index, each similar is looked up; a hit on its own origin is
                   true, on any other origin false.
  --intents PATH   CSV ``text,category`` or JSON lines {"text", "intent"} (intent ``oos`` = out of scope): the first
                   ``--per-intent`` texts of each in-scope intent (seeded shuffle) are cached, all others looked up.
                   ``--splits train,val`` keeps only rows of those splits (JSON lines with a ``split`` field).

"Ours" is the path the profile ships (``semantic.decision``): the threshold rule (the nearest candidate, its cosine
over the scenario's threshold or the embedder's calibrated one, the guard's veto), or the verifier
(:mod:`edgecache.semantic.verifier`: the nearest ``semantic.candidates`` candidates scored, the best-scored one served when it
reaches the cut of the scenario's target false-hit rate). ``--decision`` / ``--threshold`` / ``--target`` override.
The baseline is plain cosine on the same embedder and index, top-1, its threshold picked on the very set (its
oracle).

Latency: the first ``--latency-lookups`` lookups are also run one at a time the way the server does (embed one text,
search, verify) and their p50 / p99 reported, with the share that paid for a second stage (none ships yet).

  --stream         (with --pairs or --intents) the online learner (:mod:`edgecache.semantic.learner`) on a stream:
                   every text of the set once, in seeded random order, against a cache that starts empty and grows
                   (a lookup not served is computed and stored, as in production). A label (was the nearest
                   candidate's answer right?) is revealed only where production has one: when the learner explores
                   or misses (the engine computed the answer anyway). Who answers whom: pairs TSV, texts joined by
                   label-1 pairs (transitively) except a pair labelled 0, never another pair's text; GPTCache's JSON,
                   the same origin; intents, the same intent, out-of-scope never. Beside it on the same stream: the
                   shipped static rule (scenario threshold + guard) and the static oracle (the best fixed cosine cut
                   with hindsight, simulated on the stream, at <= the learner's false-hit rate). Rates are shares of
                   all lookups. Last line: n, hit_rate, false_hit_rate, explorations, exploration_share, labels,
                   demoted, oracle_hit_rate, oracle_threshold, ratio_to_oracle, oracle_hit_rate_at_target,
                   static_hit_rate, static_false_hit_rate, static_threshold, target_false_hit_rate, embedder, seed,
                   oracle_threshold_at_target (the oracle's cut at the target), replay_threshold /
                   replay_threshold_at_target (the cut a replay of the learner's own lookups implies with every
                   label known, at the learner's false-hit rate / the target), log, tune; outcomes / estimated (per
                   outcome: candidates right and wrong, and the sum of the learner's estimated P(wrong)),
                   ranked_hit_rate_at_1pct (the learner's own estimates served lowest first with hindsight),
                   day_one_hit_rate / day_one_false_hit_rate (with --day-one-prior).
  --day-one-prior FILES  (with --stream) comma-separated labelled data files: the untaught learner is also run with
                   the worst case of their P(wrong | cosine) as its prior (:func:`day_one_prior`).
  --log DIR        (with --stream) write the learner's run to DIR as a decision log, the records the server writes:
                   a ``decision`` per lookup (``miss`` with no candidate, else ``hit``, ``explore`` or ``refused``
                   with the learner's reason, the nearest candidate's keys and cosine) and a ``label`` for every
                   label the run reveals (explorations and refused candidates; hits stay unlabelled). Then
                   ``edgecache tune DIR`` reads it; the last line's ``tune`` holds what it finds per variant
                   (:data:`TUNE_VARIANTS`) beside the oracle's cuts.

Otherwise the last line printed is one JSON object: n, hit_rate, false_hit_rate, threshold, embedder, hit_rate_at_1pct,
baseline_hit_rate_at_1pct, baseline_threshold_at_1pct, oos_hit_rate (intent sets with out-of-scope rows, else
null), target_false_hit_rate, candidates, lookup_p50_ms, lookup_p99_ms, second_stage_share.

  python scripts/eval_semantic.py --pairs DATA/pawsx_zh_test.tsv --scenario knowledge

(DATA: the data sets' folder, :data:`edgecache.bench.harness.DATA`.)
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import msgspec
import numpy as np

from edgecache.semantic import guard, refusals
from edgecache.semantic.decision_log import DecisionLog, log_files
from edgecache.semantic.embedders import Embedder, default_threshold, load_embedder
from edgecache.semantic.index import SemanticIndex
from edgecache.semantic.learner import SemanticLearner, Signal, upper_curve
from edgecache.semantic.lookup import Lookup, SemanticHit, record_lookup
from edgecache.semantic.teaching import Taught, group_labels
from edgecache.semantic.verifier import Verifier
from edgecache.settings import resolve_settings


class Case(msgspec.Struct):
    """One lookup: the query, its nearest candidates (text, cosine, right answer?), and whether any right answer
    is in the cache at all (``positive``); ``oos`` marks an out-of-scope query."""

    query: str
    candidates: list[tuple[str, float, bool]]
    positive: bool
    oos: bool = False
    set_name: str = ""


def read_pairs_tsv(path: Path) -> list[tuple[str, str, bool]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) >= 3 and parts[2].strip() in ("0", "1"):
                rows.append((parts[0], parts[1], parts[2].strip() == "1"))
    return rows


def read_intents(path: Path, splits: set[str] | None = None) -> list[tuple[str, str]]:
    items: list[tuple[str, str]] = []
    if path.suffix in (".jsonl", ".json"):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                obj = json.loads(line)
                if splits is None or obj.get("split") in splits:
                    items.append((obj["text"], obj.get("intent") or obj.get("category")))
    else:
        with path.open(encoding="utf-8", newline="") as f:
            for row in csv.DictReader(f):
                items.append((row["text"], row.get("category") or row.get("intent")))
    return items


def embed_all(emb: Embedder, texts: list[str], batch: int = 64) -> np.ndarray:
    if not texts:
        return np.zeros((0, emb.dim), dtype=np.float32)
    return np.concatenate([emb.embed(texts[i : i + batch]) for i in range(0, len(texts), batch)])


def pair_cases(rows: list[tuple[str, str, bool]], emb: Embedder, index: SemanticIndex, name: str = "") -> list[Case]:
    v1 = embed_all(emb, [r[0] for r in rows])
    v2 = embed_all(emb, [r[1] for r in rows])
    out = []
    for i, (s1, s2, label) in enumerate(rows):
        scenario = f"pair{i}"
        index.add("eval", scenario, v1[i], f"k{i}", s1)
        found = index.search("eval", scenario, v2[i], 1)
        index.drop("eval", scenario)
        out.append(Case(s2, [(c.text, c.similarity, label) for c in found], label, set_name=name))
    return out


def retrieval_cases(pairs: list[tuple[str, str]], emb: Embedder, index: SemanticIndex, k: int,
                    name: str = "") -> list[Case]:
    origins = sorted({o for o, _ in pairs})
    for text, vec in zip(origins, embed_all(emb, origins)):
        index.add("eval", "retrieval", vec, text, text)
    out = []
    for (origin, similar), vec in zip(pairs, embed_all(emb, [s for _, s in pairs])):
        found = index.search("eval", "retrieval", vec, k)
        out.append(Case(similar, [(c.text, c.similarity, c.store_key == origin) for c in found], True,
                        set_name=name))
    return out


def intent_cases(items: list[tuple[str, str]], emb: Embedder, index: SemanticIndex, k: int, *, seed: int,
                 per_intent: int, limit: int, name: str = "") -> list[Case]:
    items = list(items)
    random.Random(seed).shuffle(items)
    stored: list[tuple[str, str]] = []
    queries: list[tuple[str, str]] = []
    per: dict[str, int] = defaultdict(int)
    for text, intent in items:
        if intent != "oos" and per[intent] < per_intent:
            per[intent] += 1
            stored.append((text, intent))
        else:
            queries.append((text, intent))
    if limit:
        queries = queries[:limit]
    intent_of = {}
    for (text, intent), vec in zip(stored, embed_all(emb, [t for t, _ in stored])):
        intent_of[index.add("eval", "intents", vec, f"{intent}\x00{text}", text)] = intent
    out = []
    for (text, intent), vec in zip(queries, embed_all(emb, [t for t, _ in queries])):
        found = index.search("eval", "intents", vec, k)
        in_scope = intent != "oos"
        out.append(Case(text, [(c.text, c.similarity, in_scope and intent_of[c.vector_key] == intent) for c in found],
                        in_scope, oos=not in_scope, set_name=name))
    return out


def subset(rows: list, *, half: int | None, seed: int, limit: int) -> list:
    """``half`` 0/1 splits a seeded shuffle in two (calibrate on one half, report on the other); ``limit`` caps."""
    if half is not None:
        order = list(range(len(rows)))
        random.Random(seed).shuffle(order)
        rows = [rows[i] for i in sorted(order[half::2])]
    return rows[:limit] if limit else rows


def load_cases(kind: str, path: Path, emb: Embedder, *, k: int, seed: int = 0, limit: int = 0,
               half: int | None = None, per_intent: int = 3, splits: set[str] | None = None) -> list[Case]:
    """The lookups of one data file under its protocol (``kind`` pairs or intents), nearest ``k`` candidates each."""
    with tempfile.TemporaryDirectory() as tmp:
        index = SemanticIndex(tmp, dim=emb.dim, embedder_version=emb.version, dtype="f16", max_vectors=10**6)
        try:
            if kind == "pairs" and path.suffix == ".json":
                data = json.loads(path.read_text(encoding="utf-8"))
                pairs = subset([(d["origin"], d["similar"]) for d in data], half=half, seed=seed, limit=limit)
                return retrieval_cases(pairs, emb, index, k, path.name)
            if kind == "pairs":
                rows = subset(read_pairs_tsv(path), half=half, seed=seed, limit=limit)
                return pair_cases(rows, emb, index, path.name)
            return intent_cases(read_intents(path, splits), emb, index, k, seed=seed, per_intent=per_intent,
                                limit=limit, name=path.name)
        finally:
            index.close()


# ---- decisions ----


def verifier_decisions(verifier: Verifier, cases: list[Case]) -> tuple[np.ndarray, np.ndarray]:
    """Per lookup, the score of the candidate the verifier would serve (-1 when none may be) and whether it is right.

    The served candidate is the best-scored one not vetoed (the cut only decides whether it is served), so one pass
    gives the whole sweep over cuts.
    """
    score, ok = np.full(len(cases), -1.0), np.zeros(len(cases), dtype=bool)
    for i, case in enumerate(cases):
        judged = verifier.judge(case.query, [(t, s) for t, s, _ in case.candidates], cut=0.0)
        if judged.chosen is not None:
            score[i], ok[i] = judged.score, case.candidates[judged.chosen][2]
    return score, ok


def threshold_decisions(cases: list[Case], rules: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The pre-verifier rule (a scenario's ``threshold`` override): top-1 cosine, refused by any guard rule."""
    sim, ok = np.full(len(cases), -2.0), np.zeros(len(cases), dtype=bool)
    for i, case in enumerate(cases):
        if case.candidates:
            text, cos, right = case.candidates[0]
            if guard.check(case.query, text, rules).allowed:
                sim[i], ok[i] = cos, right
    return sim, ok


def cosine_decisions(cases: list[Case]) -> tuple[np.ndarray, np.ndarray]:
    sim, ok = np.full(len(cases), -2.0), np.zeros(len(cases), dtype=bool)
    for i, case in enumerate(cases):
        if case.candidates:
            sim[i], ok[i] = case.candidates[0][1], case.candidates[0][2]
    return sim, ok


def rates(sim: np.ndarray, ok: np.ndarray, n_pos: int, cuts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """hit_rate and false_hit_rate at every cut (vectorised over the sweep)."""
    hits = sim[None, :] >= cuts[:, None] - 1e-9
    true_hits = (hits & ok[None, :]).sum(axis=1)
    false_hits = (hits & ~ok[None, :]).sum(axis=1)
    return true_hits / max(n_pos, 1), false_hits / max(len(sim), 1)


def best_at(hit: np.ndarray, fhr: np.ndarray, cuts: np.ndarray, max_fhr: float) -> tuple[float, float]:
    allowed = fhr <= max_fhr + 1e-12
    if not allowed.any():
        return 0.0, 1.0
    i = int(np.argmax(np.where(allowed, hit, -1.0)))
    return float(hit[i]), float(cuts[i])


def measure_latency(cases: list[Case], emb: Embedder, verifier: Verifier | None, k: int, n: int,
                    target: float) -> list[float]:
    """Lookups one at a time as the server runs them: embed one query, search an index of the cached texts, verify."""
    cases = cases[:n]
    if not cases:
        return []
    texts = sorted({t for c in cases for t, _, _ in c.candidates})
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        index = SemanticIndex(tmp, dim=emb.dim, embedder_version=emb.version, dtype="f16", max_vectors=10**6)
        try:
            for text, vec in zip(texts, embed_all(emb, texts)):
                index.add("eval", "latency", vec, text, text)
            for case in cases:
                started = time.perf_counter()
                vec = emb.embed([case.query])[0]
                found = index.search("eval", "latency", vec, k)
                if verifier is not None:
                    verifier.judge(case.query, [(c.text, c.similarity) for c in found],
                                   verifier.cut(target, case.query))
                out.append((time.perf_counter() - started) * 1000)
        finally:
            index.close()
    return out


# ---- the stream protocol (--stream): a cache that grows, labels only where production has them ----


class Stream(msgspec.Struct):
    """The texts of a set in seeded random order, and who answers whom: ``group[i] == group[j]`` (both >= 0) means
    text j's cached answer serves text i, unless the pair is one the set labels different (``different``)."""

    texts: list[str]
    group: list[int]
    different: set[tuple[int, int]]
    name: str = ""
    #: The last ``taught`` texts are a tenant's grouped questions (``--teach``): cached before the stream starts and
    #: never looked up themselves; the others are the lookups, in order.
    taught: int = 0

    @property
    def lookups(self) -> int:
        return len(self.texts) - self.taught


def sample_per_intent(items: list[tuple[str, str]], n: int, seed: int) -> list[tuple[str, str]]:
    """A seeded sample of ``n`` texts of every intent (all of an intent that has fewer, and every out-of-scope
    text), intents in sorted order: a training set cut to the shape of a held-out split (banking77's test split
    has 40 texts per intent, CLINC150's 30), so that the fewer repeats per intent of such a split can be measured
    on a set one may look at."""
    by_intent: dict[str, list[str]] = defaultdict(list)
    for text, intent in items:
        by_intent[intent].append(text)
    rng = random.Random(seed)
    return [(text, intent) for intent, texts in sorted(by_intent.items())
            for text in rng.sample(texts, len(texts) if intent == "oos" else min(n, len(texts)))]


def split_intents(items: list[tuple[str, str]], *, by: str, share: float, seed: int
                  ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """An intent set cut in two, to teach from one part and stream the other: ``by`` ``text``, a seeded ``share``
    of every intent's texts is taught and the rest streamed; ``by`` ``intent``, every text of a seeded ``share`` of
    the intents is taught and the other intents are only streamed (they meet a server that was taught other
    questions). Out-of-scope texts are always streamed (there is no group to teach them in)."""
    rng = random.Random(seed)
    by_intent: dict[str, list[str]] = defaultdict(list)
    for text, intent in items:
        by_intent[intent].append(text)
    names = sorted(i for i in by_intent if i != "oos")
    taught_intents = set(rng.sample(names, round(share * len(names)))) if by == "intent" else set()
    teach, stream = [], []
    for intent in sorted(by_intent):
        texts = by_intent[intent]
        if intent == "oos":
            stream += [(t, intent) for t in texts]
        elif by == "intent":
            (teach if intent in taught_intents else stream).extend((t, intent) for t in texts)
        else:
            chosen = set(rng.sample(range(len(texts)), round(share * len(texts))))
            for n, text in enumerate(texts):
                (teach if n in chosen else stream).append((text, intent))
    return teach, stream


def write_intents(path: Path, items: list[tuple[str, str]]) -> None:
    """An intent set as ``read_intents`` reads it (CSV ``text,category``)."""
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "category"])
        writer.writerows(items)


def stream_of(kind: str, path: Path, *, seed: int, limit: int, splits: set[str] | None = None,
              intent_sample: int | None = None, sample_seed: int = 0,
              teach: list[tuple[str, str]] | None = None) -> Stream:
    """Ground truth per protocol.

    Pairs TSV: every distinct text of the first ``limit`` pairs is looked up once; texts joined by label-1 pairs
    (transitively) serve each other, except a pair the set labels 0; a text of another pair never does.
    GPTCache's JSON: origins and similars of the first ``limit`` pairs; a text serves another iff they share the
    origin. Intents: the first ``limit`` texts of a seeded shuffle (of :func:`sample_per_intent` of them, with
    ``intent_sample`` texts per intent); same intent serves, out-of-scope never does. ``teach`` (intents: text and
    intent) are appended as the stream's taught texts (:attr:`Stream.taught`), an intent of theirs the same group as
    the stream's of that name.
    """
    edges: list[tuple[str, str, bool]] = []
    labelled: list[tuple[str, str | None]] = []
    if kind == "pairs" and path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        edges = [(d["origin"], d["similar"], True) for d in data[:limit or None]]
    elif kind == "pairs":
        edges = read_pairs_tsv(path)[:limit or None]
    else:
        items = read_intents(path, splits)
        if intent_sample is not None:
            items = sample_per_intent(items, intent_sample, sample_seed)
        random.Random(seed).shuffle(items)
        labelled = [(t, None if i == "oos" else i) for t, i in items[:limit or None]]
    if edges:
        parent: dict[str, str] = {}

        def root(t: str) -> str:
            while parent.setdefault(t, t) != t:
                parent[t] = parent[parent[t]]
                t = parent[t]
            return t

        for a, b, same in edges:
            root(a), root(b)
            if same:
                parent[root(a)] = root(b)
        names = {r: n for n, r in enumerate(sorted({root(t) for t in parent}))}
        labelled = [(t, str(names[root(t)])) for t in sorted(parent)]
        random.Random(seed).shuffle(labelled)
    taught = [(t, i) for t, i in teach or [] if i != "oos"]
    labelled += taught
    texts = [t for t, _ in labelled]
    ids = {g: n for n, g in enumerate(sorted({g for _, g in labelled if g is not None}))}
    group = [-1 if g is None else ids[g] for _, g in labelled]
    position = {t: i for i, t in enumerate(texts)}
    different = set()
    for a, b, same in edges:
        if not same:
            different |= {(position[a], position[b]), (position[b], position[a])}
    return Stream(texts, group, different, path.name, taught=len(taught))


def right_answer(stream: Stream, query: int, cached: int) -> bool:
    g = stream.group[query]
    return g >= 0 and g == stream.group[cached] and (query, cached) not in stream.different


class StreamResult(msgspec.Struct):
    lookups: int
    hits: int = 0
    false_hits: int = 0
    explorations: int = 0
    labels: int = 0
    demoted: int = 0
    stored: int = 0
    #: every lookup that had a candidate: its similarity and whether the candidate was right (what a fully labelled
    #: log of the run would hold)
    candidates: list[tuple[float, bool]] = msgspec.field(default_factory=list)
    #: the lookups (positions in the stream) served a right answer: the paired bootstrap's unit
    right_hits: list[int] = msgspec.field(default_factory=list)
    #: the lookups served a wrong answer
    wrong_hits: list[int] = msgspec.field(default_factory=list)
    #: the learner's outcomes: (what it did: ``hit`` or the refusal, as the decision log spells it) -> [lookups whose
    #: candidate was right, lookups whose candidate was wrong]
    outcomes: dict[str, list[int]] = msgspec.field(default_factory=dict)
    #: per outcome, the sum of the learner's estimated P(wrong) of its candidates (against ``outcomes``' wrong count:
    #: whether the estimate of what it refused, or served, is calibrated)
    estimated: dict[str, float] = msgspec.field(default_factory=dict)
    #: the learner's estimated P(wrong) of every lookup's candidate, in the order of ``candidates``
    errors: list[float] = msgspec.field(default_factory=list)

    def ranked_hit_rate(self, rate: float) -> float:
        """The hit rate of serving the candidates with the lowest estimated errors first, with hindsight, until the
        wrong ones would pass ``rate`` of the lookups: how well the estimate ranks, apart from how it spends."""
        if not self.errors:
            return 0.0
        right = np.array([ok for _, ok in self.candidates])[np.argsort(np.array(self.errors), kind="stable")]
        wrong = np.cumsum(~right)
        served = int(np.searchsorted(wrong, rate * self.lookups + 1e-9, side="right"))
        return float(right[:served].sum()) / max(self.lookups, 1)

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.lookups, 1)

    def first(self, lookups: int) -> tuple[float, float]:
        """(hit rate, false-hit rate) over the first ``lookups`` lookups (day one)."""
        n = max(min(lookups, self.lookups), 1)
        return sum(i < n for i in self.right_hits) / n, sum(i < n for i in self.wrong_hits) / n

    @property
    def false_hit_rate(self) -> float:
        return self.false_hits / max(self.lookups, 1)


#: What a lookup the learner refused stores (``--store``): the query's vector on every miss (as the server does), or,
#: as vCache does, only when its label says the nearest candidate was wrong (a right one already answers it).
STORE_RULES = ("every_miss", "on_wrong")


def run_stream(stream: Stream, sim: np.ndarray, decide, record=None, link=None, alone=None,
               store: str = "every_miss") -> StreamResult:
    """Look the texts up in order against a cache that grows: a lookup not served is computed and stored. ``decide``
    (query, candidate, similarity) -> serve | explore | miss; on explore or miss the pair's label is revealed to
    ``record`` (on a miss the engine computed the answer anyway, so comparing it with the candidate's is free).
    ``alone`` (query) hears a lookup that found the cache empty (no candidate: a plain miss). ``store`` ``on_wrong``:
    a refused lookup whose label says the candidate was right is not stored (vCache's rule). ``sim``: the lookups'
    rows of the similarity matrix (the stream's taught texts, :attr:`Stream.taught`, are cached before the first)."""
    n = stream.lookups
    out = StreamResult(lookups=n)
    # The nearest stored text of every later lookup, kept up to date as texts are stored (``sim`` is symmetric:
    # storing text i compares it with every later text at once); ties go to the earliest stored, as argmax would.
    best_sim = np.full(n, -np.inf, dtype=np.float32)
    best_j = np.full(n, -1, dtype=np.int64)
    if stream.taught:
        best_j[:] = n + np.argmax(sim[:n, n:], axis=1)
        best_sim[:] = sim[np.arange(n), best_j]
    n_stored = stream.taught
    for i in range(n):
        if not n_stored and alone is not None:
            alone(i)
        if n_stored:
            j, s = int(best_j[i]), float(best_sim[i])
            correct = right_answer(stream, i, j)
            out.candidates.append((s, correct))
            action = decide(i, j, s)
            if action == "serve":
                if correct:
                    out.hits += 1
                    out.right_hits.append(i)
                else:
                    out.false_hits += 1
                    out.wrong_hits.append(i)
                continue
            if action == "explore":
                out.explorations += 1
            if record is not None:
                record(i, j, s, correct)
                out.labels += 1
                if correct and link is not None:
                    link(i, j)
                if correct and store == "on_wrong":
                    continue
        row = sim[i, i + 1:n]
        closer = row > best_sim[i + 1:]
        best_sim[i + 1:][closer] = row[closer]
        best_j[i + 1:][closer] = i
        n_stored += 1
    out.stored = n_stored - stream.taught
    return out


#: The learner's settings a stream run may vary (``--learner KEY=VALUE``), as :class:`SemanticLearner` spells them.
LEARNER_OPTIONS = ("prior_weight", "spread", "margin", "z", "slope_after", "slope_spread", "confidence",
                   "calibration_weight", "trust_after", "max_error", "audit_share", "window", "calibration_band",
                   "entry_labels")
#: Those of them that count something (given as whole numbers).
_COUNT_OPTIONS = ("entry_labels",)


def learner_stream(stream: Stream, sim: np.ndarray, *, scenario: str, target: float, shipped: float,
                   signal=None, seed: int = 0, explore_share: float = 0.05, audit_share: float | None = None,
                   link: bool = True, log: DecisionLog | None = None, tenant: str = "eval",
                   labels: bool = True, store: str = "every_miss",
                   options: dict[str, float] | None = None, prior_curve: np.ndarray | None = None,
                   learner: SemanticLearner | None = None, taught: Taught | None = None) -> tuple[StreamResult, int]:
    """The online learner on the stream; returns its result and how many entries it demoted. ``shipped`` is the
    static prior cut on the cosine; ``signal`` (query, candidate, cosine) -> the verifier's calibrated probability
    replaces the cosine (the learner's prior is then that probability). ``labels`` False: the learner is never
    taught (a server with no labeler). ``options``: the learner's settings (:data:`LEARNER_OPTIONS`), or
    ``learner`` one built elsewhere (the server's, :func:`edgecache.semantic.assembly.learner_for`). With ``log``,
    every lookup is written as the server writes it: one ``decision`` record (the nearest candidate's store and
    vector key and its similarity; the learner's reason) and a ``label`` for every label the run reveals
    (explorations and refused candidates); served lookups stay unlabelled, as in production. ``taught``: what the
    stream's taught texts teach (:func:`taught_of`), taught before the first lookup."""
    settings = dict(options or {})
    if audit_share is not None:
        settings["audit_share"] = audit_share
    if learner is None:
        learner = SemanticLearner(prior_cut=shipped, prior_curve=prior_curve, seed=seed, explore_share=explore_share,
                                  **settings)
    axis: Signal = "probability" if signal is not None else "cosine"
    if taught is not None:
        learner.teach(tenant, scenario, taught.classes, taught.labels, prior_cut=shipped, signal=axis)
    decisions: dict[int, tuple] = {}  # query -> (the learner's decision, its log id)
    value_of = signal or (lambda i, j, s: s)
    outcomes: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    estimated: dict[str, float] = defaultdict(float)
    errors: list[float] = []

    def decide(i: int, j: int, s: float) -> str:
        value = value_of(i, j, s)
        decision = learner.decide(tenant, scenario, str(j), value, target, prior_cut=shipped, signal=axis)
        refusal = None if decision.action == "serve" else (
            refusals.EXPLORE if decision.action == "explore" else refusals.by_learner(decision.reason))
        outcomes[refusal or "hit"][0 if right_answer(stream, i, j) else 1] += 1
        estimated[refusal or "hit"] += decision.error
        errors.append(decision.error)
        logged = None
        if log is not None:
            # The lookup the server's learner decider makes of it (edgecache.semantic.deciders.by_learner), logged
            # as the server logs it.
            lookup = Lookup(vector=None, candidate=SemanticHit(similarity=s, store_key=str(j), vector_key=j),
                            refusal=refusal, score=None if value == s else value, learned=decision)
            logged = record_lookup(log, tenant, scenario, stream.texts[i], lookup, served=decision.action == "serve")
        decisions[i] = (decision, logged)
        return decision.action

    def record(i: int, j: int, s: float, correct: bool) -> None:
        decision, logged = decisions.pop(i)
        learner.record(tenant, scenario, str(j), value_of(i, j, s), correct, prior_cut=shipped, decision=decision,
                       signal=axis)
        if logged is not None:
            log.labelled(logged, correct, "stream-truth")  # type: ignore[union-attr]

    def linked(i: int, j: int) -> None:
        if link:
            learner.link(tenant, scenario, str(i), str(j))

    def alone(i: int) -> None:
        if log is not None:
            record_lookup(log, tenant, scenario, stream.texts[i], Lookup(vector=None), served=False)

    result = run_stream(stream, sim, decide, record if labels else None, linked, alone, store=store)
    if not labels:
        result.labels = 0
    result.outcomes = dict(outcomes)
    result.estimated = dict(estimated)
    result.errors = errors
    decisions.clear()  # served lookups: never labelled
    return result, learner.demoted


def taught_of(stream: Stream, vectors: np.ndarray) -> Taught | None:
    """What the stream's taught texts teach (their intents are their groups), keyed as the stream keys them (a
    text's position), as a server taught the same groups in a warmup would teach it."""
    if not stream.taught:
        return None
    n = stream.lookups
    return group_labels([str(j) for j in range(n, len(stream.texts))], [str(g) for g in stream.group[n:]],
                        vectors[n:])


#: Day one's windows: the first lookups a taught tenant's server answers (``None``: the whole stream).
DAY_ONE = (500, 1000, None)


def day_one_figures(taught: StreamResult, untaught: StreamResult, sweep: list[tuple[float, StreamResult]],
                    target: float) -> dict:
    """Over the first 500 and 1,000 lookups and the whole stream: the taught learner's hits and wrong answers, the
    learner's on the same cache untaught, and the static oracle's hits at 1 % and at ``target`` on those lookups
    (the best cosine cut with hindsight on that window). The top level repeats the first 1,000 lookups' figures."""
    windows: dict[str, dict] = {}
    for window in DAY_ONE:
        n = taught.lookups if window is None else min(window, taught.lookups)

        def oracle(rate: float) -> float:
            best = 0.0
            for _, run in sweep:
                hits, wrong = run.first(n)
                if wrong <= rate + 1e-12:
                    best = max(best, hits)
            return best

        hit, false = taught.first(n)
        plain_hit, plain_false = untaught.first(n)
        at_1 = oracle(0.01)
        windows["all" if window is None else str(window)] = {
            "lookups": n, "hit_rate": round(hit, 4), "false_hit_rate": round(false, 4),
            "untaught_hit_rate": round(plain_hit, 4), "untaught_false_hit_rate": round(plain_false, 4),
            "oracle_hit_rate_at_1pct": round(at_1, 4), "oracle_hit_rate_at_target": round(oracle(target), 4),
            "ratio_to_oracle_at_1pct": round(hit / at_1, 3) if at_1 > 0 else None}
    top = windows["1000"]
    return {"hit_rate": top["hit_rate"], "false_hit_rate": top["false_hit_rate"],
            "oracle_hit_rate_at_target": top["oracle_hit_rate_at_target"], "windows": windows}


def kind_of(path: Path) -> str:
    """The protocol of a data file by its suffix: question pairs (TSV, GPTCache's JSON) or intents (CSV, JSON lines)."""
    return "pairs" if path.suffix in (".tsv", ".json") else "intents"


def day_one_prior(paths: list[Path], emb: Embedder, cache: EmbeddingCache, *, limit: int,
                  seed: int = 0) -> np.ndarray:
    """A prior for the untaught learner fitted on labelled sets: per set, the nearest candidates of its stream (every
    lookup a miss, so the cache holds every earlier text) give P(wrong | cosine) as an upper bound
    (:func:`edgecache.semantic.learner.upper_curve`); the prior is the worst of the sets at every cosine, so it holds
    on each of them."""
    curves = []
    for path in paths:
        stream = stream_of(kind_of(path), path, seed=seed, limit=limit)
        vectors = cache.embed(emb, stream.texts)
        seen = run_stream(stream, vectors @ vectors.T, lambda i, j, s: "miss")
        sims = np.array([s for s, _ in seen.candidates])
        curves.append(upper_curve(sims, np.array([not ok for _, ok in seen.candidates])))
    return np.max(curves, axis=0)


def hindsight_cut(candidates: list[tuple[float, bool]], lookups: int, target: float) -> float | None:
    """The lowest cut whose wrong candidates at or above it stay within ``target`` of ``lookups``, with every label
    known: the cut a fully labelled replay of a log implies (``edgecache tune --per lookup --confidence 0``)."""
    bad, best = 0, None
    order = sorted(candidates, key=lambda x: -x[0])
    k = 0
    while k < len(order):
        value = order[k][0]
        while k < len(order) and order[k][0] == value:
            bad += not order[k][1]
            k += 1
        if bad <= target * lookups + 1e-9:
            best = value
    return best


def best_cut(sweep: list[tuple[float, StreamResult]], rate: float) -> tuple[float, float, StreamResult | None]:
    """(hit rate, cut, run) of the sweep's cut that serves the most at <= ``rate`` false hits (the lowest such cut
    on a tie); (0, 1, None) when none keeps within it."""
    allowed = [(r.hit_rate, c, r) for c, r in sweep if r.false_hit_rate <= rate + 1e-12]
    return max(allowed, key=lambda x: (x[0], -x[1])) if allowed else (0.0, 1.0, None)


def bootstrap_ratio(pairs: list[tuple[np.ndarray, np.ndarray]], *, resamples: int = 2000, seed: int = 0,
                    level: float = 0.95) -> tuple[float | None, float | None, float | None]:
    """The ratio of two policies' right hits over several streams, and its percentile interval: per stream the
    lookups are resampled with replacement (paired: one draw counts for both policies), the streams kept apart.
    ``pairs``: per stream, 0/1 per lookup for the numerator's policy and the denominator's."""
    total_a = sum(float(a.sum()) for a, _ in pairs)
    total_b = sum(float(b.sum()) for _, b in pairs)
    if total_b == 0:
        return None, None, None
    rng = np.random.default_rng(seed)
    num, den = np.zeros(resamples), np.zeros(resamples)
    for a, b in pairs:
        n = len(a)
        if n == 0:
            continue
        # A multinomial draw of how often each lookup is picked, in chunks to bound memory on long streams.
        for start in range(0, resamples, 200):
            stop = min(resamples, start + 200)
            counts = rng.multinomial(n, np.full(n, 1.0 / n), size=stop - start)
            num[start:stop] += counts @ a
            den[start:stop] += counts @ b
    ratios = num / np.where(den > 0, den, np.nan)
    lo, hi = np.nanpercentile(ratios, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])
    return total_a / total_b, float(lo), float(hi)


class EmbeddingCache:
    """Vectors of texts already embedded, on disk under ``directory`` per embedder version (``None``: none kept).
    The embedder is a stream run's cost: a second seed or variant of the same set costs none."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory

    def embed(self, emb: Embedder, texts: list[str]) -> np.ndarray:
        if self.directory is None or not texts:
            return embed_all(emb, texts)
        import hashlib

        unique = sorted(set(texts))
        digest = hashlib.blake2b("\x00".join([emb.version, *unique]).encode(), digest_size=16).hexdigest()
        path = self.directory / f"{digest}.npy"
        if path.exists():
            vectors = np.load(path)
        else:
            vectors = embed_all(emb, unique)
            self.directory.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".part.npy")
            np.save(partial, vectors)
            partial.replace(path)
        row = {t: n for n, t in enumerate(unique)}
        return vectors[[row[t] for t in texts]]


def stream_main(args: argparse.Namespace, kind: str, path: Path) -> dict:
    """--stream: the learner (:mod:`edgecache.semantic.learner`) against the shipped static rule, the verifier and
    the static oracle on the same stream, per seed; the ratio of the learner's hit rate to the oracle's at 1 % over
    all seeds with its bootstrap interval. Rates are shares of all lookups."""
    seeds = [int(s) for s in str(args.seeds).split(",")] if args.seeds else [args.seed]
    if args.log is not None and len(seeds) > 1:
        raise SystemExit("error: --log writes one run; give one seed")
    settings = resolve_settings(args.profile, {}, environ={})
    scenario = settings.scenarios.get(args.scenario) or settings.scenarios["default"]
    target = args.target if args.target is not None else scenario.target_false_hit_rate
    emb = load_embedder(args.embedder or settings.semantic.embedder, threads=1)
    shipped = scenario.threshold if scenario.threshold is not None else default_threshold(emb.version, args.scenario)
    rules = [] if args.rules == "none" else [r for r in args.rules.split(",") if r]
    verifier = Verifier.load(args.verifier or settings.semantic.verifier_params)
    use_verifier = args.signal == "verifier" and verifier.embedder == emb.version
    options: dict[str, float] = {}
    for item in args.learner or []:
        key, _, value = item.partition("=")
        if key not in LEARNER_OPTIONS:
            raise SystemExit(f"error: --learner {key}: not one of {', '.join(LEARNER_OPTIONS)}")
        options[key] = (None if value == "none" else int(value) if key in _COUNT_OPTIONS  # type: ignore[assignment]
                        else float(value))
    cache = EmbeddingCache(None if args.embed_cache == "none" else Path(args.embed_cache))
    prior = None
    if args.day_one_prior:
        prior = day_one_prior([Path(p) for p in args.day_one_prior.split(",") if p], emb, cache, limit=args.limit)
        print("day-one prior P(wrong) at cosine 0.90 / 0.95 / 0.98 / 0.99: "
              + " / ".join(f"{prior[b]:.3f}" for b in (90, 95, 98, 99)))
    runs, pairs = [], []
    t0 = time.perf_counter()
    for seed in seeds:
        result = stream_run(args, kind, path, seed=seed, emb=emb, cache=cache, verifier=verifier,
                            use_verifier=use_verifier, target=target, shipped=shipped, rules=rules, options=options,
                            prior=prior)
        pairs.append(result.pop("_pair"))
        runs.append(result)
    if len(runs) == 1:
        result = runs[0]
    else:
        result = {key: round(float(np.mean([r[key] for r in runs])), 4)
                  for key in ("hit_rate", "false_hit_rate", "exploration_share", "untaught_hit_rate",
                              "untaught_false_hit_rate", "verifier_hit_rate", "verifier_false_hit_rate",
                              "static_hit_rate", "static_false_hit_rate", "oracle_hit_rate_at_1pct")}
        result.update(n=sum(r["n"] for r in runs), explorations=sum(r["explorations"] for r in runs),
                      seeds=seeds, max_false_hit_rate=max(r["false_hit_rate"] for r in runs),
                      target_false_hit_rate=target, embedder=emb.version, signal=runs[0]["signal"],
                      runs=runs)
    ratio, lo, hi = bootstrap_ratio(pairs)
    result["ratio_to_oracle_at_1pct"] = None if ratio is None else round(ratio, 3)
    result["ratio_interval"] = None if lo is None else [round(lo, 3), round(hi, 3)]
    if len(runs) > 1:
        print(f"{len(seeds)} seeds: learner hit rate {result['hit_rate']:.4f} (mean), false hits "
              f"{result['false_hit_rate']:.4f} (mean, max {result['max_false_hit_rate']:.4f}), untaught "
              f"{result['untaught_hit_rate']:.4f}, verifier {result['verifier_hit_rate']:.4f}, oracle at 1 % "
              f"{result['oracle_hit_rate_at_1pct']:.4f}")
    print("learner / static oracle at 1 %: " + ("n/a" if ratio is None else
          f"{ratio:.2f}x (95 % bootstrap interval {lo:.2f}-{hi:.2f}, lookups resampled per seed)")
          + f"   ({time.perf_counter() - t0:.1f} s in all)")
    print(json.dumps(result))
    return result


def stream_run(args: argparse.Namespace, kind: str, path: Path, *, seed: int, emb: Embedder,
               cache: EmbeddingCache, verifier: Verifier, use_verifier: bool, target: float, shipped: float,
               rules: list[str], options: dict[str, float], prior: np.ndarray | None = None) -> dict:
    """One seed's stream: every policy on it, printed, and its figures (``_pair``: the learner's and the oracle at
    1 %'s right hits per lookup, for the bootstrap)."""
    t0 = time.perf_counter()
    stream = stream_of(kind, path, seed=seed, limit=args.limit,
                       splits=set(args.splits.split(",")) if args.splits else None,
                       intent_sample=args.sample_per_intent, sample_seed=args.sample_seed,
                       teach=read_intents(args.teach) if args.teach is not None else None)
    vectors = cache.embed(emb, stream.texts)
    sim = vectors[:stream.lookups] @ vectors.T
    taught = taught_of(stream, vectors)
    embedded = time.perf_counter() - t0

    score_of: dict[tuple[int, int], float] = {}

    def score(i: int, j: int, s: float) -> float:
        """The verifier's calibrated P(right) of the pair (0 when a hard veto refuses it)."""
        if (i, j) not in score_of:
            judged = verifier.judge(stream.texts[i], [(stream.texts[j], s)], cut=0.0)
            score_of[(i, j)] = judged.score if judged.chosen is not None else 0.0
        return score_of[(i, j)]

    log = None
    if args.log is not None:
        if log_files(args.log):
            raise SystemExit(f"error: {args.log} already holds a decision log (give an empty or new folder)")
        log = DecisionLog(args.log, max_bytes=256 << 20, files=8)
    common = {"scenario": args.scenario, "target": target, "shipped": shipped,
              "signal": score if use_verifier else None, "seed": seed, "explore_share": args.explore_share,
              "audit_share": args.audit_share, "link": args.link, "options": options}
    try:
        learned, demoted = learner_stream(stream, sim, log=log, store=args.store, taught=taught,
                                          **common)  # type: ignore[arg-type]
    finally:
        if log is not None:
            log.close()
    learned.demoted = demoted
    untaught, _ = learner_stream(stream, sim, labels=False, **common)  # type: ignore[arg-type]
    day_one = None
    if prior is not None:
        day_one, _ = learner_stream(stream, sim, labels=False, prior_curve=prior, **common)  # type: ignore[arg-type]
    static = run_stream(stream, sim, lambda i, j, s: "serve" if s >= shipped - 1e-9 and guard.check(
        stream.texts[i], stream.texts[j], rules).allowed else "miss")
    verified = None
    if verifier.embedder == emb.version:
        verified = run_stream(stream, sim, lambda i, j, s: "serve" if score(i, j, s) >= verifier.cut(
            target, stream.texts[i]) - 1e-12 else "miss")
    cuts = np.round(np.arange(args.oracle_from, 1.0001, args.oracle_step), 4)
    sweep = [(c, run_stream(stream, sim, lambda i, j, s, c=c: "serve" if s >= c - 1e-9 else "miss")) for c in cuts]

    def oracle_at(rate: float) -> tuple[float, float, StreamResult | None]:
        return best_cut(sweep, rate)

    # Day one's ceiling: the most one cut on the verifier's score (in steps of 0.005) serves at <= 1 % false hits,
    # the cut chosen with hindsight on this very stream. Where it is under the verifier's own hits at its target, no
    # single cut on that score (what a never-taught prior on it amounts to) serves as much within 1 % on this stream.
    verifier_1: tuple[float, float] | None = None  # (hit rate, cut), when asked for: 201 more runs of the stream
    if verified is not None and args.verifier_oracle:
        scored = [(c, run_stream(stream, sim, lambda i, j, s, c=c: "serve" if score(i, j, s) >= c - 1e-12
                                 else "miss")) for c in np.round(np.arange(0.0, 1.0001, 0.005), 3)]
        verifier_1 = best_cut(scored, 0.01)[:2]

    windows = None
    if taught is not None:
        # The same cache without its groups (a warmup of the same lines with no `group`): what teaching adds.
        plain, _ = learner_stream(stream, sim, store=args.store, **common)  # type: ignore[arg-type]
        windows = day_one_figures(learned, plain, sweep, target)
        for name, figures in windows["windows"].items():
            print(f"day one, {name} lookups: taught {figures['hit_rate']:.4f} hits / {figures['false_hit_rate']:.4f} "
                  f"false; untaught {figures['untaught_hit_rate']:.4f} / {figures['untaught_false_hit_rate']:.4f}; "
                  f"oracle at 1 % {figures['oracle_hit_rate_at_1pct']:.4f} (taught / it "
                  + ("n/a" if figures["ratio_to_oracle_at_1pct"] is None else
                     f"{figures['ratio_to_oracle_at_1pct']:.2f}x") + ")")
    oracle_hit, oracle_cut, oracle = oracle_at(learned.false_hit_rate)
    oracle_target_hit, oracle_target_cut, _ = oracle_at(target)
    oracle_1_hit, oracle_1_cut, oracle_1 = oracle_at(0.01)
    ratio = learned.hit_rate / oracle_hit if oracle_hit > 0 else None
    ratio_1 = learned.hit_rate / oracle_1_hit if oracle_1_hit > 0 else None
    # The cut a fully labelled replay of the learner's own lookups implies (what `tune --per lookup --confidence 0`
    # would find if every served lookup were labelled too): apart from the oracle's by the cache the oracle grows.
    replay_cut = hindsight_cut(learned.candidates, learned.lookups, learned.false_hit_rate)
    replay_target_cut = hindsight_cut(learned.candidates, learned.lookups, target)
    tuned = tune_log(args.log, target=target, learner_rate=learned.false_hit_rate) if log is not None else None
    elapsed = time.perf_counter() - t0

    print(f"stream {stream.name}: {learned.lookups} lookups in seeded order (seed {seed}), cache grows on every "
          f"lookup not served ({args.store}); embedder {emb.version}; scenario {args.scenario}, target {target:.2%}; "
          f"learner signal {'verifier' if use_verifier else 'cosine'}")
    print(f"{'':38}{'hit rate':>10}{'false hits':>12}{'explored':>10}")
    print(f"{'learner':38}{learned.hit_rate:10.4f}{learned.false_hit_rate:12.4f}{learned.explorations:10d}"
          f"   ({learned.labels} labels, {learned.demoted} entries demoted, {learned.stored} stored)")
    print(f"{'learner, never taught':38}{untaught.hit_rate:10.4f}{untaught.false_hit_rate:12.4f}"
          f"{untaught.explorations:10d}")
    if day_one is not None:
        print(f"{'learner, never taught, day-one prior':38}{day_one.hit_rate:10.4f}{day_one.false_hit_rate:12.4f}"
              f"{day_one.explorations:10d}")
    if verified is not None:
        print(f"{'verifier (nearest, cut at target)':38}{verified.hit_rate:10.4f}{verified.false_hit_rate:12.4f}")
    if verifier_1 is not None:
        print(f"{'verifier oracle at 1 %% (score>=%.3f)' % verifier_1[1]:38}{verifier_1[0]:10.4f}"
              "   the best cut on the verifier's score at <= 1 % false hits, with hindsight")
    print(f"{'static rule (cos>=%.3f+guard)' % shipped:38}{static.hit_rate:10.4f}{static.false_hit_rate:12.4f}")
    if oracle is not None:
        print(f"{'static oracle (cos>=%.3f)' % oracle_cut:38}{oracle.hit_rate:10.4f}{oracle.false_hit_rate:12.4f}"
              f"   at <= the learner's false hits; learner / oracle "
              + ("n/a" if ratio is None else f"{ratio:.2f}x"))
    print(f"{'static oracle at target (cos>=%.3f)' % oracle_target_cut:38}{oracle_target_hit:10.4f}")
    print(f"{'static oracle at 1 %% (cos>=%.3f)' % oracle_1_cut:38}{oracle_1_hit:10.4f}"
          + ("" if oracle_1 is None else f"{oracle_1.false_hit_rate:12.4f}")
          + "   learner / it " + ("n/a" if ratio_1 is None else f"{ratio_1:.2f}x"))
    print("the learner's lookups by outcome (candidate right / wrong; the wrong ones' share, and the learner's mean "
          "estimate of it):")
    for outcome, (right, wrong) in sorted(learned.outcomes.items(), key=lambda x: -sum(x[1])):
        n = max(right + wrong, 1)
        print(f"  {outcome:36}{right:8d}{wrong:8d}{wrong / n:10.3f}{learned.estimated.get(outcome, 0.0) / n:10.3f}")
    print(f"the learner's own estimates ranked with hindsight (lowest first, wrong <= 1 % of lookups): hit rate "
          f"{learned.ranked_hit_rate(0.01):.4f}" + ("" if not oracle_1_hit else
                                                   f", {learned.ranked_hit_rate(0.01) / oracle_1_hit:.2f}x the oracle at 1 %"))
    print(f"fully labelled replay of the learner's lookups: cut {_cut(replay_cut)} at <= the learner's false hits, "
          f"{_cut(replay_target_cut)} at target" + (f"; decision log written to {args.log}" if log else ""))
    if tuned is not None:
        print(f"edgecache tune on that log (cut, labels behind it; oracle {oracle_cut:.4f} at the learner's false "
              f"hits, {oracle_target_cut:.4f} at target):")
        for name, found in tuned.items():
            print(f"  {name:34}{_cut(found['cut']):>8}  ({found['backing']} labels, effective "
                  f"{found['effective']:.0f}, {found['unlabelled']} unlabelled)")
    print(f"({embedded:.1f} s to embed, {elapsed:.1f} s in all)")
    mask = np.zeros(learned.lookups)
    mask[learned.right_hits] = 1.0
    mask_1 = np.zeros(learned.lookups)
    if oracle_1 is not None:
        mask_1[oracle_1.right_hits] = 1.0
    return {
        "n": learned.lookups,
        "hit_rate": round(learned.hit_rate, 4),
        "false_hit_rate": round(learned.false_hit_rate, 4),
        "explorations": learned.explorations,
        "exploration_share": round(learned.explorations / max(learned.lookups, 1), 4),
        "labels": learned.labels,
        "demoted": learned.demoted,
        "stored": learned.stored,
        "outcomes": learned.outcomes,
        "estimated": {k: round(v, 2) for k, v in learned.estimated.items()},
        "ranked_hit_rate_at_1pct": round(learned.ranked_hit_rate(0.01), 4),
        "untaught_hit_rate": round(untaught.hit_rate, 4),
        "untaught_false_hit_rate": round(untaught.false_hit_rate, 4),
        "day_one_hit_rate": None if day_one is None else round(day_one.hit_rate, 4),
        "day_one_false_hit_rate": None if day_one is None else round(day_one.false_hit_rate, 4),
        "verifier_hit_rate": None if verified is None else round(verified.hit_rate, 4),
        "verifier_false_hit_rate": None if verified is None else round(verified.false_hit_rate, 4),
        "verifier_oracle_hit_rate_at_1pct": None if verifier_1 is None else round(verifier_1[0], 4),
        "oracle_hit_rate": round(oracle_hit, 4),
        "oracle_threshold": float(oracle_cut),
        "ratio_to_oracle": None if ratio is None else round(ratio, 3),
        "oracle_hit_rate_at_target": round(oracle_target_hit, 4),
        "oracle_hit_rate_at_1pct": round(oracle_1_hit, 4),
        "oracle_threshold_at_1pct": float(oracle_1_cut),
        "static_hit_rate": round(static.hit_rate, 4),
        "static_false_hit_rate": round(static.false_hit_rate, 4),
        "static_threshold": shipped,
        "target_false_hit_rate": target,
        "embedder": emb.version,
        "signal": "verifier" if use_verifier else "cosine",
        "seed": seed,
        "oracle_threshold_at_target": float(oracle_target_cut),
        "replay_threshold": None if replay_cut is None else round(replay_cut, 4),
        "replay_threshold_at_target": None if replay_target_cut is None else round(replay_target_cut, 4),
        "log": None if log is None else str(args.log),
        "tune": tuned,
        "day_one": windows,
        "_pair": (mask, mask_1),
    }


#: The `edgecache tune` variants run on a --stream --log run: (per, confidence, target: "target" or "learner", the
#: learner's own false-hit rate, as the oracle_threshold's), and whether labels are weighted by their stratum.
TUNE_VARIANTS = {
    "lookup_point@learner": ("lookup", 0.0, "learner", True),
    "lookup_point@target": ("lookup", 0.0, "target", True),
    "lookup_95@target": ("lookup", 0.95, "target", True),
    "served_point@target": ("served", 0.0, "target", True),
    "served_95@target": ("served", 0.95, "target", True),
    "plain_lookup_point@learner": ("lookup", 0.0, "learner", False),
    "plain_lookup_point@target": ("lookup", 0.0, "target", False),
    "plain_served_point@target": ("served", 0.0, "target", False),
}


def tune_log(path: Path, *, target: float, learner_rate: float) -> dict[str, dict]:
    """What `edgecache tune PATH --target-error T [--per P] [--confidence C]` finds on the log (the pooled row;
    ``plain_``: every label counted once, the replay without weighing audits up for the hits they stand for)."""
    from edgecache.semantic.decision_log import read_records
    from edgecache.semantic.tuning import ALL, tune

    records = list(read_records(path))
    out = {}
    for name, (per, confidence, at, weigh) in TUNE_VARIANTS.items():
        goal = learner_rate if at == "learner" else target
        [found] = [c for c in tune(records, target=goal, confidence=confidence, per=per, weigh=weigh)  # type: ignore[arg-type]
                   if c.tenant == ALL]
        out[name] = {"cut": None if found.cut is None else round(found.cut, 4), "backing": found.backing,
                     "effective": round(found.effective, 1), "unlabelled": found.unlabelled}
    return out


def _cut(cut: float | None) -> str:
    return "-" if cut is None else f"{cut:.4f}"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--pairs", type=Path)
    src.add_argument("--intents", type=Path)
    p.add_argument("--scenario", default="default", help="whose target false-hit rate (cpu profile) to use")
    p.add_argument("--profile", default="cpu", help="the profile whose scenarios and semantic settings apply")
    p.add_argument("--decision", choices=("threshold", "verifier"), help="default: the profile's semantic.decision")
    p.add_argument("--threshold", type=float, help="the threshold rule at this cosine (top-1, guard veto)")
    p.add_argument("--target", type=float, help="override the scenario's target false-hit rate")
    p.add_argument("--verifier", type=Path, help="a verifier parameter file (default: the shipped one)")
    p.add_argument("--embedder", default=None, help="registered embedder name (default: the profile's)")
    p.add_argument("--candidates", type=int, help="nearest candidates the verifier sees (default: the profile's)")
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-intent", type=int, default=3)
    p.add_argument("--splits", help="intents JSON lines: keep only these splits (comma-separated)")
    p.add_argument("--half", type=int, choices=(0, 1), help="use one half of a seeded split (pairs protocol)")
    p.add_argument("--rules", default=",".join(guard.DEFAULT_RULES),
                   help="guard rules of the --threshold rule, comma-separated, or 'none'")
    p.add_argument("--latency-lookups", type=int, default=200)
    p.add_argument("--stream", action="store_true",
                   help="the online learner on a stream against a growing cache (see stream_of)")
    p.add_argument("--signal", choices=("cosine", "verifier"), default="cosine",
                   help="--stream: what the learner sees of a candidate: the cosine, as the server's learner does, or "
                        "the verifier's score taken as a calibrated probability (its prior)")
    p.add_argument("--seeds", help="--stream: comma-separated seeds, one stream each (default: --seed)")
    p.add_argument("--sample-per-intent", type=int, metavar="N",
                   help="--stream --intents: keep a seeded sample of N texts per intent (every out-of-scope one), "
                        "the shape of a held-out split (banking77 test: 40, CLINC150 test: 30)")
    p.add_argument("--sample-seed", type=int, default=0, help="--sample-per-intent: which sample")
    p.add_argument("--verifier-oracle", action="store_true",
                   help="--stream: also the best cut on the verifier's score at <= 1 %% false hits, with hindsight "
                        "(day one's ceiling; 201 more runs of the stream)")
    p.add_argument("--store", choices=STORE_RULES, default="every_miss",
                   help="--stream: what a refused lookup stores (every miss, or only when its candidate was wrong)")
    p.add_argument("--learner", action="append", metavar="KEY=VALUE",
                   help="--stream: a learner setting (repeatable): " + ", ".join(LEARNER_OPTIONS))
    p.add_argument("--embed-cache", default=str(Path(tempfile.gettempdir()) / "edgecache-eval-embeddings"),
                   help="--stream: folder of embedded texts kept between runs ('none': embed every run)")
    p.add_argument("--link", action=argparse.BooleanOptionalAction, default=True,
                   help="--stream: an entry stored after a right label shares labels with its candidate")
    p.add_argument("--explore-share", type=float, default=0.05, help="--stream: the learner's exploration budget")
    p.add_argument("--oracle-from", type=float, default=0.5, help="--stream: lowest cosine cut the oracle tries")
    p.add_argument("--audit-share", type=float, default=None,
                   help="--stream: the share of confident serves the learner audits (default: the learner's)")
    p.add_argument("--log", type=Path, metavar="DIR",
                   help="--stream: write the learner's run to DIR as a decision log (`edgecache tune DIR` reads it)")
    p.add_argument("--oracle-step", type=float, default=0.005, help="--stream: the oracle's cut step")
    p.add_argument("--teach", type=Path, metavar="FILE",
                   help="--stream --intents: an intent set (the --intents format) whose intents are groups a tenant "
                        "taught before the stream: cached and taught to the learner first; the JSON gains day_one")
    p.add_argument("--split", choices=("text", "intent"),
                   help="--intents: cut the set in two instead (split_intents) and write TEACH_OUT and STREAM_OUT")
    p.add_argument("--split-share", type=float, default=0.5, help="--split: the share taught")
    p.add_argument("--split-seed", type=int, default=0, help="--split: which cut")
    p.add_argument("--split-out", nargs=2, type=Path, metavar=("TEACH_OUT", "STREAM_OUT"),
                   help="--split: the two files written")
    p.add_argument("--day-one-prior", metavar="FILES",
                   help="--stream: comma-separated labelled data files; the untaught learner is also run with the worst "
                        "case of their P(wrong | cosine) as its prior (day_one_prior)")
    args = p.parse_args(argv)
    if args.split is not None:
        if args.intents is None or args.split_out is None:
            raise SystemExit("error: --split takes --intents and --split-out TEACH_OUT STREAM_OUT")
        teach, rest = split_intents(read_intents(args.intents, set(args.splits.split(",")) if args.splits else None),
                                    by=args.split, share=args.split_share, seed=args.split_seed)
        for out, items in zip(args.split_out, (teach, rest)):
            write_intents(out, items)
        result = {"teach": len(teach), "stream": len(rest), "teach_file": str(args.split_out[0]),
                  "stream_file": str(args.split_out[1])}
        print(json.dumps(result))
        return result
    if args.teach is not None and (not args.stream or args.intents is None or args.signal != "cosine"):
        raise SystemExit("error: --teach takes --stream --intents (and the cosine signal)")
    if args.stream:
        return stream_main(args, *(("pairs", args.pairs) if args.pairs is not None else ("intents", args.intents)))
    rules = [] if args.rules == "none" else [r for r in args.rules.split(",") if r]

    settings = resolve_settings(args.profile, {}, environ={})
    scenario = settings.scenarios.get(args.scenario) or settings.scenarios["default"]
    decision = args.decision or settings.semantic.decision
    threshold = args.threshold if args.threshold is not None else scenario.threshold
    target = args.target if args.target is not None else scenario.target_false_hit_rate
    k = args.candidates or settings.semantic.candidates
    emb = load_embedder(args.embedder or settings.semantic.embedder, threads=1)
    verifier = Verifier.load(args.verifier or settings.semantic.verifier_params)
    use_verifier = decision == "verifier" and threshold is None and verifier.embedder == emb.version
    if threshold is None and not use_verifier:
        threshold = default_threshold(emb.version, args.scenario)  # as the server does

    t0 = time.perf_counter()
    kind, path = ("pairs", args.pairs) if args.pairs is not None else ("intents", args.intents)
    splits = set(args.splits.split(",")) if args.splits else None
    cases = load_cases(kind, path, emb, k=k if use_verifier else 1, seed=args.seed, limit=args.limit,
                       half=args.half, per_intent=args.per_intent, splits=splits)
    elapsed = time.perf_counter() - t0

    pos = np.array([c.positive for c in cases])
    oos = np.array([c.oos for c in cases])
    n_pos = int(pos.sum())
    if use_verifier:
        ours_sim, ours_ok = verifier_decisions(verifier, cases)
        served = ours_sim >= np.array([verifier.cut(target, c.query) for c in cases]) - 1e-12
        sweep = np.round(np.arange(0.0, 1.0005, 0.001), 3)
    else:
        ours_sim, ours_ok = threshold_decisions(cases, rules)
        served = ours_sim >= threshold - 1e-9
        sweep = np.round(np.arange(0.0, 1.0005, 0.001), 3)
    base_sim, base_ok = cosine_decisions(cases)
    cos_sweep = np.round(np.arange(0.0, 1.0005, 0.001), 3)
    hit_rate = float((served & ours_ok).sum() / max(n_pos, 1))
    false_hit_rate = float((served & ~ours_ok).sum() / max(len(cases), 1))
    oos_hit_rate = float((served & oos).sum() / oos.sum()) if oos.any() else None
    ours = rates(ours_sim, ours_ok, n_pos, sweep)
    base = rates(base_sim, base_ok, n_pos, cos_sweep)
    ours_1, ours_t1 = best_at(*ours, sweep, 0.01)
    base_1, base_t1 = best_at(*base, cos_sweep, 0.01)
    latencies = measure_latency(cases, emb, verifier if use_verifier else None, k if use_verifier else 1,
                                args.latency_lookups, target or 0.0)
    p50 = float(np.percentile(latencies, 50)) if latencies else None
    p99 = float(np.percentile(latencies, 99)) if latencies else None

    rule = f"verifier, target {target:.2%}, {k} candidates" if use_verifier else f"cosine >= {threshold:.3f} + guard"
    print(f"embedder {emb.version}  lookups {len(pos)} ({n_pos} with a right answer)  ours: {rule}")
    print(f"{'':28}{'ours':>16}{'plain cosine':>16}")
    print(f"{'at the defaults: hit rate':28}{hit_rate:16.3f}")
    print(f"{'at the defaults: false hits':28}{false_hit_rate:16.4f}")
    if oos_hit_rate is not None:
        print(f"{'at the defaults: oos hits':28}{oos_hit_rate:16.4f}")
    print(f"{'best hit rate, FHR<=1%':28}{ours_1:16.3f}{base_1:16.3f}   (cut {ours_t1:.3f} / cosine {base_t1:.3f})")
    if p50 is not None:
        print(f"lookup p50 {p50:.2f} ms  p99 {p99:.2f} ms  ({len(latencies)} lookups one at a time, "
              f"second stage 0 %)   ({elapsed:.1f} s)")
    result = {
        "n": len(pos),
        "hit_rate": round(hit_rate, 4),
        "false_hit_rate": round(false_hit_rate, 4),
        "threshold": threshold,
        "embedder": emb.version,
        "hit_rate_at_1pct": round(ours_1, 4),
        "baseline_hit_rate_at_1pct": round(base_1, 4),
        "baseline_threshold_at_1pct": base_t1,
        "oos_hit_rate": None if oos_hit_rate is None else round(oos_hit_rate, 4),
        "target_false_hit_rate": target if use_verifier else None,
        "candidates": k if use_verifier else 1,
        "lookup_p50_ms": None if p50 is None else round(p50, 3),
        "lookup_p99_ms": None if p99 is None else round(p99, 3),
        "second_stage_share": 0.0,
    }
    print(json.dumps(result))
    return result
