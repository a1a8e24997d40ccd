"""Labelers: equality for greedy answers, answer embeddings above a high bar, the chain, and the bounded background
labelling of refused candidates."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edgecache.semantic.decision_log import DecisionLog, LabelRecord, read_records
from edgecache.engines.base import GenerationRequest, Message, SamplingParams
from edgecache.semantic.labeling import AnswerEmbeddingLabeler, EqualityLabeler, FirstVerdict, MissLabels
from edgecache.call import Call
from edgecache.semantic.lookup import Lookup, SemanticHit
from edgecache.stores import CachedAnswer


def request(temperature: float = 0.0) -> GenerationRequest:
    return GenerationRequest(messages=(Message(role="user", content="q"),),
                             params=SamplingParams(temperature=temperature))


async def test_equality_at_temperature_zero_ignores_whitespace_and_cannot_tell_otherwise() -> None:
    equal = EqualityLabeler()
    assert await equal.label("Paris is the capital.\n", "  Paris is  the\tcapital. ", request()) is True
    assert await equal.label("Paris.", "Lyon.", request()) is None  # a rewording is not called wrong
    assert await equal.label("Paris.", "Paris.", request(temperature=0.7)) is None  # sampled: no evidence


def fixed_embedder(vectors: dict[str, list[float]]):  # type: ignore[no-untyped-def]
    calls: list[list[str]] = []

    async def embed(texts: Sequence[str]) -> np.ndarray:
        calls.append(list(texts))
        return np.array([vectors[t] for t in texts], dtype=np.float32)

    return embed, calls


async def test_answer_embeddings_label_good_above_the_bar_bad_below_the_floor_else_nothing() -> None:
    embed, calls = fixed_embedder({"a": [1, 0], "near": [0.97, 0.243], "mid": [0.9, 0.436], "far": [0.2, 0.98]})
    labeler = AnswerEmbeddingLabeler(embed, bar=0.95, floor=0.5)
    assert await labeler.label("a", "near", request(0.7)) is True   # cosine 0.97
    assert await labeler.label("a", "mid", request(0.7)) is None    # cosine 0.90: same topic is not enough
    assert await labeler.label("a", "far", request(0.7)) is False   # cosine 0.20: another answer
    assert await labeler.label("a", "a", request(0.7)) is True and len(calls) == 3  # identical: no embedding
    assert await labeler.label("", "a", request()) is None


async def test_the_chain_takes_the_first_labeler_that_can_tell() -> None:
    embed, calls = fixed_embedder({"x y": [1, 0], "z": [0, 1]})  # orthogonal: cosine 0
    chain = FirstVerdict(EqualityLabeler(), AnswerEmbeddingLabeler(embed))
    assert chain.name == "equality+answer-embedding"
    assert await chain.label("x  y", "x y", request()) is True and not calls  # equality decided
    assert await chain.label("x y", "z", request()) is False and calls == [["x y", "z"]]


class Store:
    def __init__(self, answers: dict[str, str]) -> None:
        self.answers = answers
        self.reads = 0

    async def get(self, key: str) -> CachedAnswer | None:
        self.reads += 1
        text = self.answers.get(key)
        return None if text is None else CachedAnswer(text=text, finish_reason="stop", prompt_tokens=1,
                                                      completion_tokens=1, created_at=0.0, expires_at=1e12)


def refused(store_key: str) -> Lookup:
    return Lookup(vector=None, refusal="below_threshold",
                  candidate=SemanticHit(similarity=0.8, store_key=store_key, vector_key=1))


async def test_a_refused_candidate_is_labelled_in_the_background_within_a_bound(tmp_path: Path) -> None:
    store = Store({"k1": "same answer", "k2": "other answer"})
    log = DecisionLog(tmp_path, max_bytes=1 << 20)
    seen: list[tuple[Call, Lookup, str, bool]] = []
    labels = MissLabels(stores=lambda tenant: store, labeler=EqualityLabeler(), decisions=log,  # type: ignore[arg-type]
                        observe=lambda *args: seen.append(args), max_pending=2)
    call = Call(request=request(), tenant="acme", scenario="support")
    first, second = refused("k1"), refused("k2")
    labels.after_miss(call, "d1", first, "same  answer", "n1")
    labels.after_miss(call, "d2", second, "a different answer", "n2")  # equality cannot tell: "unverified"
    labels.after_miss(call, "d3", refused("k1"), "same answer", "n3")          # past max_pending: skipped
    hit = SemanticHit(similarity=0.99, store_key="k1", vector_key=1)
    labels.after_miss(call, "d4", Lookup(vector=None, candidate=hit), "x", "n4")  # served: nothing
    labels.after_miss(call, "d5", Lookup(vector=None), "x", "n5")                            # no candidate
    await labels.drain()
    log.close()
    assert (labels.skipped, labels.labelled, labels.unverified, store.reads) == (1, 1, 1, 2)
    assert sorted((r.id, r.good, r.labeler) for r in read_records(tmp_path) if isinstance(r, LabelRecord)) == \
        [("d1", True, "equality"), ("d2", None, "equality")]
    assert sorted(seen, key=lambda x: x[2]) == [(call, first, "n1", True), (call, second, "n2", None)]


async def test_no_label_starts_while_the_box_is_busy(tmp_path: Path) -> None:
    store = Store({"k1": "same answer"})
    log = DecisionLog(tmp_path, max_bytes=1 << 20)
    busy = [True]
    labels = MissLabels(stores=lambda tenant: store, labeler=EqualityLabeler(), decisions=log,  # type: ignore[arg-type]
                        busy=lambda: busy[0])
    call = Call(request=request(), tenant="acme", scenario="support")
    labels.after_miss(call, "d1", refused("k1"), "same answer", "n1")
    # An exploration is labelled even while busy: its engine call was spent for that label.
    explored = Lookup(vector=None, refusal="explore",
                      candidate=SemanticHit(similarity=0.8, store_key="k1", vector_key=1))
    labels.after_miss(call, "d2", explored, "same answer", "n2")
    busy[0] = False
    labels.after_miss(call, "d3", refused("k1"), "same answer", "n3")
    await labels.drain()
    log.close()
    assert (labels.skipped, labels.labelled, store.reads) == (1, 2, 2)
    assert sorted(r.id for r in read_records(tmp_path)) == ["d2", "d3"]


def test_stats_render_a_labels_table_when_there_are_labels() -> None:
    from edgecache.cli.render import stats_tables
    from edgecache.metrics import Metrics

    metrics = Metrics()
    assert [t.title for t in stats_tables(metrics.snapshot())][-1] == "Result stores"  # no labels: no table
    metrics.observe_label("acme", "support", "refused", False)
    metrics.observe_label("acme", "support", "explore", True)
    metrics.observe_label("acme", "support", "explore", False)
    body = metrics.snapshot()
    figures = body["semantic"]["labels"]["acme/support"]  # type: ignore[index]
    assert (figures["labels"], figures["bad"], figures["served_labels"], figures["false_hit_rate"]) == (3, 2, 2, 0.5)
    assert 0.5 < figures["false_hit_upper_95"] <= 1.0
    table = stats_tables(body)[-1]
    assert table.title.startswith("Semantic labels") and table.row_count == 1
    assert stats_tables(body, tenant="other")[-1].title == "Result stores"
    # The labelling table (box-wide, so not under a tenant filter) comes before the labels table.
    taught = stats_tables(body)[-2]
    assert taught.title == "Semantic labelling (this box)"
    assert [list(column.cells) for column in taught.columns][2] == ["3"]
    assert "Semantic labelling (this box)" not in [t.title for t in stats_tables(body, tenant="acme")]
    assert "edgecache_semantic_false_hit_rate{scenario=\"support\",tenant=\"acme\"} 0.5" in \
        metrics.render().decode()


async def test_the_model_judge_asks_one_token_under_the_tenants_salt_and_reads_yes_or_no() -> None:
    from edgecache.engines.base import Chunk
    from edgecache.semantic.judge import JUDGE_INSTRUCTIONS, ModelJudgeLabeler

    asked: list[GenerationRequest] = []
    replies = iter([" Yes", "no.", "Maybe", "yes"])

    async def generate(req: GenerationRequest):  # type: ignore[no-untyped-def]
        asked.append(req)
        yield Chunk(text=next(replies))
        yield Chunk(finish_reason="length", prompt_tokens=10, completion_tokens=1)

    free = [True]
    judge = ModelJudgeLabeler(generate, may_run=lambda: free[0], max_answer_chars=50)
    question = GenerationRequest(messages=(Message(role="system", content="Be brief."),
                                           Message(role="user", content="How do I reset my password?")),
                                 params=SamplingParams(temperature=0.0), salt="acme")
    verdicts = [await judge.label("Open Settings.", "Open Settings, then Security.", question) for _ in range(3)]
    assert verdicts == [True, False, None]
    first = asked[0]
    assert first.salt == "acme" and first.params.max_tokens == 1 and first.params.temperature == 0.0
    assert first.messages is not None and first.messages[0].content == JUDGE_INSTRUCTIONS
    assert "How do I reset my password?" in first.messages[1].content
    # Bounded whatever the answers' size: each is cut to max_answer_chars.
    await judge.label("x" * 100_000, "y" * 100_000, question)
    body = asked[-1].messages[1].content  # type: ignore[index]
    assert "x" * 50 in body and "x" * 51 not in body and len(body) < 400
    # No free engine slot: it does not ask, and cannot tell.
    free[0] = False
    assert await judge.label("a", "b", question) is None and len(asked) == 4 and judge.asked == 4
    # Nothing to judge without a user question.
    free[0] = True
    assert await judge.label("a", "b", GenerationRequest(prompt="raw")) is None and len(asked) == 4
