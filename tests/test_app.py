"""HTTP behaviour with a fake engine: what served each answer, SSE shape, de-dup, errors, metrics."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from typing import Any

import pytest
import httpx

from edgecache.http.app import create_app
from tests.conftest import chat_body, serve_in_process, wait_ready
from tests.fakes import FakeEngine


def sse_events(text: str) -> list[Any]:
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    frames = [f for f in text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames)
    return [json.loads(f[6:]) for f in frames[:-1]]


def sse_text(events: list[Any]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])


def assert_openai_error(resp: Any, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert {"message", "type", "param", "code"} <= set(body["error"])
    assert "Traceback" not in resp.text
    return body["error"]


async def test_second_identical_request_is_exact(client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    first = await client.post("/v1/chat/completions", json=chat_body("what is 2+2?"))
    second = await client.post("/v1/chat/completions", json=chat_body("what is 2+2?"))
    assert first.headers["x-edgecache"] == "miss"
    assert second.headers["x-edgecache"] == "exact"
    assert first.json()["choices"][0]["message"]["content"] == "answer to: what is 2+2?"
    assert second.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    assert second.json()["id"] != first.json()["id"]
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        second.json()["usage"]["prompt_tokens"]
    assert fake_engine.calls == 1


async def test_streaming_hit_replays_a_valid_sse_stream(client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    stored = (await client.post("/v1/chat/completions", json=chat_body("stream me"))).json()
    resp = await client.post("/v1/chat/completions", json=chat_body("stream me", stream=True,
                                                                    stream_options={"include_usage": True}))
    assert resp.headers["x-edgecache"] == "exact"
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert sse_text(events) == stored["choices"][0]["message"]["content"]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens"] == stored["usage"]["prompt_tokens"]
    assert len({e["id"] for e in events}) == 1
    assert fake_engine.calls == 1


async def test_streaming_miss_streams_deltas_and_is_stored(client: httpx.AsyncClient,
                                                          fake_engine: FakeEngine) -> None:
    fake_engine.delay_s = 0.05  # an engine slower than the relay's batching: its chunks go out as they come
    resp = await client.post("/v1/chat/completions", json=chat_body("fresh", stream=True))
    assert resp.headers["x-edgecache"] == "miss"
    events = sse_events(resp.text)
    assert 1 < len([e for e in events if e["choices"][0]["delta"].get("content")]) <= fake_engine.pieces
    assert sse_text(events) == "answer to: fresh"
    again = await client.post("/v1/chat/completions", json=chat_body("fresh"))
    assert again.headers["x-edgecache"] == "exact"
    assert again.json()["choices"][0]["message"]["content"] == "answer to: fresh"


async def test_stream_flag_and_user_do_not_split_the_key_but_params_do(client: httpx.AsyncClient,
                                                                        fake_engine: FakeEngine) -> None:
    await client.post("/v1/chat/completions", json=chat_body("q"))
    assert (await client.post("/v1/chat/completions", json=chat_body("q", user="bob"))).headers["x-edgecache"] \
        == "exact"
    for variant in ({"max_tokens": 17}, {"seed": 3}, {"stop": ["x"]}, {"top_p": 0.5}):
        resp = await client.post("/v1/chat/completions", json=chat_body("q", **variant))
        assert resp.headers["x-edgecache"] == "miss", variant
    system = {"messages": [{"role": "system", "content": "be terse"}, {"role": "user", "content": "q"}]}
    assert (await client.post("/v1/chat/completions", json=chat_body(**system))).headers["x-edgecache"] == "miss"
    assert fake_engine.calls == 6


async def test_sampling_without_seed_is_never_cached(client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    for _ in range(2):
        resp = await client.post("/v1/chat/completions", json=chat_body("creative", temperature=0.8))
        assert resp.headers["x-edgecache"] == "miss"
    seeded = [await client.post("/v1/chat/completions", json=chat_body("creative", temperature=0.8, seed=7))
              for _ in range(2)]
    assert [r.headers["x-edgecache"] for r in seeded] == ["miss", "exact"]
    assert fake_engine.calls == 3
    assert (await client.get("/stats")).json()["store"]["entries"] == 1


async def test_completions_endpoint(client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    body = {"model": "fake-model", "prompt": "Once upon", "temperature": 0, "max_tokens": 5}
    first = await client.post("/v1/completions", json=body)
    second = await client.post("/v1/completions", json={**body, "stream": True})
    assert first.json()["object"] == "text_completion"
    assert first.json()["choices"][0]["text"] == "answer to: Once upon"
    assert second.headers["x-edgecache"] == "exact"
    events = sse_events(second.text)
    assert "".join(e["choices"][0]["text"] for e in events) == "answer to: Once upon"


async def test_models_and_health(client: httpx.AsyncClient) -> None:
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake-model"
    assert (await client.get("/health")).json()["status"] == "ready"


async def test_health_is_503_while_the_model_loads(make_settings: Any) -> None:
    engine = FakeEngine()
    release = asyncio.Event()

    async def slow_start() -> None:
        await release.wait()

    engine.start = slow_start  # type: ignore[method-assign]
    async with serve_in_process(create_app(make_settings(), engine=engine), ready=False) as c:
        assert (await c.get("/health")).status_code == 503
        assert_openai_error(await c.post("/v1/chat/completions", json=chat_body()), 503)
        release.set()
        await wait_ready(c)
        assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200


@pytest.mark.parametrize(("body", "status", "param"), [
    (b"{not json", 400, None),
    (b"", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"model": "fake-model"}).encode(), 400, None),
    (json.dumps(chat_body(temperature="hot")).encode(), 400, "temperature"),
    (json.dumps(chat_body(max_tokens=0)).encode(), 400, "max_tokens"),
    (json.dumps(chat_body(n=2)).encode(), 400, "n"),
    (json.dumps(chat_body(tools=[{"type": "function"}])).encode(), 400, None),
    (json.dumps({"model": "fake-model", "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400,
     "messages[0].role"),
    (json.dumps(chat_body(model="gpt-9")).encode(), 404, "model"),
])
async def test_bad_requests_get_openai_errors(client: httpx.AsyncClient, body: bytes, status: int,
                                              param: str | None) -> None:
    resp = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    error = assert_openai_error(resp, status)
    if param is not None:
        assert error["param"] == param


async def test_oversized_body_is_413(make_settings: Any, fake_engine: FakeEngine) -> None:
    app = create_app(make_settings(server__max_body_bytes="2KB"), engine=fake_engine)
    async with serve_in_process(app) as c:
        resp = await c.post("/v1/chat/completions", json=chat_body("x" * 5000))
        assert_openai_error(resp, 413)
        assert (await c.post("/v1/chat/completions", json=chat_body("small"))).status_code == 200
    assert fake_engine.calls == 1


async def test_unknown_route_is_openai_404(client: httpx.AsyncClient) -> None:
    assert_openai_error(await client.get("/v1/nothing"), 404)


async def test_fifty_concurrent_identical_requests_make_one_engine_call(client: httpx.AsyncClient,
                                                                        fake_engine: FakeEngine) -> None:
    fake_engine.gate = asyncio.Event()
    rt = client.app.state.runtime

    async def ask(i: int) -> Any:
        return await client.post("/v1/chat/completions", json=chat_body("popular", stream=i % 2 == 0))

    tasks = [asyncio.create_task(ask(i)) for i in range(50)]
    for _ in range(500):  # hold the engine until every request is listening to the one flight
        flights = list(rt.inflight._flights.values())
        if flights and flights[0].listeners == 50:
            break
        await asyncio.sleep(0.01)
    fake_engine.gate.set()
    responses = await asyncio.gather(*tasks)
    assert fake_engine.calls == 1
    served = sorted(r.headers["x-edgecache"] for r in responses)
    assert served.count("miss") == 1 and served.count("shared") == 49
    texts = {sse_text(sse_events(r.text)) if i % 2 == 0 else r.json()["choices"][0]["message"]["content"]
             for i, r in enumerate(responses)}
    assert texts == {"answer to: popular"}


async def test_engine_failure_mid_stream_reaches_every_follower_and_caches_nothing(
        client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    fake_engine.fail_after = 2
    fake_engine.gate = asyncio.Event()
    rt = client.app.state.runtime
    tasks = [asyncio.create_task(client.post("/v1/chat/completions", json=chat_body("doomed", stream=i % 2 == 0)))
             for i in range(6)]
    for _ in range(500):
        flights = list(rt.inflight._flights.values())
        if flights and flights[0].listeners == 6:
            break
        await asyncio.sleep(0.01)
    fake_engine.gate.set()
    responses = await asyncio.gather(*tasks)
    for i, resp in enumerate(responses):
        if i % 2 == 0:  # streaming: the headers went out with the first token; the error arrives as an event
            events = sse_events(resp.text)
            assert events[-1]["error"]["type"] == "engine_error"
            assert not any(e.get("choices") and e["choices"][0].get("finish_reason") for e in events)
        else:
            assert_openai_error(resp, 502)
    assert fake_engine.calls == 1
    fake_engine.fail_after = None
    again = await client.post("/v1/chat/completions", json=chat_body("doomed"))
    assert again.headers["x-edgecache"] == "miss"
    assert fake_engine.calls == 2
    stats = (await client.get("/stats")).json()
    assert stats["requests"]["error"] == 6 and stats["store"]["entries"] == 1


async def test_metrics_and_stats_agree(client: httpx.AsyncClient) -> None:
    await client.post("/v1/chat/completions", json=chat_body("m"))
    await client.post("/v1/chat/completions", json=chat_body("m"))
    text = (await client.get("/metrics")).text
    assert 'edgecache_requests_total{outcome="miss",scenario="default",tenant="default"} 1.0' in text
    assert 'edgecache_requests_total{outcome="exact",scenario="default",tenant="default"} 1.0' in text
    assert "edgecache_engine_calls_total 1.0" in text
    assert 'edgecache_ttft_seconds_bucket{le="+Inf",outcome="exact"} 1.0' in text
    assert "edgecache_engine_prompt_tokens_total" in text and "edgecache_engine_cached_tokens_total" in text
    stats = (await client.get("/stats")).json()
    assert stats["requests"]["miss"] == 1 and stats["requests"]["exact"] == 1
    assert stats["hit_rate"] == pytest.approx(0.5)
    assert stats["engine"]["calls"] == 1
    assert stats["store"]["entries"] == 1 and stats["store"]["bytes"] > 0


async def test_generation_routes_behave_alike_whichever_way_they_are_dispatched(
        client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    """The generation routes go straight to their handlers (DirectRoutes) and every other spelling through
    litestar's router: both answer the same, and the direct path's errors keep each API's shape."""
    direct = await client.post("/v1/chat/completions", json=chat_body("route me"))
    routed = await client.post("/v1/chat/completions/", json=chat_body("route me"))  # litestar's normalisation
    assert (direct.headers["x-edgecache"], routed.headers["x-edgecache"]) == ("miss", "exact")
    assert routed.json()["choices"] == direct.json()["choices"]
    assert fake_engine.calls == 1
    wrong = await client.get("/v1/chat/completions")  # another method on a direct path: litestar's 405
    assert_openai_error(wrong, 405)
    assert "POST" in wrong.headers["allow"]
    assert_openai_error(await client.post("/v1/chat/completions", content=b"{not json"), 400)
    bad = await client.post("/v1/messages", json={"model": "m", "messages": []})  # no max_tokens
    assert bad.status_code == 400 and bad.json()["type"] == "error", bad.text
    assert bad.json()["error"]["type"] == "invalid_request_error"


def _nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


_DEEP_BODIES = [
    ("/v1/chat/completions", ('{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function",'
                              '"function":{"name":"f","parameters":%s}}]}')),
    ("/v1/chat/completions", '{"model":"m","messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":%s}'),
    ("/v1/chat/completions", ('{"model":"m","messages":[{"role":"user","content":"hi"}],"response_format":'
                              '{"type":"json_schema","json_schema":{"name":"x","schema":%s}}}')),
    ("/v1/completions", '{"model":"m","prompt":"hi","metadata":%s}'),
    ("/v1/responses", '{"model":"m","input":"hi","tools":[{"type":"function","name":"f","parameters":%s}]}'),
    ("/v1/messages", ('{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hi"}],"tools":[{"name":"f",'
                      '"input_schema":%s}]}')),
]


@pytest.mark.parametrize(("route", "body"), _DEEP_BODIES)
@pytest.mark.parametrize("depth", [200, 5000])
async def test_a_body_nested_too_deep_is_a_400_in_the_apis_shape(client: httpx.AsyncClient, route: str, body: str,
                                                                 depth: int) -> None:
    resp = await client.post(route, content=(body % _nested(depth)).encode(),
                             headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert "deep" in resp.text and "Traceback" not in resp.text


async def test_a_deep_string_is_no_nesting(client: httpx.AsyncClient) -> None:
    text = "{[" * 3000  # brackets inside a string do not nest anything
    resp = await client.post("/v1/chat/completions", json=chat_body(text))
    assert resp.status_code == 200, resp.text


async def test_response_ids_carry_no_shared_sequence(client: httpx.AsyncClient) -> None:
    """Ids from one counter would tell a tenant how many others were answered between two of its own."""
    ids = [(await client.post("/v1/chat/completions", json=chat_body(f"id {i}"))).json()["id"] for i in range(12)]
    assert len(set(ids)) == len(ids) and all(i.startswith("chatcmpl-") and len(i) == 33 for i in ids)
    tails = [i.removeprefix("chatcmpl-") for i in ids]
    assert all(len(os.path.commonprefix([a, b])) < 6 for a, b in itertools.pairwise(tails))
    assert all(a[-8:] != b[-8:] for a, b in itertools.pairwise(tails))
