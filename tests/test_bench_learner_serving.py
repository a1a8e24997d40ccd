"""Smoke test of scripts/bench_learner_serving.py: a tiny pairs file through the in-process server in both modes
(the real embedder and index, the script's class-answer engine), and the simulation beside it."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from edgecache.bench import learner_serving
from tests.test_teaching import faq

PAIRS = [
    ("How do I reset my password?", "How can I reset my password?", 1),
    ("How can I reset my password?", "What is the way to reset my password?", 1),
    ("Transfer 20 dollars to Anna", "Transfer 50 dollars to Anna", 0),
    ("What is the weather in Paris today?", "What is the weather like in Paris today?", 1),
    ("How tall is the Eiffel tower?", "How old is the Eiffel tower?", 0),
]


def test_both_modes_through_the_server_score_every_response(tmp_path: Path, capsys: Any) -> None:
    data = tmp_path / "pairs.tsv"
    data.write_text("".join(f"{a}\t{b}\t{label}\n" for a, b, label in PAIRS), encoding="utf-8")
    result = learner_serving.main(["--pairs", str(data), "--scenario", "support", "--progress", "0",
                                   "--feedback", "all"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["n"] == 9  # every distinct text once
    for mode in ("threshold", "learner"):
        # Every response matched to the logged entry that served it, every lookup in the decision log.
        assert result[f"{mode}_inconsistent"] == 0 and result[f"{mode}_unlogged"] == 0
        # Exact labels: a different class answer is labelled wrong, and no label disagrees with the ground truth.
        assert result[f"{mode}_label_errors"] == 0 and result[f"{mode}_labels_bad"] >= 1
        # The client marked every semantic hit, by the truth, through POST /v1/feedback (each mark accepted).
        hits = round(result[f"{mode}_hit_rate"] * result["n"]) + round(result[f"{mode}_false_hit_rate"] * result["n"])
        assert result[f"{mode}_marked_right"] + result[f"{mode}_marked_wrong"] == hits
        assert result[f"{mode}_marked_wrong"] == round(result[f"{mode}_false_hit_rate"] * result["n"])
    # The shipped rule serves the password paraphrases and never the 20/50 dollars pair (the guard).
    assert result["threshold_hit_rate"] > 0 and result["threshold_false_hit_rate"] == 0
    # The untaught learner refuses, and each refused candidate comes back as a label; the guard vetoes the 20/50
    # dollars pair before the learner is asked.
    assert result["learner_labels"] >= 5 and result["learner_vetoed"] >= 1
    assert result["learner_labels_taught"] <= result["learner_labels"]
    assert {"sim_hit_rate", "sim_false_hit_rate", "sim_explorations", "ratio_hit_rate"} <= set(result)



def faq_rows() -> list[tuple[str, str]]:
    """A tenant's FAQ in groups (tests/test_teaching.py's): 129 questions, near questions in other groups."""
    return [(row["messages"][0]["content"], row["group"]) for row in faq()]


STREAM = [("How could I reset my password?", "reset-password"), ("Can I not cancel my order?", "cancel"),
          ("Do you ship to Berlin?", "ship-berlin")]


def test_a_taught_tenant_beside_an_untaught_one(tmp_path: Path, capsys: Any) -> None:
    teach, stream = tmp_path / "teach.csv", tmp_path / "stream.csv"
    for path, rows in ((teach, faq_rows()), (stream, STREAM)):
        with path.open("w", encoding="utf-8", newline="") as f:
            csv.writer(f).writerows([("text", "category"), *rows])
    result = learner_serving.main(["--intents", str(stream), "--teach", str(teach), "--scenario", "support",
                                   "--progress", "0", "--no-simulate"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["n"] == len(STREAM) and result["taught_texts"] == len(faq_rows())
    for mode in ("learner", "taught"):
        assert result[f"{mode}_warmed"] == len(faq_rows())  # both hold the same cache
        assert result[f"{mode}_inconsistent"] == 0 and result[f"{mode}_unlogged"] == 0
    assert result["learner_taught"] == 0 and result["taught_taught"] > 0  # only the grouped warmup teaches
    # The untaught tenant serves no semantic hit; the taught one serves the paraphrase (right), not the minimal pairs.
    assert result["learner_hit_rate"] == 0 and result["learner_false_hit_rate"] == 0
    assert result["taught_hit_rate"] == round(1 / len(STREAM), 4) and result["taught_false_hit_rate"] == 0
    assert result["taught_day_one_hit_rate"] == result["taught_hit_rate"]
