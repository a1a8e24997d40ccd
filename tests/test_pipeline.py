"""The request path with a fake engine and the real store, de-dup table and metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing
from pathlib import Path

import msgspec
import pytest

from edgecache.engines.base import Chunk, GenerationRequest, Message, SamplingParams
from edgecache.errors import EngineError
from edgecache.inflight.local import InflightTable
from edgecache.keys import request_key
from edgecache.metrics import Metrics
from edgecache.call import Call
from edgecache.pipeline import RequestPipeline
from edgecache.admission import AdmissionGate
from edgecache.stores import CachedAnswer
from edgecache.stores.disk import DiskResultStore
from edgecache.warmup import warm
from tests.fakes import FakeEngine


def chat(content: str = "hello", **params: object) -> GenerationRequest:
    sampling = {"temperature": 0.0, "max_tokens": 16, **params}
    return GenerationRequest(messages=(Message("user", content),), params=SamplingParams(**sampling))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[DiskResultStore]:
    s = DiskResultStore(tmp_path / "results", disk_bytes=64 * 2**20, memory_bytes=4 * 2**20)
    yield s
    s.close()


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def pipeline(engine: FakeEngine, store: DiskResultStore) -> RequestPipeline:
    return make_pipeline(engine, store)


def make_pipeline(engine: FakeEngine, store: DiskResultStore) -> RequestPipeline:
    # Every tenant shares this one store here; tenant isolation of stores is tested in test_tenants.py.
    return RequestPipeline(engine=engine, stores=lambda tenant: store, inflight=InflightTable(), metrics=Metrics(),
                           ttl_for=lambda call: 3600.0,
                           admission=AdmissionGate(max_running=64, max_queue=64, queue_timeout_s=5, retry_after_s=1))


async def collect(stream: AsyncIterator[Chunk]) -> list[Chunk]:
    async with aclosing(stream) as s:
        return [c async for c in s]


def text_of(chunks: list[Chunk]) -> str:
    return "".join(c.text for c in chunks)


async def serve_all(pipeline: RequestPipeline, call: Call) -> tuple[str, list[Chunk]]:
    reply = await pipeline.serve(call)
    chunks = await collect(reply.stream())
    # Let the flight finish its store write and leave the table before the next request.
    await pipeline.inflight.drain(timeout_s=5)
    return reply.served, chunks


def key_of(pipeline: RequestPipeline, call: Call) -> str:
    return request_key(call.request, model_version=pipeline.engine.version, tenant=call.tenant,
                       scenario=call.scenario)


async def test_a_miss_then_an_exact_hit_with_the_same_answer(pipeline: RequestPipeline, engine: FakeEngine,
                                                             store: DiskResultStore) -> None:
    call = Call(request=chat("what is 2+2"))
    served, first = await serve_all(pipeline, call)
    assert served == "miss"
    assert text_of(first) == engine.answer_for(call.request)
    assert first[-1].finish_reason == "stop"
    assert engine.calls == 1 and engine.completed == 1

    reply = await pipeline.serve(call)
    assert reply.served == "exact"
    assert reply.answer is not None and reply.answer.text == text_of(first)
    served, second = await serve_all(pipeline, call)
    assert served == "exact"
    assert engine.calls == 1
    assert text_of(second) == text_of(first)
    assert second[-1].finish_reason == first[-1].finish_reason
    assert second[-1].prompt_tokens == first[-1].prompt_tokens
    assert second[-1].completion_tokens == first[-1].completion_tokens
    assert (await store.stats())["entries"] == 1


async def test_an_exact_hit_comes_from_disk_after_the_memory_tier_is_gone(
        tmp_path: Path, engine: FakeEngine) -> None:
    call = Call(request=chat("durable"))
    directory = tmp_path / "results"
    for expected in ("miss", "exact"):
        store = DiskResultStore(directory, disk_bytes=64 * 2**20, memory_bytes=4 * 2**20)
        try:
            p = make_pipeline(engine, store)
            served, chunks = await serve_all(p, call)
            assert served == expected
            assert text_of(chunks) == engine.answer_for(call.request)
        finally:
            store.close()
    assert engine.calls == 1


async def test_concurrent_identical_calls_share_one_engine_call(pipeline: RequestPipeline,
                                                                engine: FakeEngine) -> None:
    engine.gate = asyncio.Event()
    call = Call(request=chat("shared question"))
    replies = [await pipeline.serve(call) for _ in range(5)]
    assert [r.served for r in replies] == ["miss"] + ["shared"] * 4
    consumers = [asyncio.create_task(collect(r.stream())) for r in replies]
    await asyncio.sleep(0)
    engine.gate.set()
    results = await asyncio.gather(*consumers)
    assert engine.calls == 1
    assert all(r == results[0] for r in results)
    assert text_of(results[0]) == engine.answer_for(call.request)


async def test_a_client_that_closes_mid_stream_aborts_the_engine_and_stores_nothing(
        pipeline: RequestPipeline, engine: FakeEngine, store: DiskResultStore) -> None:
    engine.delay_s = 0.005  # chunks arrive one by one, so the client can leave before the end
    call = Call(request=chat("abandoned"))
    key = key_of(pipeline, call)
    reply = await pipeline.serve(call)
    assert reply.served == "miss"
    flight = pipeline.inflight.get(key)
    assert flight is not None

    stream = reply.stream()
    first = await stream.__anext__()
    assert first.text
    await stream.aclose()
    await asyncio.wait([flight.task])

    assert engine.aborted == 1 and engine.completed == 0
    assert pipeline.inflight.get(key) is None
    assert store.get_memory(key) is None
    assert await store.get(key) is None
    assert (await store.stats())["entries"] == 0

    engine.delay_s = 0.0
    served, chunks = await serve_all(pipeline, call)
    assert served == "miss"
    assert engine.calls == 2
    assert text_of(chunks) == engine.answer_for(call.request)


async def test_an_engine_failure_reaches_the_caller_and_stores_nothing(
        pipeline: RequestPipeline, engine: FakeEngine, store: DiskResultStore) -> None:
    engine.fail_after = 2
    call = Call(request=chat("doomed"))
    reply = await pipeline.serve(call)
    with pytest.raises(EngineError):
        await collect(reply.stream())
    await pipeline.inflight.drain(timeout_s=5)
    assert (await store.stats())["entries"] == 0

    engine.fail_after = None
    served, _ = await serve_all(pipeline, call)
    assert served == "miss"
    assert engine.calls == 2


async def test_a_non_cacheable_call_bypasses_the_store_and_de_dup(
        pipeline: RequestPipeline, engine: FakeEngine, store: DiskResultStore) -> None:
    engine.gate = asyncio.Event()
    call = Call(request=chat("write a poem", temperature=0.8))  # sampling, no seed
    replies = [await pipeline.serve(call), await pipeline.serve(call)]
    assert [r.served for r in replies] == ["miss", "miss"]
    consumers = [asyncio.create_task(collect(r.stream())) for r in replies]
    for _ in range(100):
        if engine.running == 2:
            break
        await asyncio.sleep(0)
    assert engine.running == 2  # two engine calls at once: nobody followed anybody
    assert len(pipeline.inflight) == 0
    engine.gate.set()
    results = await asyncio.gather(*consumers)
    assert all(text_of(r) == engine.answer_for(call.request) for r in results)
    assert engine.calls == 2
    assert (await store.stats())["entries"] == 0

    served, _ = await serve_all(pipeline, call)
    assert served == "miss"
    assert engine.calls == 3


async def test_sampling_with_a_seed_is_cached(pipeline: RequestPipeline, engine: FakeEngine) -> None:
    call = Call(request=chat("seeded", temperature=0.8, seed=7))
    assert (await serve_all(pipeline, call))[0] == "miss"
    assert (await serve_all(pipeline, call))[0] == "exact"
    assert engine.calls == 1


async def test_no_hit_across_tenants_scenarios_or_model_versions(pipeline: RequestPipeline,
                                                                engine: FakeEngine) -> None:
    request = chat("the same words")
    base = Call(request=request, tenant="acme", scenario="support")
    assert (await serve_all(pipeline, base))[0] == "miss"
    assert (await serve_all(pipeline, base))[0] == "exact"

    assert (await serve_all(pipeline, Call(request=request, tenant="globex", scenario="support")))[0] == "miss"
    assert (await serve_all(pipeline, Call(request=request, tenant="acme", scenario="code")))[0] == "miss"
    assert engine.calls == 3

    engine.version = "fake@2"  # new weights: every old entry is unreachable
    assert (await serve_all(pipeline, base))[0] == "miss"
    assert engine.calls == 4
    assert (await serve_all(pipeline, base))[0] == "exact"
    assert engine.calls == 4


async def test_no_sharing_of_a_flight_across_tenants(pipeline: RequestPipeline, engine: FakeEngine) -> None:
    engine.gate = asyncio.Event()
    request = chat("concurrent")
    a = await pipeline.serve(Call(request=request, tenant="acme"))
    b = await pipeline.serve(Call(request=request, tenant="globex"))
    assert (a.served, b.served) == ("miss", "miss")
    consumers = [asyncio.create_task(collect(r.stream())) for r in (a, b)]
    await asyncio.sleep(0)
    engine.gate.set()
    await asyncio.gather(*consumers)
    assert engine.calls == 2


async def test_engine_calls_are_counted_in_metrics(pipeline: RequestPipeline) -> None:
    call = Call(request=chat("count me"))
    await serve_all(pipeline, call)
    await serve_all(pipeline, call)  # exact: no engine call
    engine = pipeline.metrics.snapshot()["engine"]
    assert engine["calls"] == 1
    assert engine["prompt_tokens"] == 2


# --- max_tokens out of the key, where decoding is prefix-stable ----------------------------------------------


class WordEngine(FakeEngine):
    """A prefix-stable engine: its answer is ``words`` words (`` w0 w1 ...``) and then the end token, one token
    each, cut at ``max_tokens``; it reports each token's end like the llama.cpp engine: each text chunk its own,
    with the prompt's counts ahead, and the last chunk all of them. ``step``, when set, is awaited before each
    token after the first."""

    prefix_stable = "greedy"

    def __init__(self, words: int = 20, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.words = words
        self.step: asyncio.Event | None = None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        self.calls += 1
        self.requests.append(request)
        if self.gate is not None:
            await self.gate.wait()
        n = min(self.words, request.params.max_tokens)
        pieces = [f" w{i}" for i in range(n)]
        ends = tuple(sum(len(p) for p in pieces[:i + 1]) for i in range(n))
        for i, piece in enumerate(pieces):
            if i and self.step is not None:
                await self.step.wait()
            yield Chunk(text=piece, token_ends=(ends[i],), prompt_tokens=2)
        self.completed += 1
        yield Chunk(finish_reason="stop" if n == self.words else "length", prompt_tokens=2, completion_tokens=n,
                    token_ends=ends)

    async def answer_token_ends(self, texts: list[str]) -> list[tuple[int, ...] | None]:
        """A given answer's tokens: each word with the space before it."""
        out: list[tuple[int, ...] | None] = []
        for text in texts:
            ends, end = [], 0
            for i, word in enumerate(text.split(" ")):
                end += len(word) + (1 if i else 0)
                if word:
                    ends.append(end)
            out.append(tuple(ends))
        return out


def words(n: int) -> str:
    return "".join(f" w{i}" for i in range(n))


async def test_a_smaller_max_tokens_is_served_the_stored_answers_first_tokens(store: DiskResultStore) -> None:
    engine = WordEngine()
    pipeline = make_pipeline(engine, store)
    served, long = await serve_all(pipeline, Call(request=chat("q", max_tokens=12)))
    assert served == "miss" and text_of(long) == words(12) and long[-1].finish_reason == "length"
    for _ in range(2):  # the second from the cut made once
        served, short = await serve_all(pipeline, Call(request=chat("q", max_tokens=5)))
        assert served == "exact"
        assert text_of(short) == words(5)
        assert (short[-1].finish_reason, short[-1].completion_tokens) == ("length", 5)
    assert engine.calls == 1


async def test_an_answer_that_ended_by_itself_serves_larger_max_tokens(store: DiskResultStore) -> None:
    engine = WordEngine(words=4)
    pipeline = make_pipeline(engine, store)
    await serve_all(pipeline, Call(request=chat("q", max_tokens=16)))
    served, chunks = await serve_all(pipeline, Call(request=chat("q", max_tokens=300)))
    assert served == "exact" and text_of(chunks) == words(4)
    assert (chunks[-1].finish_reason, chunks[-1].completion_tokens) == ("stop", 4)
    # Exactly 4: the engine would stop at the limit before the end token, so finish is length.
    served, chunks = await serve_all(pipeline, Call(request=chat("q", max_tokens=4)))
    assert served == "exact" and text_of(chunks) == words(4) and chunks[-1].finish_reason == "length"
    assert engine.calls == 1


async def test_a_larger_max_tokens_than_an_answer_cut_at_its_limit_is_computed_and_replaces_it(
        store: DiskResultStore) -> None:
    engine = WordEngine()
    pipeline = make_pipeline(engine, store)
    await serve_all(pipeline, Call(request=chat("q", max_tokens=4)))
    served, chunks = await serve_all(pipeline, Call(request=chat("q", max_tokens=8)))
    assert served == "miss" and text_of(chunks) == words(8)
    served, chunks = await serve_all(pipeline, Call(request=chat("q", max_tokens=6)))
    assert served == "exact" and text_of(chunks) == words(6)
    assert engine.calls == 2
    assert (await store.stats())["entries"] == 1  # one key for every max_tokens


async def test_other_fields_than_max_tokens_still_split_the_key(store: DiskResultStore) -> None:
    engine = WordEngine()
    pipeline = make_pipeline(engine, store)
    await serve_all(pipeline, Call(request=chat("q", max_tokens=12)))
    served, _ = await serve_all(pipeline, Call(request=chat("q", max_tokens=5, stop=("w9",))))
    assert served == "miss"
    served, _ = await serve_all(pipeline, Call(request=chat("q", max_tokens=5, temperature=0.5, seed=1)))
    assert served == "miss"  # seeded sampling: prefix-stable only on an engine that says "seeded"


async def test_an_engine_without_token_ends_keeps_max_tokens_in_the_key(pipeline: RequestPipeline,
                                                                        engine: FakeEngine) -> None:
    await serve_all(pipeline, Call(request=chat("q", max_tokens=48)))
    served, _ = await serve_all(pipeline, Call(request=chat("q", max_tokens=12)))
    assert served == "miss" and engine.calls == 2


async def test_a_taught_answer_serves_every_max_tokens_and_replaces_a_computed_one(store: DiskResultStore) -> None:
    # A warmup line's answer is counted in the model's tokens: it serves any max_tokens it fits in, cut at the
    # others with finish length, whatever max_tokens the line had. Taught after a computed answer, it replaces it.
    engine = WordEngine(words=3)
    pipeline = make_pipeline(engine, store)
    await serve_all(pipeline, Call(request=chat("q", max_tokens=8)))
    assert await pipeline.store_known_answer(Call(request=chat("q", max_tokens=16)), "the taught answer")
    for max_tokens, text, finish in ((16, "the taught answer", "stop"), (300, "the taught answer", "stop"),
                                     (3, "the taught answer", "length"), (2, "the taught", "length"),
                                     (1, "the", "length")):
        asked = chat("q", max_tokens=max_tokens)
        served, chunks = await serve_all(pipeline, Call(request=asked))
        assert (served, text_of(chunks), chunks[-1].finish_reason) == ("exact", text, finish)
        assert chunks[-1].completion_tokens == min(3, max_tokens)
        # The line's prompt was never counted; served, the answer counts this request's (the engine counts it).
        assert chunks[-1].prompt_tokens == engine.prompt_tokens(asked) > 0
    assert engine.calls == 1
    # Warmed again: already answered, and nothing is written.
    assert (await pipeline.store_known_answers([(Call(request=chat("q", max_tokens=4)), "another")])) == [False]
    served, chunks = await serve_all(pipeline, Call(request=chat("q", max_tokens=50)))
    assert text_of(chunks) == "the taught answer"


class SpellingEngine(WordEngine):
    """A :class:`WordEngine` that records the answers it counts; one with a ``~`` is not spelled back by its
    tokens (None), as a text the model's tokenizer does not round-trip."""

    def __init__(self) -> None:
        super().__init__()
        self.counted: list[str] = []

    async def answer_token_ends(self, texts: list[str]) -> list[tuple[int, ...] | None]:
        self.counted.extend(texts)
        ends = await super().answer_token_ends(texts)
        return [None if "~" in text else found for text, found in zip(texts, ends)]


class CountedStore(DiskResultStore):
    """The disk store, counting its single and batched reads."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, disk_bytes=64 * 2**20, memory_bytes=4 * 2**20)
        self.gets = 0
        self.batched: list[int] = []

    async def get(self, key: str) -> CachedAnswer | None:
        self.gets += 1
        return await super().get(key)

    async def get_many(self, keys: Sequence[str]) -> list[CachedAnswer | None]:
        self.batched.append(len(keys))
        return await super().get_many(keys)


async def test_a_second_warmup_of_the_same_lines_reads_each_store_once(tmp_path: Path) -> None:
    engine = SpellingEngine()
    stores = {tenant: CountedStore(tmp_path / tenant) for tenant in ("t1", "t2")}
    pipeline = RequestPipeline(engine=engine, stores=stores.__getitem__, inflight=InflightTable(), metrics=Metrics(),
                               ttl_for=lambda call: 3600.0,
                               admission=AdmissionGate(max_running=4, max_queue=4, queue_timeout_s=5, retry_after_s=1))
    try:
        lines = [(n, Call(request=chat(f"question {n}", max_tokens=16), tenant="t1"), f"answer {n}")
                 for n in range(1, 401)]
        lines.append((401, Call(request=chat("odd", max_tokens=16), tenant="t1"), "an~answer"))  # under its full key
        first = await warm(pipeline, lines)
        assert [r.outcome for r in first] == ["written"] * 401
        assert len(engine.counted) == 401
        for store in stores.values():
            store.gets, store.batched = 0, []
        engine.counted.clear()
        again = await warm(pipeline, lines)
        assert [r.outcome for r in again] == ["skipped"] * 401
        # One batched read of the lines' keys without max_tokens, no single read per line. Only the line whose
        # tokens do not spell its answer back is counted again (its key is whichever the count says: the full one,
        # read in a second batch).
        assert (stores["t1"].gets, stores["t1"].batched) == (0, [401, 1])
        assert engine.counted == ["an~answer"]
        # Another tenant's same lines are its own: written, in its own store, the first tenant's untouched.
        other = await warm(pipeline, [(n, msgspec.structs.replace(call, tenant="t2"), text)
                                      for n, call, text in lines])
        assert [r.outcome for r in other] == ["written"] * 401
        assert stores["t2"].batched == [401, 1] and stores["t1"].batched == [401, 1]
        assert engine.calls == 0  # no line reached the engine
    finally:
        for store in stores.values():
            store.close()


async def test_a_warmup_counts_the_lines_whose_key_the_count_decides(store: DiskResultStore) -> None:
    engine = SpellingEngine()
    pipeline = make_pipeline(engine, store)
    q = Call(request=chat("q", max_tokens=16))
    assert await pipeline.store_known_answers([(q, "the first answer")]) == [True]  # under the key without max_tokens
    # Another text: counted, its key is the first one's: already answered.
    assert await pipeline.store_known_answers([(q, "a second answer")]) == [False]
    # One the tokens do not spell back: its key is the full one, which holds nothing yet.
    assert await pipeline.store_known_answers([(q, "the third~answer")]) == [True]
    assert engine.counted == ["the first answer", "a second answer", "the third~answer"]
    # Both keys hold an answer now: every text is already answered. Only the one taught under the key without
    # max_tokens is known to be there without counting it.
    assert await pipeline.store_known_answers([(q, "a fourth answer"), (q, "the first answer"),
                                               (q, "the third~answer")]) == [False, False, False]
    assert engine.counted[3:] == ["a fourth answer", "the third~answer"]
    served, chunks = await serve_all(pipeline, Call(request=chat("q", max_tokens=2)))
    assert (served, text_of(chunks)) == ("exact", "the first")  # the taught answer, cut


async def test_a_follower_of_a_smaller_max_tokens_is_cut_from_a_running_leader(store: DiskResultStore) -> None:
    engine = WordEngine()
    engine.step = asyncio.Event()
    pipeline = make_pipeline(engine, store)
    long = await pipeline.serve(Call(request=chat("q", max_tokens=12)))
    stream = long.stream()
    first = await anext(stream)  # the leader's engine call is under way, one token out
    assert first.text == " w0"
    same = await pipeline.serve(Call(request=chat("q", max_tokens=12)))
    short = await pipeline.serve(Call(request=chat("q", max_tokens=5)))
    assert (long.served, same.served, short.served) == ("miss", "shared", "shared")
    engine.step.set()
    short_chunks = await collect(short.stream())
    rest = await collect(stream)
    texts = [text_of([first, *rest]), text_of(await collect(same.stream())), text_of(short_chunks)]
    await pipeline.inflight.drain(timeout_s=5)
    assert texts == [words(12), words(12), words(5)]
    assert (short_chunks[-1].finish_reason, short_chunks[-1].completion_tokens) == ("length", 5)
    assert short_chunks[-1].token_ends == tuple(len(words(i)) for i in range(1, 6))
    assert engine.calls == 1


async def test_a_follower_cut_by_the_leaders_end_when_its_chunks_carry_no_ends(store: DiskResultStore) -> None:
    class EndsAtTheEnd(WordEngine):
        async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
            async for chunk in super().generate(request):
                yield chunk if chunk.finish_reason is not None else Chunk(text=chunk.text)

    engine = EndsAtTheEnd()
    engine.gate = asyncio.Event()
    pipeline = make_pipeline(engine, store)
    long = await pipeline.serve(Call(request=chat("q", max_tokens=12)))
    long_chunks = asyncio.ensure_future(collect(long.stream()))
    await asyncio.sleep(0)  # the leader's producer starts (and is found by max_tokens)
    short = await pipeline.serve(Call(request=chat("q", max_tokens=5)))
    assert short.served == "shared"
    engine.gate.set()
    short_chunks = await collect(short.stream())
    assert text_of(short_chunks) == words(5) and short_chunks[-1].finish_reason == "length"
    assert text_of(await long_chunks) == words(12)
    assert engine.calls == 1


async def test_a_follower_of_a_larger_max_tokens_waits_and_is_served_when_the_leader_ended_by_itself(
        store: DiskResultStore) -> None:
    engine = WordEngine(words=4)
    engine.gate = asyncio.Event()
    pipeline = make_pipeline(engine, store)
    short = await pipeline.serve(Call(request=chat("q", max_tokens=8)))
    short_chunks = asyncio.ensure_future(collect(short.stream()))
    await asyncio.sleep(0)
    larger = asyncio.ensure_future(pipeline.serve(Call(request=chat("q", max_tokens=300))))
    await asyncio.sleep(0.01)
    assert not larger.done()  # it waits for the leader's end
    engine.gate.set()
    reply = await larger
    chunks = await collect(reply.stream())
    assert reply.served == "shared" and text_of(chunks) == words(4) and chunks[-1].finish_reason == "stop"
    assert text_of(await short_chunks) == words(4)
    assert engine.calls == 1


async def test_a_follower_of_a_larger_max_tokens_computes_when_the_leader_was_cut(store: DiskResultStore) -> None:
    engine = WordEngine()
    engine.gate = asyncio.Event()
    pipeline = make_pipeline(engine, store)
    short = await pipeline.serve(Call(request=chat("q", max_tokens=5)))
    short_chunks = asyncio.ensure_future(collect(short.stream()))
    await asyncio.sleep(0)
    larger = asyncio.ensure_future(pipeline.serve(Call(request=chat("q", max_tokens=9))))
    await asyncio.sleep(0.01)
    engine.gate.set()
    reply = await larger
    assert reply.served == "miss" and text_of(await collect(reply.stream())) == words(9)
    assert text_of(await short_chunks) == words(5)
    assert engine.calls == 2


async def test_a_request_with_stop_strings_follows_only_its_own_max_tokens(store: DiskResultStore) -> None:
    engine = WordEngine()
    engine.gate = asyncio.Event()
    pipeline = make_pipeline(engine, store)
    long = await pipeline.serve(Call(request=chat("q", max_tokens=12, stop=("w30",))))
    long_chunks = asyncio.ensure_future(collect(long.stream()))
    await asyncio.sleep(0)
    short = await pipeline.serve(Call(request=chat("q", max_tokens=5, stop=("w30",))))
    assert short.served == "miss"
    engine.gate.set()
    assert text_of(await collect(short.stream())) == words(5)
    assert text_of(await long_chunks) == words(12)
    await pipeline.inflight.drain(timeout_s=5)
    assert engine.calls == 2


async def test_a_semantic_hit_serves_under_the_same_rule(store: DiskResultStore, tmp_path: Path) -> None:
    from edgecache.semantic.cache import SemanticCache
    from edgecache.semantic.embedders import load_embedder
    from edgecache.semantic.index import SemanticIndex
    from edgecache.semantic.lookup import MatchRule

    embedder = load_embedder("use-multilingual")
    index = SemanticIndex(tmp_path / "semantic", dim=embedder.dim, embedder_version=embedder.version)
    semantic = SemanticCache(embedder=embedder, index=index, rule_for=lambda t, s: MatchRule(0.01, threshold=0.9))
    engine = WordEngine()
    pipeline = RequestPipeline(engine=engine, stores=lambda tenant: store, inflight=InflightTable(),
                               metrics=Metrics(), ttl_for=lambda call: 3600.0, semantic=semantic,
                               admission=AdmissionGate(max_running=8, max_queue=8, queue_timeout_s=5,
                                                       retry_after_s=1))
    try:
        original, paraphrase = "How do I reset my password?", "How can I reset my password?"
        assert (await serve_all(pipeline, Call(request=chat(original, max_tokens=12))))[0] == "miss"
        # A larger limit is computed: the answer now ends by itself at 20 tokens, under the same key.
        assert (await serve_all(pipeline, Call(request=chat(original, max_tokens=30))))[0] == "miss"
        # The index's namespace leaves max_tokens out: a paraphrase of a limit nobody asked finds the vector, and
        # the candidate's stored answer, now the 20-token one, serves it cut.
        asked = chat(paraphrase, max_tokens=7)
        served, chunks = await serve_all(pipeline, Call(request=asked))
        assert served == "semantic" and text_of(chunks) == words(7)
        assert (chunks[-1].finish_reason, chunks[-1].completion_tokens) == ("length", 7)
        # Its usage counts its own prompt (the engine counts it), not the candidate's (2 here): what the client sent,
        # and the prefill the ledger says it saved.
        own = engine.prompt_tokens(asked)
        assert own != 2 and (chunks[-1].prompt_tokens, chunks[-1].cached_tokens) == (own, own)
        # Kept whole under the paraphrase's own key: its other limits are exact hits, with its own count too.
        served, chunks = await serve_all(pipeline, Call(request=chat(paraphrase, max_tokens=5)))
        assert served == "exact" and text_of(chunks) == words(5) and chunks[-1].prompt_tokens == own
        served, chunks = await serve_all(pipeline, Call(request=chat(paraphrase, max_tokens=100)))
        assert served == "exact" and text_of(chunks) == words(20) and chunks[-1].finish_reason == "stop"
        assert engine.calls == 2
    finally:
        semantic.close()
