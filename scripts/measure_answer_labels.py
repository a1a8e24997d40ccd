"""How the miss labeler's answer comparison separates right from wrong, with the real CPU engine and embedder.

Pairs from GPTCache's mock data (``../shared/data/gptcache_mock_data.json``, MIT): a query and its rewrite should
get the same answer (positive); a query and another query's origin should not (negative). Each text is answered
once by the engine at temperature 0, and the two answers of a pair are labelled as the server would label a refused
candidate: equality (whitespace aside), else the answers' cosine under the semantic embedder against each bar.
Printed per bar: the share of positive pairs labelled good (labels the cut can learn from) and of negative pairs
labelled good (wrong "good" labels, which would let ``tune`` lower a cut too far). With ``--judge`` the same engine
also judges each pair as ``semantic.label_judge`` would (one token: does the other text's answer serve this
question as its own answer does?), and the judge's good / bad / cannot-tell shares are printed per kind of pair,
its agreement with the truth over all pairs (right verdicts / pairs; "cannot tell" is not right), and its score on
the start-up check the server runs before it trusts a judge (``edgecache.semantic.judge.JUDGE_CHECK``; the bar is
``semantic.label_judge_min_agreement``).

    python scripts/measure_answer_labels.py [--pairs 40] [--max-tokens 48] [--judge] [--data DATA_DIR]
        [--profile cpu] [--model MODEL]

On a GPU box, ``--profile t4 --model MODEL_PATH --judge`` measures the judge of the model the box serves (the one
``semantic.label_judge`` is on for in the GPU profiles); the figures in docs/calibration.md are the CPU model's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np

from edgecache.engines import engine_from_settings
from edgecache.engines.base import GenerationRequest, Message, SamplingParams
from edgecache.semantic.judge import ModelJudgeLabeler, check_judge
from edgecache.semantic.labeling import normalised
from edgecache.semantic.embedders import load_semantic_embedder
from edgecache.settings import resolve_settings

BARS = (0.85, 0.90, 0.93, 0.95, 0.97)
FLOORS = (0.3, 0.4, 0.5, 0.6)


async def answer(engine, text: str, max_tokens: int) -> str:  # type: ignore[no-untyped-def]
    request = GenerationRequest(messages=(Message(role="user", content=text),),
                                params=SamplingParams(temperature=0.0, max_tokens=max_tokens))
    parts = []
    async for chunk in engine.generate(request):
        parts.append(chunk.text)
    return "".join(parts)


async def main_async(args: argparse.Namespace) -> None:
    rows = json.loads((Path(args.data) / "gptcache_mock_data.json").read_text())
    rng = random.Random(args.seed)
    rng.shuffle(rows)
    rows = rows[:args.pairs + 1]
    positives = [(r["origin"], r["similar"]) for r in rows[:args.pairs]]
    negatives = [(rows[i]["similar"], rows[i + 1]["origin"]) for i in range(args.pairs)]
    with tempfile.TemporaryDirectory() as tmp:
        overrides = {"data_dir": tmp} | ({"engine.model": args.model} if args.model else {})
        settings = resolve_settings(args.profile, overrides, environ={})
        engine = engine_from_settings(settings)
        await engine.start()
        texts = sorted({t for pair in positives + negatives for t in pair})
        cache = Path(args.answers) if args.answers else None
        answers = json.loads(cache.read_text()) if cache is not None and cache.is_file() else {}
        started = time.perf_counter()
        for t in texts:
            if t not in answers:
                answers[t] = await answer(engine, t, args.max_tokens)
        print(f"{len(texts)} answers in {time.perf_counter() - started:.0f} s", flush=True)
        if cache is not None:
            cache.write_text(json.dumps(answers))
        verdicts: dict[str, list[bool | None]] = {}
        if args.judge:
            judge = ModelJudgeLabeler(engine.generate)
            started = time.perf_counter()
            for name, pairs in (("positive", positives), ("negative", negatives)):
                # The query is the pair's first text; the cached answer is the other text's, the fresh one its own.
                verdicts[name] = [await judge.label(answers[b], answers[a], GenerationRequest(
                    messages=(Message(role="user", content=a),), params=SamplingParams(temperature=0.0)))
                    for a, b in pairs]
            print(f"{judge.asked} judgements in {time.perf_counter() - started:.0f} s", flush=True)
            check = await check_judge(judge)
        await engine.close()
    embedder = load_semantic_embedder(settings)
    vectors = {t: v for t, v in zip(texts, embedder.embed([answers[t] for t in texts]))}

    def cosine(a: str, b: str) -> float:
        x, y = vectors[a], vectors[b]
        return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y) + 1e-12))

    result: dict[str, object] = {"pairs": args.pairs, "max_tokens": args.max_tokens, "embedder": embedder.version}
    for name, pairs in (("positive", positives), ("negative", negatives)):
        equal = sum(normalised(answers[a]) == normalised(answers[b]) for a, b in pairs)
        cosines = [1.0 if normalised(answers[a]) == normalised(answers[b]) else cosine(a, b) for a, b in pairs]
        result[f"{name}_equal"] = equal / len(pairs)
        result[f"{name}_cosine_median"] = float(np.median(cosines))
        for bar in BARS:
            result[f"{name}_good_at_{bar}"] = sum(c >= bar for c in cosines) / len(pairs)
        for floor in FLOORS:
            result[f"{name}_bad_below_{floor}"] = sum(c < floor for c in cosines) / len(pairs)
        print(f"{name}: equal {equal}/{len(pairs)}, answer cosine quartiles "
              f"{np.percentile(cosines, 25):.3f} / {np.median(cosines):.3f} / {np.percentile(cosines, 75):.3f} "
              f"(max {max(cosines):.3f}); good at "
              + ", ".join(f"{bar}: {sum(c >= bar for c in cosines) / len(pairs):.0%}" for bar in BARS)
              + "; bad below " + ", ".join(f"{f}: {sum(c < f for c in cosines) / len(pairs):.0%}" for f in FLOORS))
    for name, judged in verdicts.items():
        shares = {v: sum(x is v for x in judged) / len(judged) for v in (True, False, None)}
        result[f"{name}_judge_good"], result[f"{name}_judge_bad"] = shares[True], shares[False]
        result[f"{name}_judge_none"] = shares[None]
        print(f"{name}: the model judge says good {shares[True]:.0%}, bad {shares[False]:.0%}, "
              f"cannot tell {shares[None]:.0%}")
    if verdicts:
        right = sum(x is True for x in verdicts["positive"]) + sum(x is False for x in verdicts["negative"])
        total = len(verdicts["positive"]) + len(verdicts["negative"])
        result["judge_agreement"] = right / total
        result["judge_check"] = {"agreement": check.agreement, "wrong_yes": check.wrong_yes,
                                 "cannot_tell": check.cannot_tell, "cases": check.cases}
        print(f"the model judge agrees with the truth on {right}/{total} pairs ({right / total:.0%}); start-up "
              f"check: {check.agreement:.0%} right of {check.cases}, {check.wrong_yes} wrong yes, "
              f"{check.cannot_tell} cannot tell")
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--judge", action="store_true", help="also ask the model for its one-token judgement")
    parser.add_argument("--profile", default="cpu", help="the hardware profile whose engine answers and judges")
    parser.add_argument("--model", default=None, help="the engine's model (a local path), over the profile's")
    parser.add_argument("--answers", default=None, help="A JSON file caching the engine's answers between runs.")
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    args = parser.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
