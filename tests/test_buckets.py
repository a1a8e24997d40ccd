"""Buckets for sampled requests (:mod:`edgecache.buckets`) over HTTP with the fake engine and the real stores (disk
and Redis): a bucket of N reaches the engine N times, then serves its answers; the header, the defaults, the
policies, the ledger, and what never enters a bucket."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from edgecache import buckets
from edgecache.engines.base import GenerationRequest
from edgecache.http.app import create_app
from edgecache.stores import CachedAnswer
from edgecache.runtime import Runtime
from edgecache.settings import Settings
from tests.conftest import chat_body, serve_in_process, until
from tests.fakes import FakeEngine
from tests.test_anthropic_api import assert_anthropic_error, messages_body
from tests.test_app import assert_openai_error, sse_events, sse_text

CHAT = "/v1/chat/completions"


class SamplingEngine(FakeEngine):
    """Every answer is a new sample: it carries the engine call's number (and the tenant, so a leak shows). It
    takes ``n`` (a bucket's fills ask for one answer each; a request for more than its bucket keeps is computed)."""

    features = frozenset({"n"})
    samples = 0

    def answer_for(self, request: GenerationRequest) -> str:
        self.samples += 1
        return f"<{request.salt}> sample {self.samples} of " + super().answer_for(request)


def sampled(content: str, **extra: Any) -> dict[str, Any]:
    """A chat body that samples without a seed: no temperature, as Codex and Claude Code send."""
    body = chat_body(content, **extra)
    del body["temperature"]
    return body


def bucket(size: int | str) -> dict[str, str]:
    return {"X-EdgeCache-Bucket-Size": str(size)}


def runtime_of(c: httpx.AsyncClient) -> Runtime:
    return c.app.state.runtime  # type: ignore[attr-defined, no-any-return]


def text(resp: httpx.Response) -> str:
    return str(resp.json()["choices"][0]["message"]["content"])


async def settled(c: httpx.AsyncClient) -> None:
    """Until every flight has stored its answer (a client has its answer a moment before the write ends)."""
    rt = runtime_of(c)
    await until(lambda: not len(rt.inflight), "the flights to end")


async def fill(c: httpx.AsyncClient, content: str, size: int, headers: dict[str, str] | None = None,
               **extra: Any) -> dict[int, str]:
    """``size`` requests, one after another: each a miss that fills the next slot. Slot number -> its answer."""
    filled: dict[int, str] = {}
    for i in range(size):
        resp = await c.post(CHAT, json=sampled(content, **extra), headers={**bucket(size), **(headers or {})})
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-edgecache"] == "miss" and resp.headers["x-edgecache-bucket"] == f"{i + 1}/{size}"
        filled[i] = text(resp)
        await settled(c)
    assert len(set(filled.values())) == size, "each fill is a new sample"
    return filled


def slots_of(resp: httpx.Response) -> list[int]:
    """The slots an answer came from, numbered from 0 (the X-EdgeCache-Bucket header counts from 1)."""
    served, _ = resp.headers["x-edgecache-bucket"].split("/")
    return [int(s) - 1 for s in served.split(",")]


@pytest.fixture
def engine() -> SamplingEngine:
    return SamplingEngine()


@pytest.fixture
async def client(make_settings: Callable[..., Settings], engine: SamplingEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with serve_in_process(create_app(make_settings(), engine=engine)) as c:
        yield c


# ---- the pure parts ----


def answer(text: str, created_at: float = 1.0, expires_at: float = 100.0, tokens: int = 3) -> CachedAnswer:
    return CachedAnswer(text=text, finish_reason="stop", prompt_tokens=7, completion_tokens=tokens,
                        created_at=created_at, expires_at=expires_at)


def test_draw_takes_free_slots_first_then_running_fills_then_stored_answers() -> None:
    rng = random.Random(7)
    stored = {0: answer("a"), 3: answer("d")}
    assert buckets.draw(5, 1, stored, set(), rng=rng) == buckets.Draw(lead=[1], follow=[], serve=[])
    assert buckets.draw(5, 3, stored, {1}, rng=rng) == buckets.Draw(lead=[2, 4], follow=[1], serve=[])
    every = buckets.draw(5, 5, stored, {1, 2}, rng=rng)
    assert every.lead == [4] and sorted(every.follow) == [1, 2] and sorted(every.serve) == [0, 3]
    # A slot stored and still in the table (its flight ends after the write) is stored, never followed.
    assert buckets.draw(2, 2, {0: answer("a"), 1: answer("b")}, {1}, rng=rng).follow == []


def test_a_full_bucket_is_a_uniform_draw_without_repeats() -> None:
    rng = random.Random(11)
    stored = {i: answer(str(i)) for i in range(4)}
    seen: dict[tuple[int, ...], int] = {}
    for _ in range(2000):
        drawn = buckets.draw(4, 2, stored, set(), rng=rng)
        assert drawn.lead == drawn.follow == [] and len(set(drawn.serve)) == 2
        seen[tuple(drawn.serve)] = seen.get(tuple(drawn.serve), 0) + 1
    assert len(seen) == 12  # every ordered pair of 4 slots
    assert min(seen.values()) > 2000 / 12 / 2


def test_no_cache_fills_slots_anew_and_follows_nothing() -> None:
    rng = random.Random(3)
    stored = {i: answer(str(i)) for i in range(3)}
    drawn = buckets.draw(3, 2, stored, {0}, read=False, rng=rng)
    assert drawn.follow == drawn.serve == [] and sorted(drawn.lead) in ([1, 2],)
    everything = buckets.draw(3, 3, stored, {0}, read=False, rng=rng)
    assert sorted(everything.lead) == [0, 1, 2]


def test_the_label_and_the_combined_answer() -> None:
    assert buckets.label([2], 5) == "3/5" and buckets.label([2, 0], 5) == "3,1/5"
    one = answer("one")
    assert buckets.combined([one]) is one
    both = buckets.combined([answer("x", created_at=5.0, expires_at=50.0, tokens=4),
                             answer("y", created_at=2.0, expires_at=80.0, tokens=6)])
    assert [(c.index, c.text) for c in both.choices or ()] == [(0, "x"), (1, "y")]
    assert (both.text, both.completion_tokens, both.prompt_tokens) == ("x", 10, 7)
    assert (both.created_at, both.expires_at) == (2.0, 50.0)


def test_slots_are_keyed_by_the_request_with_one_answer() -> None:
    request = GenerationRequest(prompt="hi", n=3)
    keys = buckets.slot_keys(request, 3, model_version="v", tenant="t", scenario="s")
    assert keys == buckets.slot_keys(GenerationRequest(prompt="hi"), 3, model_version="v", tenant="t", scenario="s")
    assert len(set(keys)) == 3 and all(k.endswith(f".b{i}") for i, k in enumerate(keys))
    assert keys != buckets.slot_keys(request, 3, model_version="v", tenant="u", scenario="s")


# ---- over HTTP ----


async def test_a_bucket_of_n_reaches_the_engine_n_times_then_never(client: httpx.AsyncClient,
                                                                  engine: SamplingEngine) -> None:
    filled = await fill(client, "Write me a haiku", 3)
    assert engine.calls == 3
    served_slots: set[int] = set()
    for _ in range(40):
        resp = await client.post(CHAT, json=sampled("Write me a haiku"), headers=bucket(3))
        assert resp.headers["x-edgecache"] == "exact", resp.headers
        (slot,) = slots_of(resp)
        assert text(resp) == filled[slot]
        served_slots.add(slot)
    assert engine.calls == 3
    assert served_slots == {0, 1, 2}  # a miss of one slot in 40 draws: (2/3)^40, about 1e-7
    # Fills are engine calls spent on misses, under their own reason; every serve from the bucket is saved.
    row = runtime_of(client).ledger.report()["by_tenant_scenario"]["default/default"]
    assert row["spent"]["miss"]["calls"] == 3 and row["miss_reasons"] == {"bucket_filling": 3}
    assert row["requests"] == {"miss": 3, "exact": 40}
    assert row["saved"]["exact"]["completion_tokens"] > 0


async def test_a_stream_replays_a_bucket_answer(client: httpx.AsyncClient, engine: SamplingEngine) -> None:
    filled = await fill(client, "Tell a story", 2)
    resp = await client.post(CHAT, json=sampled("Tell a story", stream=True), headers=bucket(2))
    assert resp.headers["x-edgecache"] == "exact" and resp.headers["content-type"].startswith("text/event-stream")
    (slot,) = slots_of(resp)
    assert sse_text(sse_events(resp.text)) == filled[slot]
    # A fill streams too, live, and its answer lands in the bucket whole.
    fresh = await client.post(CHAT, json=sampled("Another story", stream=True), headers=bucket(1))
    assert fresh.headers["x-edgecache"] == "miss"
    await settled(client)
    again = await client.post(CHAT, json=sampled("Another story"), headers=bucket(1))
    assert again.headers["x-edgecache"] == "exact" and text(again) == sse_text(sse_events(fresh.text))
    assert engine.calls == 3


async def test_n_draws_different_answers_from_a_full_bucket(client: httpx.AsyncClient,
                                                            engine: SamplingEngine) -> None:
    filled = await fill(client, "Name a colour", 3)
    for _ in range(10):
        resp = await client.post(CHAT, json=sampled("Name a colour", n=2), headers=bucket(3))
        assert resp.headers["x-edgecache"] == "exact"
        slots = slots_of(resp)
        assert len(set(slots)) == 2
        choices = resp.json()["choices"]
        assert [c["message"]["content"] for c in choices] == [filled[s] for s in slots]
        assert [c["index"] for c in choices] == [0, 1]
    assert engine.calls == 3
    # More answers than the bucket keeps: computed, as without a bucket.
    over = await client.post(CHAT, json=sampled("Name a colour", n=4), headers=bucket(3))
    assert over.headers["x-edgecache"] == "miss" and "x-edgecache-bucket" not in over.headers
    assert engine.calls == 4


async def test_n_fills_one_slot_per_answer_while_the_bucket_fills(client: httpx.AsyncClient,
                                                                  engine: SamplingEngine) -> None:
    resp = await client.post(CHAT, json=sampled("Pick a number", n=2), headers=bucket(3))
    assert resp.headers["x-edgecache"] == "miss" and resp.headers["x-edgecache-bucket"] == "1,2/3"
    first = [c["message"]["content"] for c in resp.json()["choices"]]
    assert len(set(first)) == 2 and engine.calls == 2
    assert all(r.n == 1 for r in engine.requests)  # each fill asks for one answer
    await settled(client)
    # One slot free: it is filled, and the other choice is one of the stored two.
    second = await client.post(CHAT, json=sampled("Pick a number", n=2), headers=bucket(3))
    assert second.headers["x-edgecache"] == "miss" and slots_of(second)[0] == 2
    assert second.json()["choices"][1]["message"]["content"] in first
    assert engine.calls == 3
    await settled(client)
    full = await client.post(CHAT, json=sampled("Pick a number", n=3), headers=bucket(3))
    assert full.headers["x-edgecache"] == "exact" and engine.calls == 3


async def test_concurrent_requests_each_fill_a_slot_then_follow(make_settings: Callable[..., Settings]) -> None:
    """While a bucket fills, identical requests are not joined onto one engine call: the first N each lead a fill;
    those past N follow one of the running fills."""
    engine = SamplingEngine()
    engine.gate = asyncio.Event()
    async with serve_in_process(create_app(make_settings(), engine=engine)) as c:
        rt = runtime_of(c)
        pending = [asyncio.create_task(c.post(CHAT, json=sampled("Same question"), headers=bucket(3)))
                   for _ in range(5)]
        await until(lambda: engine.calls >= 1, "the first fill to reach the engine")
        keys = buckets.slot_keys(engine.requests[0], 3, model_version=engine.version, tenant="default",
                                 scenario="default")

        def listening() -> int:
            return sum(flight.listeners for key in keys if (flight := rt.inflight.get(key)) is not None)

        # Three fills lead (the profile's admission runs two at once; the third waits its turn), five listen.
        await until(lambda: len(rt.inflight) == 3 and listening() == 5, "five requests on three fills")
        engine.gate.set()
        replies = await asyncio.gather(*pending)
        assert engine.calls == 3
        served = sorted(r.headers["x-edgecache"] for r in replies)
        assert served == ["miss", "miss", "miss", "shared", "shared"]
        led = {slots_of(r)[0]: text(r) for r in replies if r.headers["x-edgecache"] == "miss"}
        assert sorted(led) == [0, 1, 2] and len(set(led.values())) == 3
        for r in replies:
            assert text(r) == led[slots_of(r)[0]]
        await settled(c)
        assert (await c.post(CHAT, json=sampled("Same question"), headers=bucket(3))).headers["x-edgecache"] \
            == "exact"
        assert engine.calls == 3


async def test_errors_and_partial_answers_never_enter_a_bucket(make_settings: Callable[..., Settings]) -> None:
    engine = SamplingEngine(fail_after=1)
    async with serve_in_process(create_app(make_settings(), engine=engine)) as c:
        failed = await c.post(CHAT, json=sampled("Break"), headers=bucket(1))
        assert failed.status_code >= 500 and "error" in failed.json()
        streamed = await c.post(CHAT, json=sampled("Break", stream=True), headers=bucket(1))
        assert streamed.status_code == 200 and '"error"' in streamed.text  # the first chunk went out, then the error
        await settled(c)
        engine.fail_after = None
        calls = engine.calls
        assert (await c.post(CHAT, json=sampled("Break"), headers=bucket(1))).headers["x-edgecache"] == "miss"
        await settled(c)
        assert (await c.post(CHAT, json=sampled("Break"), headers=bucket(1))).headers["x-edgecache"] == "exact"
        assert engine.calls == calls + 1


async def test_an_evicted_slot_is_filled_again(client: httpx.AsyncClient, engine: SamplingEngine) -> None:
    await fill(client, "Evict me", 2)
    rt = runtime_of(client)
    keys = buckets.slot_keys(engine.requests[-1], 2, model_version=engine.version, tenant="default",
                             scenario="default")
    assert await rt.stores("default").delete(keys[1])
    refill = await client.post(CHAT, json=sampled("Evict me"), headers=bucket(2))
    assert refill.headers["x-edgecache"] == "miss" and refill.headers["x-edgecache-bucket"] == "2/2"
    await settled(client)
    assert (await client.post(CHAT, json=sampled("Evict me"), headers=bucket(2))).headers["x-edgecache"] == "exact"
    assert engine.calls == 3


async def test_a_bad_bucket_size_is_a_400_in_the_apis_shape(client: httpx.AsyncClient,
                                                            engine: SamplingEngine) -> None:
    for value in ("21", "-1", "abc", "2.5", "", "1e1", "0x3"):
        resp = await client.post(CHAT, json=sampled("hello"), headers=bucket(value))
        error = assert_openai_error(resp, 400)
        assert error["param"] == "X-EdgeCache-Bucket-Size", error
    twice = await client.post(CHAT, json=sampled("hello"),
                              headers=[("X-EdgeCache-Bucket-Size", "2"), ("X-EdgeCache-Bucket-Size", "3")])
    assert_openai_error(twice, 400)
    body = await client.post(CHAT, json=sampled("hello", edgecache={"bucket_size": 21}))
    assert_openai_error(body, 400)
    messages = await client.post("/v1/messages", json={**messages_body("hello"), "temperature": 1},
                                 headers=bucket("99"))
    assert "X-EdgeCache-Bucket-Size" in assert_anthropic_error(messages, 400, "invalid_request_error")
    assert engine.calls == 0


async def test_no_bucket_is_todays_behaviour(client: httpx.AsyncClient, engine: SamplingEngine) -> None:
    for headers in ({}, bucket(0)):
        for _ in range(2):
            resp = await client.post(CHAT, json=sampled("no bucket"), headers=headers)
            assert resp.headers["x-edgecache"] == "miss" and "x-edgecache-bucket" not in resp.headers
    assert engine.calls == 4
    # A greedy or seeded request is cached as always: the bucket size has nothing to do with it.
    for body in (chat_body("greedy"), sampled("seeded", seed=5)):
        first = await client.post(CHAT, json=body, headers=bucket(3))
        await settled(client)
        second = await client.post(CHAT, json=body, headers=bucket(3))
        assert (first.headers["x-edgecache"], second.headers["x-edgecache"]) == ("miss", "exact")
        assert "x-edgecache-bucket" not in second.headers
    assert engine.calls == 6


def write_tenants(path: Path) -> Path:
    path.write_text('[plans.agents]\nbucket_size = 2\n\n[plans.plain]\n\n'
                    '[[tenants]]\nid = "acme"\nplan = "agents"\nkeys = ["sk-acme-bucket-01"]\n\n'
                    '[[tenants]]\nid = "globex"\nplan = "plain"\nkeys = ["sk-globex-bucket-01"]\n')
    return path


ACME = {"Authorization": "Bearer sk-acme-bucket-01"}
GLOBEX = {"Authorization": "Bearer sk-globex-bucket-01"}


async def test_the_plans_and_the_scenarios_default_and_the_header_overrides(
        make_settings: Callable[..., Settings], tmp_path: Path) -> None:
    engine = SamplingEngine()
    settings = make_settings(tenants_file=str(write_tenants(tmp_path / "tenants.toml")),
                             scenarios={"default": {}, "chat": {"bucket_size": 1}, "none": {"bucket_size": 0}})
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        async def ask(headers: dict[str, str], content: str = "plan default", **extra: Any) -> httpx.Response:
            resp = await c.post(CHAT, json=sampled(content, **extra), headers=headers)
            assert resp.status_code == 200, resp.text
            await settled(c)
            return resp

        # acme's plan keeps 2 answers: two fills, then served from them.
        assert [(await ask(ACME)).headers["x-edgecache-bucket"] for _ in range(2)] == ["1/2", "2/2"]
        assert (await ask(ACME)).headers["x-edgecache"] == "exact"
        # globex's plan keeps none: today's behaviour; and tenants never share a bucket.
        for _ in range(2):
            plain = await ask(GLOBEX)
            assert plain.headers["x-edgecache"] == "miss" and text(plain).startswith("<globex>")
        assert engine.calls == 4
        # A scenario's size is over the plan's; the header is over both; 0 asks for none.
        assert (await ask({**GLOBEX, "X-EdgeCache-Scenario": "chat"})).headers["x-edgecache-bucket"] == "1/1"
        assert (await ask({**GLOBEX, "X-EdgeCache-Scenario": "chat"})).headers["x-edgecache"] == "exact"
        assert (await ask({**ACME, "X-EdgeCache-Scenario": "none"}, "scenario none")).headers["x-edgecache"] == "miss"
        assert (await ask({**ACME, "X-EdgeCache-Scenario": "none"}, "scenario none")).headers["x-edgecache"] == "miss"
        assert (await ask({**ACME, **bucket(0)}, "header zero")).headers["x-edgecache"] == "miss"
        assert (await ask({**ACME, **bucket(0)}, "header zero")).headers["x-edgecache"] == "miss"
        assert (await ask({**GLOBEX, **bucket(1)}, "header one")).headers["x-edgecache"] == "miss"
        assert (await ask({**GLOBEX, **bucket(1)}, "header one")).headers["x-edgecache"] == "exact"
        # The body's edgecache.bucket_size, under the header.
        assert (await ask(GLOBEX, "body one", edgecache={"bucket_size": 1})).headers["x-edgecache"] == "miss"
        assert (await ask(GLOBEX, "body one", edgecache={"bucket_size": 1})).headers["x-edgecache"] == "exact"


async def test_reuse_is_over_the_defaults_and_the_header_over_reuse(
        make_settings: Callable[..., Settings], tmp_path: Path) -> None:
    engine = SamplingEngine()
    settings = make_settings(tenants_file=str(write_tenants(tmp_path / "tenants.toml")))
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        reuse = {**ACME, "X-EdgeCache-Policy": "reuse"}
        first = await c.post(CHAT, json=sampled("frozen"), headers=reuse)
        await settled(c)
        second = await c.post(CHAT, json=sampled("frozen"), headers=reuse)
        assert (first.headers["x-edgecache"], second.headers["x-edgecache"]) == ("miss", "exact")
        assert "x-edgecache-bucket" not in second.headers and text(first) == text(second)
        over = {**reuse, **bucket(2)}
        assert (await c.post(CHAT, json=sampled("frozen"), headers=over)).headers["x-edgecache-bucket"] == "1/2"
        assert engine.calls == 2


async def test_policies_with_a_bucket(client: httpx.AsyncClient, engine: SamplingEngine) -> None:
    def ask(policy: str, size: int = 2) -> Any:
        return client.post(CHAT, json=sampled("policies"), headers={**bucket(size), "X-EdgeCache-Policy": policy})

    only = await ask("only-if-cached")
    assert only.status_code == 504 and engine.calls == 0
    kept_nowhere = await ask("no-store")
    assert kept_nowhere.headers["x-edgecache"] == "miss"
    await settled(client)
    assert (await ask("only-if-cached")).status_code == 504
    filled = await fill(client, "policies", 2)
    assert (await ask("only-if-cached")).headers["x-edgecache"] == "exact"
    assert (await ask("no-store")).headers["x-edgecache"] == "exact"
    bypassed = await ask("bypass")
    assert bypassed.headers["x-edgecache"] == "miss" and "x-edgecache-bucket" not in bypassed.headers
    # no-cache refreshes one slot: a new sample replaces a stored one, and the bucket still holds two.
    refreshed = await ask("no-cache")
    assert refreshed.headers["x-edgecache"] == "miss"
    await settled(client)
    slot = slots_of(refreshed)[0]
    filled[slot] = text(refreshed)
    for _ in range(6):
        resp = await ask("default")
        assert resp.headers["x-edgecache"] == "exact" and text(resp) == filled[slots_of(resp)[0]]
    assert engine.calls == 5  # no-store, two fills, bypass, no-cache


async def test_a_bucket_in_redis(make_settings: Callable[..., Settings], tmp_path: Path, redis_url: str) -> None:
    """The same on the Redis store, and shared by two nodes: the second node serves the first node's bucket."""
    engines = [SamplingEngine(), SamplingEngine()]
    apps = [create_app(make_settings(data_dir=str(tmp_path / f"node{i}"), store__backend="redis",
                                     store__redis_url=redis_url, store__redis_timeout_s=5.0), engine=engine)
            for i, engine in enumerate(engines)]
    async with serve_in_process(apps[0]) as a, serve_in_process(apps[1]) as b:
        filled = await fill(a, "In redis", 2)
        for node in (b, a, b):
            resp = await node.post(CHAT, json=sampled("In redis"), headers=bucket(2))
            assert resp.headers["x-edgecache"] == "exact" and text(resp) == filled[slots_of(resp)[0]]
        assert [e.calls for e in engines] == [2, 0]
        # A larger bucket extends it: the two slots stand, one more is filled (on the other node).
        more = await b.post(CHAT, json=sampled("In redis"), headers=bucket(3))
        assert more.headers["x-edgecache-bucket"] == "3/3" and [e.calls for e in engines] == [2, 1]


async def test_only_if_cached_follows_a_running_fill(make_settings: Callable[..., Settings]) -> None:
    """Following a fill costs no engine work, so only-if-cached takes it: a bucket of one being filled is followed."""
    engine = SamplingEngine()
    engine.gate = asyncio.Event()
    async with serve_in_process(create_app(make_settings(), engine=engine)) as c:
        filling = asyncio.create_task(c.post(CHAT, json=sampled("Follow me"), headers=bucket(1)))
        await until(lambda: engine.calls == 1, "the fill to reach the engine")
        follower = asyncio.create_task(c.post(CHAT, json=sampled("Follow me"),
                                              headers={**bucket(1), "X-EdgeCache-Policy": "only-if-cached"}))
        keys = buckets.slot_keys(engine.requests[0], 1, model_version=engine.version, tenant="default",
                                 scenario="default")
        await until(lambda: (flight := runtime_of(c).inflight.get(keys[0])) is not None and flight.listeners == 2,
                    "the follower to join the fill")
        engine.gate.set()
        led, followed = await filling, await follower
        assert (led.headers["x-edgecache"], followed.headers["x-edgecache"]) == ("miss", "shared")
        assert text(led) == text(followed) and engine.calls == 1
