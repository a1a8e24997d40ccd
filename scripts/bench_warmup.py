"""Warmup speed: answered lines per second through `edgecache warmup --data-dir` (the offline road), measured side
by side in one run.

1. --lines answered first-turn chat lines (4 system prompts, distinct user texts), batched (the shipped road), with
   the semantic layer on (each line embedded and indexed) and with it off (result store only).
2. The first --compare-lines of them one line at a time (batch size 1: a commit, an embedding call and an index
   insert per line, as before batching), for the ratio.

Real parts: the cpu profile's engine (llama.cpp, SmolLM2-135M, for the system-prompt prefills), its embedder and
usearch, diskcache; temp data dirs, removed at the end.

  python scripts/bench_warmup.py --lines 100000 --compare-lines 3000
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

from rich.console import Console

import edgecache.warmup
from edgecache.cli.warmup import warm_offline
from edgecache.settings import resolve_settings

SYSTEMS = ["You are the support assistant of ACME Rockets.", "You answer billing questions for ACME.",
           "You are a helpful assistant.", "你是 ACME 的客服助手。"]
VERBS = ["reset", "change", "cancel", "renew", "update", "verify", "close", "transfer", "find", "recover"]
THINGS = ["password", "order", "subscription", "invoice", "address", "card", "account", "delivery", "refund",
          "warranty", "plan", "email"]
FORMS = ["How do I {v} my {t}?", "Can I {v} the {t} online?", "What happens if I {v} my {t} twice?",
         "我怎么{v}我的{t}", "Where can I {v} my {t} number {n}?"]


def write_lines(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            text = rng.choice(FORMS).format(v=rng.choice(VERBS), t=rng.choice(THINGS), n=i) + f" (ref {i})"
            line = {"messages": [{"role": "system", "content": rng.choice(SYSTEMS)},
                                 {"role": "user", "content": text}],
                    "scenario": "support", "answer": f"Answer {i}: go to Settings, then follow the steps."}
            f.write(json.dumps(line, ensure_ascii=False) + "\n")


def run(lines: Path, data_dir: Path, *, semantic: bool, batch: int) -> tuple[float, int]:
    settings = resolve_settings("cpu", {"data_dir": str(data_dir), "semantic.enabled": semantic}, environ={})
    edgecache.warmup.ANSWERED_BATCH = batch
    summary = warm_offline(lines, settings, None, Console(file=open("/dev/null", "w"), stderr=False))  # noqa: SIM115
    assert summary.failed == 0, summary
    return summary.seconds, summary.written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--compare-lines", type=int, default=3000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-warmup-") as tmp:
        root = Path(tmp)
        full, small = root / "lines.jsonl", root / "small.jsonl"
        write_lines(full, args.lines)
        write_lines(small, args.compare_lines)
        rows = []
        for name, path, semantic, batch in [
            (f"per line, semantic on ({args.compare_lines} lines)", small, True, 1),
            (f"batched, semantic on ({args.compare_lines} lines)", small, True, edgecache.warmup.ANSWERED_BATCH),
            (f"batched, semantic on ({args.lines} lines)", full, True, edgecache.warmup.ANSWERED_BATCH),
            (f"batched, semantic off ({args.lines} lines)", full, False, edgecache.warmup.ANSWERED_BATCH),
        ]:
            seconds, written = run(path, root / f"data-{len(rows)}", semantic=semantic, batch=batch)
            rows.append((name, written, seconds))
            print(f"{name:46} {written:7d} lines in {seconds:7.1f} s = {written / seconds:8.0f} lines/s", flush=True)
        per_line, batched = rows[0][1] / rows[0][2], rows[1][1] / rows[1][2]
        print(f"batched / per line (same {args.compare_lines} lines, semantic on): {batched / per_line:.1f}x")


if __name__ == "__main__":
    main()
