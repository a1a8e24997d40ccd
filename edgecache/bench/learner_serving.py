"""``scripts/bench_learner_serving.py``: the online learner measured through the real server, side by side with the shipped static rule, in one run.

``scripts/eval_semantic.py --stream`` simulates the learner on a cosine matrix. This script sends the same stream
through the server itself: the app built by ``create_app`` with its lifespan running, in this process, requests
over httpx's ASGI transport; the real embedder (the profile's, use-multilingual on ``cpu``), the real usearch index,
result store, decision log, guard, admission and label path. Only the engine is scripted (:class:`ClassAnswers`):
at temperature 0 it answers every text of a group of paraphrases with the group's answer (``answer #<group>``) and a
text with no group with an answer of its own, so a cached answer is the right one exactly when it is the same text.

Protocol. Every text of the set once, in the seeded order of ``eval_semantic.stream_of`` (the same ground truth and
``right_answer``), one first-turn chat request at a time with the set's scenario (``X-EdgeCache-Scenario``); before
the next request the flight and any label task have settled. Two modes, each in a fresh data dir, same order:
``semantic.decision = threshold`` (the shipped rule: the scenario's calibrated cosine + the guard) and ``learner``.
Every response is scored: a semantic hit is right or wrong by ``right_answer`` against the cached entry that served
(the decision log names its store key, the index's mapping its text; the answer text is checked to be that entry's);
explorations and labels come from the decision log (cross-checked with ``/metrics``). Rates are shares of all
lookups, as in the stream eval.

Labels. The server labels a refused or explored candidate by comparing its cached answer with the fresh one:
equality first (temperature 0), then the answers' embeddings (True at or above ``semantic.label_answer_bar``, False
below ``semantic.label_answer_floor``, no label between). Equality alone never says "wrong": with the shipped bar
and floor (0.95 / 0.3) two class answers such as ``answer #3`` and ``answer #7`` embed at a cosine of about 0.7:
compared, no verdict (``none``: the label record's ``good`` is null, and the learner counts it as wrong; ``errors``
then counts the right candidates among them). ``--labels exact`` (the default) sets bar and floor to 1.0, so a
different answer is a wrong one: for a deterministic engine whose answers are its classes that is the truth, and the
server's labels are then as good as the simulation's (``label errors`` counts where they are not: a pair the set
labels different within one group). ``--labels shipped`` keeps the profile's bar and floor (and its model judge, off
on ``cpu``).

Feedback. ``--feedback wrong`` (the default) plays an application that knows the truth (the set's labels): after
each semantic hit whose answer is wrong it posts ``POST /v1/feedback`` with the response's id and ``"correct":
false``, as a user's thumbs-down would; ``all`` also marks the right hits right; ``none`` sends nothing. A mark is a
label of the hit's decision (the learner is taught by it, and demotes after its rule); ``marked`` counts the marks
sent, and every one must come back ``demoted`` (wrong) or ``labelled`` (right).

Modes. ``threshold`` (the cosine rule), ``learner``, and ``shipped``: the profile's own ``semantic.decision``,
whatever it is (the shipped default). ``--teach FILE`` (intents, the ``--intents`` format, e.g. a split's taught
part) is a tenant's grouped questions: every mode's server is warmed with them first (``POST /admin/warmup``, each
line with its class's answer), and the stream's lookups are the ``--intents`` texts only. Mode ``taught`` is the
learner warmed with the lines in groups (the taught tenant); ``learner`` the same lines warmed plain (the untaught
tenant holding the same cache). With ``--teach`` the modes default to ``learner,taught`` and the JSON line gains
``<mode>_day_one_hit_rate`` and ``_false_hit_rate`` (the first 1,000 lookups), ``_warmed`` and ``_taught``.

Beside the modes, ``--simulate`` (default on) runs ``eval_semantic.py --stream`` on the same set, limit, seed
and target, so the server's learner can be read against the simulation's figures in the same table.

TTL. The run compresses hours of traffic into minutes, and the profile's TTL tier classifier gives texts that look
realtime 30 s: such answers would expire mid-run (a candidate gone is a miss with no label) while the simulation's
cache never forgets. ``--ttl`` (default a day) sets the scenario's ``ttl_s`` so the cache only grows, as in the
simulation; ``--ttl profile`` keeps the classifier.

The target false-hit rate is the stream eval's (``--target``, default 1 %) for the set's scenario, so the two are
comparable; the profile's own targets (0.5 % for default and knowledge) apply with ``--target profile``.

Last line: one JSON object: set, n, scenario, seed, target, labels, threshold_* and learner_* (hit_rate,
false_hit_rate, explorations, labels, labels_bad, label_errors, demoted, seconds), ratio_hit_rate and
ratio_false_hit_rate (learner / threshold), and sim_* (the simulation's learner and static figures) when simulated.

  python scripts/bench_learner_serving.py --intents DATA/clinc150_train_val.jsonl --splits val,oos_val \\
      --scenario support --limit 1000

(DATA: the data sets' folder, :data:`edgecache.bench.harness.DATA`.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import re
import sqlite3
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec

from edgecache.bench import semantic_eval  # ground truth of the stream: stream_of, right_answer
from edgecache.bench.harness import serve_in_process
from edgecache.bench.semantic_eval import Stream, right_answer, stream_of
from edgecache.engines.base import Chunk, GenerationRequest
from edgecache.http.app import create_app
from edgecache.semantic.decision_log import DecisionRecord, LabelRecord, read_records
from edgecache.settings import resolve_settings

MODES = ("threshold", "learner", "shipped", "taught")
#: Day one: the first lookups (``day_one_*`` in the JSON line).
DAY_ONE = 1000
#: Lines of one warmup send (``POST /admin/warmup``), as ``edgecache warmup`` sends answered lines: a group whole.
WARMUP_SEND = 2048


def answer_of(stream: Stream, i: int) -> str:
    """The right answer of text ``i``: its group's, or its own when no other text shares it."""
    g = stream.group[i]
    return f"answer #{g}" if g >= 0 else f"answer to text {i}, which no other text shares"


class ClassAnswers:
    """A scripted engine: every text of the stream answered with its class's answer (see :func:`answer_of`)."""

    model_id = "bench-model"
    version = "bench-class-answers@1"
    kind = "scripted"
    features: frozenset[str] = frozenset()

    def __init__(self, stream: Stream) -> None:
        self.answers = {text: answer_of(stream, i) for i, text in enumerate(stream.texts)}
        self.calls = 0

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def check_prompt(self, request: GenerationRequest) -> None:
        return None

    async def count_tokens(self, request: GenerationRequest) -> int:
        return len((request.messages[-1].content if request.messages else (request.prompt or "")).split())

    async def flush(self) -> None:
        return None

    async def stats(self) -> dict[str, float | int | str]:
        return {"engine": "class-answers", "calls": self.calls}

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        self.calls += 1
        text = request.messages[-1].content if request.messages else (request.prompt or "")
        answer = self.answers.get(text, f"no class for: {text}")
        yield Chunk(text=answer)
        yield Chunk(finish_reason="stop", prompt_tokens=len(text.split()), completion_tokens=len(answer.split()),
                    cached_tokens=0)


async def settled(runtime: Any) -> None:
    """Until no flight is open and no label task runs (a label teaches the learner before the next lookup)."""
    for _ in range(100_000):
        if runtime.labels is not None:
            await runtime.labels.drain()
        if not len(runtime.inflight):
            return
        await asyncio.sleep(0.001)
    raise RuntimeError("a flight never finished")


class ModeResult(msgspec.Struct):
    lookups: int
    hits: int = 0
    false_hits: int = 0
    explorations: int = 0
    metric_explorations: float = 0.0
    labels: int = 0
    labels_bad: int = 0
    labels_unverified: int = 0  # compared without a verdict (``good`` null): wrong to the learner
    labels_taught: int = 0  # labels of candidates the learner decided (a vetoed candidate's label is not learnt)
    label_errors: int = 0
    unlabelled_wrong: int = 0
    demoted: int = 0
    vetoed: int = 0  # lookups whose nearest candidate the guard refused (never put to the learner)
    inconsistent: int = 0
    unlogged: int = 0
    marked_wrong: int = 0  # feedback marks sent (--feedback)
    marked_right: int = 0
    warmed: int = 0  # taught texts written by the warmup (--teach)
    taught: int = 0  # labels the warmup's groups taught the learner
    day_one_hits: int = 0  # hits and wrong hits over the first DAY_ONE lookups
    day_one_false_hits: int = 0
    seconds: float = 0.0
    oddities: list[str] = msgspec.field(default_factory=list)  # the first few of the above, to look at

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.lookups, 1)

    @property
    def false_hit_rate(self) -> float:
        return self.false_hits / max(self.lookups, 1)


def settings_for(args: argparse.Namespace, decision: str, data_dir: Path, target: float | None) -> Any:
    overrides: dict[str, Any] = {"data_dir": str(data_dir), "semantic.enabled": True}
    if decision != "shipped":
        overrides["semantic.decision"] = decision
    if target is not None:
        overrides[f"scenarios.{args.scenario}.target_false_hit_rate"] = target
    if args.ttl != "profile":
        overrides[f"scenarios.{args.scenario}.ttl_s"] = float(args.ttl)
    if args.labels == "exact":
        overrides["semantic.label_judge"] = False  # the GPU profiles' model judge: this engine cannot judge
        overrides["semantic.label_answer_bar"] = 1.0
        overrides["semantic.label_answer_floor"] = 1.0
    return resolve_settings(args.profile, overrides, environ={})


def _sum_metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


async def warm_taught(client: Any, stream: Stream, scenario: str, *, grouped: bool) -> int:
    """The stream's taught texts (``--teach``) through ``POST /admin/warmup``, each with its class's answer, as the
    requests the stream sends would key them; with ``grouped``, each line names its class as its ``group`` (the
    taught tenant), without, the same lines plain (the untaught tenant holds the same cache). A group's lines go in
    one send, as ``edgecache warmup`` sends them. Returns the lines written."""
    by_group: dict[int, list[int]] = {}
    for j in range(stream.lookups, len(stream.texts)):
        by_group.setdefault(stream.group[j], []).append(j)
    sends: list[list[int]] = [[]]
    for members in by_group.values():
        if sends[-1] and len(sends[-1]) + len(members) > WARMUP_SEND:
            sends.append([])
        sends[-1].extend(members)
    written = 0
    for send in sends:
        lines = [{"line": n + 1, "request": {
            "messages": [{"role": "user", "content": stream.texts[j]}], "scenario": scenario, "temperature": 0,
            "max_tokens": 16, "answer": answer_of(stream, j), **({"group": str(stream.group[j])} if grouped else {})}}
            for n, j in enumerate(send)]
        resp = await client.post("/admin/warmup", json={"lines": lines})
        if resp.status_code != 200:
            raise RuntimeError(f"warmup: {resp.status_code} {resp.text[:300]}")
        written += sum(r["outcome"] == "written" for r in resp.json()["results"])
    return written


async def run_mode(stream: Stream, decision: str, args: argparse.Namespace, data_dir: Path,
                   target: float | None) -> ModeResult:
    """The stream through a fresh server deciding by ``decision``; every response scored."""
    settings = settings_for(args, "learner" if decision == "taught" else decision, data_dir, target)
    engine = ClassAnswers(stream)
    out = ModeResult(lookups=stream.lookups)
    served: list[str] = []
    answers: list[str] = []
    started = time.perf_counter()
    app = create_app(settings, engine=engine)
    async with serve_in_process(app, base_url="http://bench") as client:
        runtime = app.state.runtime
        if runtime.semantic is None:
            why = runtime.semantic_layer.error if runtime.semantic_layer is not None else "off"
            raise RuntimeError(f"the semantic layer did not open: {why}")
        if stream.taught:
            out.warmed = await warm_taught(client, stream, args.scenario, grouped=decision == "taught")
            engine.calls = 0
        for n, text in enumerate(stream.texts[:stream.lookups]):
            body = {"model": engine.model_id, "messages": [{"role": "user", "content": text}], "temperature": 0,
                    "max_tokens": 16}
            resp = await client.post("/v1/chat/completions", json=body,
                                     headers={"x-edgecache-scenario": args.scenario})
            if resp.status_code != 200:
                raise RuntimeError(f"text {n}: {resp.status_code} {resp.text[:300]}")
            served.append(resp.headers["x-edgecache"])
            answers.append(resp.json()["choices"][0]["message"]["content"])
            await settled(runtime)
            if served[-1] == "semantic" and args.feedback != "none":
                # The application knows the truth: a wrong answer gets a thumbs-down (and, with ``all``, a right
                # one a thumbs-up), naming the response's id.
                right = answers[-1] == answer_of(stream, n) and stream.group[n] >= 0
                if args.feedback == "all" or not right:
                    mark = await client.post("/v1/feedback",
                                             json={"response_id": resp.json()["id"], "correct": right})
                    if mark.status_code != 200 or mark.json()["effect"] != ("labelled" if right else "demoted"):
                        raise RuntimeError(f"feedback on text {n}: {mark.status_code} {mark.text[:300]}")
                    out.marked_right += right
                    out.marked_wrong += not right
            if args.progress and (n + 1) % args.progress == 0:
                print(f"  {decision}: {n + 1}/{stream.lookups} ({time.perf_counter() - started:.0f} s)",
                      file=sys.stderr)
        metrics = (await client.get("/metrics")).text
        learned = (await client.get("/stats")).json().get("semantic", {}).get("learner") or {}
        out.metric_explorations = _sum_metric(metrics, "edgecache_semantic_explorations_total")
        out.demoted = int(learned.get("demoted", 0))
        out.taught = sum(int(pool.get("taught", 0)) for pool in (learned.get("pools") or {}).values())
        position = {runtime.decisions.query_hash(text): i for i, text in enumerate(stream.texts)}
        runtime.decisions.flush()
        # Which text each store key was cached for: the index's mapping (read beside the open index: WAL).
        with contextlib.closing(sqlite3.connect(runtime.semantic.index.mapping_path)) as db:
            text_of_key = dict(db.execute("SELECT store_key, text FROM vectors"))
    out.seconds = time.perf_counter() - started

    at = {text: i for i, text in enumerate(stream.texts)}
    decided: dict[int, DecisionRecord] = {}
    label_of: dict[str, bool | None] = {}
    for record in read_records(data_dir / "decisions"):
        if isinstance(record, DecisionRecord) and record.query_hash in position:
            decided[position[record.query_hash]] = record
        elif isinstance(record, LabelRecord):
            label_of[record.id] = record.good

    for i in range(stream.lookups):
        record = decided.get(i)
        j = at.get(text_of_key.get(record.store_key, "")) if record is not None and record.store_key else None
        if served[i] == "semantic":
            if j is None or answers[i] != answer_of(stream, j):
                out.inconsistent += 1  # the answer is not the logged entry's: scored by its text's class alone
                out.oddities.append(f"hit {i} {stream.texts[i]!r} answered {answers[i]!r}; logged entry {j} "
                                    f"{record.store_key if record else None}")
                right = answers[i] == answer_of(stream, i) and stream.group[i] >= 0
            else:
                right = right_answer(stream, i, j)
            out.hits += right
            out.false_hits += not right
            if i < DAY_ONE:
                out.day_one_hits += right
                out.day_one_false_hits += not right
            continue
        if record is None:
            out.unlogged += 1
            continue
        out.explorations += record.decision == "explore"
        out.vetoed += (record.reason or "").startswith("guard:")
        if j is None:
            continue
        truth = right_answer(stream, i, j)
        if record.id not in label_of:
            out.unlabelled_wrong += not truth
            if not truth:
                out.oddities.append(f"unlabelled wrong candidate: {record.decision} {record.reason} {i}->{j}")
            continue
        good = label_of[record.id]
        out.labels += 1
        out.labels_taught += not (record.reason or "").startswith("guard:")
        if good is None:  # compared, could not tell: the learner counts it as wrong
            out.labels_unverified += 1
            out.label_errors += truth
        else:
            out.labels_bad += not good
            out.label_errors += good != truth
    return out


def simulate(args: argparse.Namespace, target: float | None) -> dict[str, Any]:
    """``eval_semantic.py --stream`` on the same set, limit, seed and target (its own printout swallowed)."""
    argv = ["--stream", "--scenario", args.scenario, "--seed", str(args.seed), "--limit", str(args.limit),
            "--profile", args.profile]
    argv += ["--pairs", str(args.pairs)] if args.pairs is not None else ["--intents", str(args.intents)]
    if args.splits:
        argv += ["--splits", args.splits]
    if args.sample_per_intent is not None:
        argv += ["--sample-per-intent", str(args.sample_per_intent), "--sample-seed", str(args.sample_seed)]
    if target is not None:
        argv += ["--target", str(target)]
    if args.teach is not None:
        argv += ["--teach", str(args.teach)]
    with contextlib.redirect_stdout(io.StringIO()):
        return semantic_eval.main(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--pairs", type=Path)
    src.add_argument("--intents", type=Path)
    p.add_argument("--splits", help="intents JSON lines: keep only these splits (comma-separated)")
    p.add_argument("--sample-per-intent", type=int, metavar="N",
                   help="intents: a seeded sample of N texts per intent, as eval_semantic.py --stream takes it")
    p.add_argument("--sample-seed", type=int, default=0, help="--sample-per-intent: which sample")
    p.add_argument("--scenario", default="default", help="the scenario every request names")
    p.add_argument("--profile", default="cpu")
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", default="0.01",
                   help="the scenario's target false-hit rate (default the stream eval's 1 %%), or 'profile'")
    p.add_argument("--ttl", default="86400",
                   help="the scenario's answer TTL in seconds (default a day: the cache only grows, as in the "
                        "simulation), or 'profile' (the TTL tier classifier: 30 s for realtime-looking texts)")
    p.add_argument("--labels", choices=("exact", "shipped"), default="exact",
                   help="exact: a different answer is labelled wrong (bar = floor = 1.0); shipped: the profile's")
    p.add_argument("--teach", type=Path, metavar="FILE",
                   help="intents (the --intents format): a tenant's grouped questions, warmed with their class's "
                        "answer before the stream; mode taught warms them in groups, the other modes without")
    p.add_argument("--modes", default=None,
                   help="comma-separated: threshold, learner, shipped (the profile's own semantic.decision), taught "
                        "(the learner, taught by --teach's groups); default threshold,learner (learner,taught with "
                        "--teach)")
    p.add_argument("--feedback", choices=("wrong", "all", "none"), default="wrong",
                   help="the client marks wrong semantic hits wrong (and with 'all', right ones right)")
    p.add_argument("--simulate", action=argparse.BooleanOptionalAction, default=True,
                   help="also run eval_semantic.py --stream on the same set, limit, seed and target")
    p.add_argument("--progress", type=int, default=500, help="a progress line every N requests (0: none)")
    args = p.parse_args(argv)
    target = None if args.target == "profile" else float(args.target)
    modes = [m for m in (args.modes or ("learner,taught" if args.teach else "threshold,learner")).split(",") if m]
    for mode in modes:
        if mode not in MODES:
            p.error(f"unknown mode {mode!r}")
    if "taught" in modes and (args.teach is None or args.intents is None):
        p.error("mode taught takes --intents and --teach")

    kind, path = ("pairs", args.pairs) if args.pairs is not None else ("intents", args.intents)
    stream = stream_of(kind, path, seed=args.seed, limit=args.limit,
                       splits=set(args.splits.split(",")) if args.splits else None,
                       intent_sample=args.sample_per_intent, sample_seed=args.sample_seed,
                       teach=semantic_eval.read_intents(args.teach) if args.teach is not None else None)
    results: dict[str, ModeResult] = {}
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix=f"bench-learner-{mode}-") as tmp:
            results[mode] = asyncio.run(run_mode(stream, mode, args, Path(tmp) / "data", target))
    sim = simulate(args, target) if args.simulate else None
    shown_target = target if target is not None else \
        resolve_settings(args.profile, {}, environ={}).scenarios[args.scenario].target_false_hit_rate

    print(f"stream {stream.name}: {stream.lookups} first-turn chat requests in seeded order (seed {args.seed}), "
          f"scenario {args.scenario}, target {shown_target:.2%}, labels {args.labels}, feedback {args.feedback}; "
          f"through the server in process (real embedder and index, class-answer engine)")
    print(f"{'':26}{'hit rate':>9}{'false':>8}{'explored':>9}{'labels':>7}{'bad':>5}{'none':>5}{'errors':>7}"
          f"{'demoted':>8}{'vetoed':>7}{'marked':>7}{'s':>6}")
    shipped = resolve_settings(args.profile, {}, environ={}).semantic.decision
    for mode, r in results.items():
        name = f"shipped ({shipped})" if mode == "shipped" else mode
        print(f"{name:26}{r.hit_rate:9.4f}{r.false_hit_rate:8.4f}{r.explorations:9d}{r.labels:7d}{r.labels_bad:5d}"
              f"{r.labels_unverified:5d}"
              f"{r.label_errors:7d}{r.demoted:8d}{r.vetoed:7d}{r.marked_wrong + r.marked_right:7d}{r.seconds:6.0f}")
        if r.inconsistent or r.unlogged or r.explorations != round(r.metric_explorations):
            print(f"  ! {r.inconsistent} answers not the logged entry's, {r.unlogged} lookups not logged, "
                  f"explorations in /metrics {r.metric_explorations:.0f}")
        for oddity in r.oddities[:5]:
            print(f"  ! {oddity}")
    for mode, r in results.items():
        if r.warmed:
            n = max(min(DAY_ONE, r.lookups), 1)
            print(f"  {mode}: {r.warmed} taught texts warmed ({r.taught} labels taught); first {n} lookups: hit rate "
                  f"{r.day_one_hits / n:.4f}, false {r.day_one_false_hits / n:.4f}")
    ratio_hit = ratio_false = None
    if "threshold" in results and "learner" in results:
        th, le = results["threshold"], results["learner"]
        ratio_hit = le.hit_rate / th.hit_rate if th.hit_rate else None
        ratio_false = le.false_hit_rate / th.false_hit_rate if th.false_hit_rate else None
        print(f"{'learner / threshold':26}" + (f"{ratio_hit:9.2f}" if ratio_hit is not None else f"{'n/a':>9}")
              + (f"{ratio_false:8.2f}" if ratio_false is not None else f"{'n/a':>8}"))
    if sim is not None:
        print(f"{'simulation: learner':26}{sim['hit_rate']:9.4f}{sim['false_hit_rate']:8.4f}"
              f"{sim['explorations']:9d}{sim['labels']:7d}{'':5}{'':5}{'':7}{sim['demoted']:8d}")
        print(f"{'simulation: static':26}{sim['static_hit_rate']:9.4f}{sim['static_false_hit_rate']:8.4f}"
              f"   (oracle at the learner's false hits {sim['oracle_hit_rate']:.4f})")
    result: dict[str, Any] = {"set": stream.name, "n": stream.lookups, "taught_texts": stream.taught,
                              "scenario": args.scenario,
                              "seed": args.seed, "target": shown_target, "labels": args.labels,
                              "feedback": args.feedback, "shipped_decision": shipped}
    for mode, r in results.items():
        result.update({
            f"{mode}_hit_rate": round(r.hit_rate, 4), f"{mode}_false_hit_rate": round(r.false_hit_rate, 4),
            f"{mode}_explorations": r.explorations, f"{mode}_labels": r.labels, f"{mode}_labels_bad": r.labels_bad,
            f"{mode}_labels_taught": r.labels_taught, f"{mode}_labels_unverified": r.labels_unverified,
            f"{mode}_label_errors": r.label_errors, f"{mode}_unlabelled_wrong": r.unlabelled_wrong,
            f"{mode}_demoted": r.demoted, f"{mode}_vetoed": r.vetoed, f"{mode}_inconsistent": r.inconsistent,
            f"{mode}_unlogged": r.unlogged, f"{mode}_marked_wrong": r.marked_wrong,
            f"{mode}_marked_right": r.marked_right, f"{mode}_warmed": r.warmed, f"{mode}_taught": r.taught,
            f"{mode}_day_one_hit_rate": round(r.day_one_hits / max(min(DAY_ONE, r.lookups), 1), 4),
            f"{mode}_day_one_false_hit_rate": round(r.day_one_false_hits / max(min(DAY_ONE, r.lookups), 1), 4),
            f"{mode}_seconds": round(r.seconds, 1)})
    result["ratio_hit_rate"] = None if ratio_hit is None else round(ratio_hit, 3)
    result["ratio_false_hit_rate"] = None if ratio_false is None else round(ratio_false, 3)
    if sim is not None:
        result.update({"sim_hit_rate": sim["hit_rate"], "sim_false_hit_rate": sim["false_hit_rate"],
                       "sim_explorations": sim["explorations"], "sim_labels": sim["labels"],
                       "sim_static_hit_rate": sim["static_hit_rate"],
                       "sim_static_false_hit_rate": sim["static_false_hit_rate"],
                       "sim_oracle_hit_rate": sim["oracle_hit_rate"]})
    print(json.dumps(result))
    return result
