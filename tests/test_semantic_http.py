"""The semantic layer through HTTP and the pipeline, with the real embedder (USE multilingual) and index."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from edgecache.http.app import create_app
from edgecache.call import Call
from edgecache.engines.base import GenerationRequest, Message, SamplingParams
from tests.conftest import chat_body, serve_in_process
from tests.fakes import FakeEngine


def ask(content: str, *, system: str | None = None, **extra: Any) -> dict[str, Any]:
    body = chat_body(content, **extra)
    if system is not None:
        body["messages"].insert(0, {"role": "system", "content": system})
    return body


@pytest.fixture
def semantic_settings(make_settings: Any) -> Any:
    # These tests are about the index, the guard and the namespaces under the plain threshold (an explicit opt-in;
    # the learner, the default, is tested in test_learner_serving.py).
    return lambda **kw: make_settings(semantic__enabled=True, semantic__decision="threshold", **kw)


async def post(c: httpx.AsyncClient, body: dict[str, Any], **headers: str) -> httpx.Response:
    resp = await c.post("/v1/chat/completions", json=body, headers=headers)
    assert resp.status_code == 200, resp.text
    return resp


async def settled(c: httpx.AsyncClient) -> None:
    """Wait until no flight is running: a flight indexes its answer's vector after the client has the answer."""
    rt = c.app.state.runtime  # type: ignore[attr-defined]
    for _ in range(500):
        if not len(rt.inflight):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("a flight never finished")


async def test_paraphrase_is_a_semantic_hit(semantic_settings: Any) -> None:
    engine = FakeEngine()
    async with serve_in_process(create_app(semantic_settings(), engine=engine)) as c:
        first = await post(c, ask("How do I reset my password?"))
        await settled(c)
        para = await post(c, ask("How can I reset my password?"))
        assert first.headers["x-edgecache"] == "miss"
        assert para.headers["x-edgecache"] == "semantic"
        assert float(para.headers["x-edgecache-similarity"]) >= 0.975
        assert para.json()["choices"][0]["message"]["content"] == "answer to: How do I reset my password?"
        assert engine.calls == 1
        # The paraphrase now has its own exact entry.
        assert (await post(c, ask("How can I reset my password?"))).headers["x-edgecache"] == "exact"
        streamed = await post(c, ask("How could I reset my password?", stream=True))
        assert streamed.headers["x-edgecache"] in ("semantic", "miss")
        stats = (await c.get("/stats")).json()
        assert stats["requests"]["semantic"] >= 1
        metrics = (await c.get("/metrics")).text
        assert "edgecache_semantic_search_seconds_count" in metrics and "edgecache_embed_seconds_count" in metrics


@pytest.mark.parametrize(("stored", "query", "rule"), [
    ("Is the refund 20 dollars?", "Is the refund 50 dollars?", "numbers"),
    ("What is the weather in Beijing today?", "What is the weather in Shanghai today?", None),
    ("北京的天气怎么样", "上海的天气怎么样", "entities"),
    ("Can I cancel my order?", "Can I not cancel my order?", "negation"),
])
async def test_a_swap_the_answer_depends_on_is_a_miss(semantic_settings: Any, stored: str, query: str,
                                                      rule: str | None) -> None:
    engine = FakeEngine()
    async with serve_in_process(create_app(semantic_settings(), engine=engine)) as c:
        await post(c, ask(stored), **{"X-EdgeCache-Scenario": "support"})  # the loosest threshold (0.85)
        await settled(c)
        resp = await post(c, ask(query), **{"X-EdgeCache-Scenario": "support"})
        assert resp.headers["x-edgecache"] == "miss"
        assert resp.json()["choices"][0]["message"]["content"] == f"answer to: {query}"
        if rule is not None:
            assert f'edgecache_semantic_guard_rejections_total{{rule="{rule}"}} 1.0' in (await c.get("/metrics")).text


async def test_only_first_turns_with_the_same_system_prompt_match(semantic_settings: Any) -> None:
    engine = FakeEngine()
    async with serve_in_process(create_app(semantic_settings(), engine=engine)) as c:
        await post(c, ask("How do I reset my password?", system="You are ACME support."))
        await settled(c)
        other_system = await post(c, ask("How can I reset my password?", system="You are Globex support."))
        assert other_system.headers["x-edgecache"] == "miss"
        later_turn = ask("How can I reset my password?", system="You are ACME support.")
        later_turn["messages"][1:1] = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        assert (await post(c, later_turn)).headers["x-edgecache"] == "miss"
        other_params = await post(c, ask("How can I reset my password?", system="You are ACME support.",
                                         max_tokens=99))
        assert other_params.headers["x-edgecache"] == "miss"
        same = await post(c, ask("How can I reset my password?", system="You are ACME support."))
        assert same.headers["x-edgecache"] == "semantic"


async def test_scenarios_are_separate_and_unknown_ones_are_refused(semantic_settings: Any) -> None:
    async with serve_in_process(create_app(semantic_settings(), engine=FakeEngine())) as c:
        await post(c, ask("How do I reset my password?", edgecache={"scenario": "support"}))
        await settled(c)
        assert (await post(c, ask("How can I reset my password?"))).headers["x-edgecache"] == "miss"
        resp = await post(c, ask("How can I reset my password?"), **{"X-EdgeCache-Scenario": "support"})
        assert resp.headers["x-edgecache"] == "semantic"
        bad = await c.post("/v1/chat/completions", json=ask("x"), headers={"X-EdgeCache-Scenario": "poetry"})
        assert bad.status_code == 400 and "unknown scenario" in bad.json()["error"]["message"]


async def test_expired_answers_never_answer_semantically(semantic_settings: Any) -> None:
    engine = FakeEngine()
    settings = semantic_settings(scenarios={"default": {}, "news": {"ttl_s": 0.3, "threshold": 0.9}})
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        await post(c, ask("How do I reset my password?"), **{"X-EdgeCache-Scenario": "news"})
        await asyncio.sleep(0.5)
        resp = await post(c, ask("How can I reset my password?"), **{"X-EdgeCache-Scenario": "news"})
        assert resp.headers["x-edgecache"] == "miss"
        assert engine.calls == 2
        rt = c.app.state.runtime  # type: ignore[attr-defined]
        for _ in range(200):  # the flight indexes its answer after the client has it
            if not len(rt.inflight):
                break
            await asyncio.sleep(0.01)
        # The dangling vector was dropped; the new answer's vector remains.
        assert sum((await rt.semantic.sizes()).values()) == 1


async def test_index_survives_restart(semantic_settings: Any) -> None:
    settings = semantic_settings()
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        await post(c, ask("How do I reset my password?"))
    engine = FakeEngine()
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        resp = await post(c, ask("How can I reset my password?"))
        assert resp.headers["x-edgecache"] == "semantic"
        assert engine.calls == 0


async def test_tenant_vectors_never_answer_another_tenant(semantic_settings: Any) -> None:
    engine = FakeEngine()
    async with serve_in_process(create_app(semantic_settings(), engine=engine)) as c:
        pipeline = c.app.state.runtime.pipeline  # type: ignore[attr-defined]

        def call(tenant: str, text: str) -> Call:
            return Call(tenant=tenant, request=GenerationRequest(
                messages=(Message("user", text),), params=SamplingParams(temperature=0.0, max_tokens=8)))

        async def answer(tenant: str, text: str) -> tuple[str, str]:
            reply = await pipeline.serve(call(tenant, text))
            chunks = [chunk async for chunk in reply.stream()]
            await settled(c)
            return reply.served, "".join(ch.text for ch in chunks)

        assert (await answer("acme", "How do I reset my password?"))[0] == "miss"
        assert await answer("globex", "How can I reset my password?") == \
            ("miss", "answer to: How can I reset my password?")
        assert (await answer("acme", "How can I reset my password?"))[0] == "semantic"
        assert engine.calls == 2


async def test_embeddings_with_the_openai_sdk_and_an_exact_repeat(semantic_settings: Any) -> None:
    import base64

    import numpy as np
    import openai

    async with serve_in_process(create_app(semantic_settings(), engine=FakeEngine())) as c:
        sdk = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=c)
        models = [m.id async for m in sdk.models.list()]
        assert models == ["fake-model", "use-multilingual"]
        assert (await sdk.models.retrieve("use-multilingual")).id == "use-multilingual"
        first = await sdk.embeddings.with_raw_response.create(model="use-multilingual",
                                                             input=["How do I reset my password?", "你好"])
        again = await sdk.embeddings.with_raw_response.create(model="use-multilingual",
                                                             input=["How do I reset my password?", "你好"])
        assert (first.headers["x-edgecache"], again.headers["x-edgecache"]) == ("miss", "exact")
        vectors = [d.embedding for d in first.parse().data]
        assert [d.embedding for d in again.parse().data] == vectors
        assert len(vectors) == 2 and len(vectors[0]) == 512
        assert abs(float(np.linalg.norm(vectors[0])) - 1.0) < 1e-3
        # float and base64 carry the same float32 vector.
        floats = (await c.post("/v1/embeddings", json={"model": "use-multilingual", "input": "你好",
                                                       "encoding_format": "float"})).json()
        raw = (await c.post("/v1/embeddings", json={"model": "use-multilingual", "input": "你好",
                                                    "encoding_format": "base64"})).json()
        decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
        assert decoded.tolist() == np.asarray(floats["data"][0]["embedding"], dtype="<f4").tolist()
        assert floats["data"][0]["embedding"] == vectors[1]
        for body, param in (({"input": "x", "dimensions": 256}, "dimensions"), ({"input": ""}, "input"),
                            ({"input": [[1, 2]]}, "input"), ({"input": "x", "extra": 1}, "extra")):
            resp = await c.post("/v1/embeddings", json={"model": "use-multilingual", **body})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
        resp = await c.post("/v1/embeddings", json={"model": "text-embedding-3-small", "input": "x"})
        assert resp.status_code == 404
