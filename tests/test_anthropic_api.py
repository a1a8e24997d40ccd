"""Anthropic's Messages API: the anthropic SDK and LangChain's ChatAnthropic against the server.

First with the fake engine in process (the SDK reads every shape; chat and Messages share one key and one engine
call; errors in Anthropic's shape), then end to end against the real `edgecache serve` with the CPU engine."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import pytest

from edgecache.http.app import create_app
from tests.conftest import chat_body, serve_in_process
from tests.fakes import FakeEngine
from tests.real_server import MODEL, Server
from tests.test_tenants import key_of, write_tenants_file


def messages_body(content: str = "hello", **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "fake-model", "max_tokens": 16, "temperature": 0,
                            "messages": [{"role": "user", "content": content}]}
    body.update(extra)
    return body


def sdk_request(content: str = "hello", **extra: Any) -> dict[str, Any]:
    """What the SDK sends for ``messages_body``: since 2.x it has no ``temperature`` argument (newer Claude models
    take none), so it travels in ``extra_body``. Without it the request samples at Anthropic's default temperature
    1, which is not cached without a seed unless the caller asks for reuse."""
    body = messages_body(content, **extra)
    return {"extra_body": {"temperature": body.pop("temperature")}, **body}


def sdk_on(client: httpx.AsyncClient, **kw: Any) -> anthropic.AsyncAnthropic:
    """The SDK on the in-process app (an ASGI transport of httpx2, the HTTP client the SDK is built on)."""
    transport = httpx2.ASGITransport(app=client.app)  # type: ignore[attr-defined]
    return anthropic.AsyncAnthropic(base_url=str(client.base_url), api_key=kw.pop("api_key", "unused"),
                                    http_client=httpx2.AsyncClient(transport=transport), max_retries=0, **kw)


def assert_anthropic_error(resp: httpx.Response, status: int, error_type: str) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert body["error"]["type"] == error_type, body
    assert "Traceback" not in resp.text
    return str(body["error"]["message"])


def anthropic_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """SSE frames as (event name, data); every frame is named, and its data's type is its name."""
    out = []
    for frame in (f for f in text.split("\n\n") if f):
        name_line, data_line = frame.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), frame
        data = json.loads(data_line[6:])
        assert data["type"] == name_line[7:]
        out.append((name_line[7:], data))
    return out


# --- with the fake engine --------------------------------------------------------------------------------------


async def test_create_twice_the_second_is_exact(client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    c = sdk_on(client)
    first = await c.messages.with_raw_response.create(**sdk_request("what is 2+2?"))
    second = await c.messages.with_raw_response.create(**sdk_request("what is 2+2?"))
    assert (first.headers["x-edgecache"], second.headers["x-edgecache"]) == ("miss", "exact")
    a, b = await first.parse(), await second.parse()
    assert a.content[0].type == "text" and a.content[0].text == "answer to: what is 2+2?"
    assert (a.role, a.stop_reason, a.stop_sequence, a.model) == ("assistant", "end_turn", None, "fake-model")
    assert b.content == a.content and a.id.startswith("msg_") and b.id != a.id
    assert a.usage.input_tokens == 3 and a.usage.cache_read_input_tokens == 0 and a.usage.output_tokens == 4
    # A hit computed none of the prompt: all of it was read from the cache.
    assert (b.usage.input_tokens, b.usage.cache_read_input_tokens, b.usage.cache_creation_input_tokens) == (0, 3, 0)
    assert fake_engine.calls == 1


async def test_chat_and_messages_share_one_key_and_one_engine_call(client: httpx.AsyncClient,
                                                                  fake_engine: FakeEngine) -> None:
    chat = await client.post("/v1/chat/completions", json=chat_body(
        "one generation", messages=[{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "one generation"}]))
    assert chat.headers["x-edgecache"] == "miss"
    msg = await client.post("/v1/messages", json=messages_body(
        "one generation", system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        metadata={"user_id": "u-1"}, thinking={"type": "disabled"}))
    assert msg.headers["x-edgecache"] == "exact"
    assert msg.json()["content"] == [{"type": "text", "text": chat.json()["choices"][0]["message"]["content"]}]
    # And the other way round, streamed on both sides.
    first = await client.post("/v1/messages", json=messages_body("the other way", stream=True))
    assert first.headers["x-edgecache"] == "miss"
    again = await client.post("/v1/chat/completions", json=chat_body("the other way", stream=True))
    assert again.headers["x-edgecache"] == "exact"
    assert fake_engine.calls == 2


async def test_concurrent_chat_and_messages_make_one_engine_call(client: httpx.AsyncClient,
                                                                fake_engine: FakeEngine) -> None:
    fake_engine.gate = asyncio.Event()
    tasks = [asyncio.create_task(client.post("/v1/messages", json=messages_body("together", stream=True))),
             asyncio.create_task(client.post("/v1/chat/completions", json=chat_body("together")))]
    for _ in range(500):
        if fake_engine.calls and len(client.app.state.runtime.inflight) == 1:  # type: ignore[attr-defined]
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    fake_engine.gate.set()
    streamed, chat = await asyncio.gather(*tasks)
    assert sorted([streamed.headers["x-edgecache"], chat.headers["x-edgecache"]]) == ["miss", "shared"]
    text = "".join(d["delta"]["text"] for name, d in anthropic_events(streamed.text)
                   if name == "content_block_delta")
    assert text == chat.json()["choices"][0]["message"]["content"]
    assert fake_engine.calls == 1


async def test_the_sdk_streams_a_miss_and_a_hit(client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    c = sdk_on(client)
    for served in ("miss", "exact"):
        async with c.messages.stream(**sdk_request("stream me")) as stream:
            assert stream.response.headers["x-edgecache"] == served
            texts = [t async for t in stream.text_stream]
            final = await stream.get_final_message()
        assert "".join(texts) == final.content[0].text == "answer to: stream me"
        assert final.stop_reason == "end_turn" and final.usage.output_tokens == 4
        assert final.usage.input_tokens + final.usage.cache_read_input_tokens == 2
    assert fake_engine.calls == 1


async def test_the_event_sequence_is_anthropics(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/messages", json=messages_body("events", stream=True))
    assert resp.headers["content-type"].startswith("text/event-stream")
    names = [name for name, _ in anthropic_events(resp.text)]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    events = dict(anthropic_events(resp.text))
    assert events["message_delta"]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events["message_delta"]["usage"]["input_tokens"] == 1


async def test_an_engine_failure_mid_stream_is_an_error_event(make_settings: Any) -> None:
    engine = FakeEngine(fail_after=2)
    async with serve_in_process(create_app(make_settings(), engine=engine)) as c:
        resp = await c.post("/v1/messages", json=messages_body("fail", stream=True))
        events = anthropic_events(resp.text)
        name, data = events[-1]
        assert name == "error" and data["error"]["type"] == "api_error"
        assert "message_stop" not in [n for n, _ in events]
        with pytest.raises(anthropic.APIStatusError):
            async with sdk_on(c).messages.stream(**sdk_request("fail again")) as stream:
                await stream.get_final_message()
        engine.fail_after = None
        # Nothing was cached: the same request computes again.
        assert (await c.post("/v1/messages", json=messages_body("fail"))).headers["x-edgecache"] == "miss"


async def test_tool_use_and_tool_result_reach_the_engine_as_a_chat_would(client: httpx.AsyncClient,
                                                                        fake_engine: FakeEngine) -> None:
    tool = {"name": "get_weather", "description": "Weather", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                                 {"type": "tool_use", "id": "call_1", "name": "get_weather",
                                                  "input": {"city": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                             "content": [{"type": "text", "text": "18 C"}], "is_error": False},
                                            {"type": "text", "text": "Thanks"}]}]
    resp = await client.post("/v1/messages", json=messages_body(messages=history, tools=[tool],
                                                                 tool_choice={"type": "auto"}))
    assert resp.status_code == 400  # the fake engine honours no tools: the field is named, never ignored
    assert resp.json()["error"]["type"] == "invalid_request_error" and "tools" in resp.json()["error"]["message"]
    fake_engine.features = frozenset({"tools", "tool_choice"})
    msg = await client.post("/v1/messages", json=messages_body(messages=history, tools=[tool],
                                                                tool_choice={"type": "auto"}))
    chat = await client.post("/v1/chat/completions", json=chat_body(messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "user", "content": "Thanks"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                 "parameters": tool["input_schema"]}}]))
    assert (msg.headers["x-edgecache"], chat.headers["x-edgecache"]) == ("miss", "exact")
    assert [(m.role, m.content, m.tool_call_id) for m in fake_engine.requests[0].messages or ()] == [
        ("user", "Weather in Paris?", None), ("assistant", "Checking.", None), ("tool", "18 C", "call_1"),
        ("user", "Thanks", None)]
    assert fake_engine.calls == 1


async def test_a_request_shaped_as_claude_codes_is_served(client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    """The fields and headers Claude Code 2.1 sends (its text replaced; 2.1.328's, captured from a real run against
    this server): every one accepted, none in the key. Its tool-search placeholder (``defer_loading``) is not offered
    to the model, as Anthropic leaves a deferred tool out of the context; refusing it had Claude Code retry three
    times and then fall back to a 79 KB body with 21 tools."""
    fake_engine.features = frozenset({"tools", "tool_choice"})
    body = {"model": "fake-model", "max_tokens": 32000, "stream": True,
            "system": [{"type": "text", "text": "You are a CLI agent."},
                       {"type": "text", "text": "Be careful.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "<context>repo</context>"},
                {"type": "text", "text": "Say hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
                {"role": "system", "content": "The date is today."}],
            "tools": [{"name": "Bash", "description": "Run a command", "input_schema": {
                "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
                "properties": {"command": {"type": "string"}}, "required": ["command"],
                "additionalProperties": False}},
                {"name": "DeferredToolPlaceholder", "description": "Reserved placeholder that keeps deferred tool "
                 "loading active; never call this tool.", "input_schema": {"type": "object", "properties": {}},
                 "defer_loading": True}],
            "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
            "thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}
    headers = {"x-api-key": "unused", "anthropic-version": "2023-06-01", "x-app": "cli",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27",
               "X-EdgeCache-Policy": "reuse"}  # it sends no temperature: sampled, so reuse is what caches it
    first = await client.post("/v1/messages?beta=true", json=body, headers=headers)
    assert first.status_code == 200, first.text
    names = [name for name, _ in anthropic_events(first.text)]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    plain = {k: v for k, v in body.items() if k not in ("metadata", "thinking", "output_config", "context_management")}
    plain["tools"] = body["tools"][:1]
    again = await client.post("/v1/messages?beta=true", json=plain, headers=headers)
    assert again.headers["x-edgecache"] == "exact"
    assert [m.role for m in fake_engine.requests[0].messages or ()] == ["system", "user", "system"]
    assert [t.name for t in fake_engine.requests[0].tools] == ["Bash"]
    assert fake_engine.calls == 1


async def test_cache_control_works_on_messages(client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    none = await client.post("/v1/messages", json=messages_body("cc"), headers={"Cache-Control": "only-if-cached"})
    assert "only-if-cached" in assert_anthropic_error(none, 504, "timeout_error")
    assert fake_engine.calls == 0
    assert (await client.post("/v1/messages", json=messages_body("cc"), headers={"Cache-Control": "no-store"})
            ).headers["x-edgecache"] == "miss"
    assert (await client.post("/v1/messages", json=messages_body("cc"))).headers["x-edgecache"] == "miss"
    hit = await client.post("/v1/messages", json=messages_body("cc"), headers={"Cache-Control": "only-if-cached"})
    assert hit.headers["x-edgecache"] == "exact" and int(hit.headers["age"]) >= 0
    refreshed = await client.post("/v1/messages", json=messages_body("cc"), headers={"Cache-Control": "no-cache"})
    assert refreshed.headers["x-edgecache"] == "miss" and fake_engine.calls == 3


async def test_feedback_finds_a_message_by_its_id(client: httpx.AsyncClient) -> None:
    message = (await client.post("/v1/messages", json=messages_body("mark me"))).json()
    marked = await client.post("/v1/feedback", json={"response_id": message["id"], "correct": True})
    assert marked.status_code == 200, marked.text
    unknown = await client.post("/v1/feedback", json={"response_id": "msg_unknown", "correct": True})
    assert unknown.status_code == 404


def test_a_whole_answer_streams_as_blocks_the_sdk_accumulates() -> None:
    """A tool call streams whole: a text block, then the call's arguments as one input_json_delta; the SDK's own
    accumulator (what messages.stream runs) rebuilds the message from the events."""
    from anthropic.lib.streaming._messages import accumulate_event

    from edgecache.engines.base import Choice, ToolCall
    from edgecache.http.anthropic_api import MessageWriter
    from edgecache.http.replies import Counts

    writer = MessageWriter(model="m", message_id="msg_1")
    choice = Choice(index=0, text="Let me look.", finish_reason="tool_calls",
                    tool_calls=(ToolCall(id="call_a", name="get_weather", arguments='{"city": "Paris"}'),))
    events = anthropic_events(writer.sse_whole((choice,), Counts(prompt=10, completion=5, cached=4)).decode())
    assert [name for name, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    snapshot: Any = None
    buffers: dict[int, bytes] = {}
    for name, data in events:
        if name != "ping":
            snapshot = accumulate_event(event=data, current_snapshot=snapshot,  # type: ignore[arg-type]
                                        json_bufs=buffers)
    assert snapshot.stop_reason == "tool_use" and snapshot.id == "msg_1"
    assert snapshot.content[0].text == "Let me look."
    assert (snapshot.content[1].id, snapshot.content[1].input) == ("call_a", {"city": "Paris"})
    assert (snapshot.usage.input_tokens, snapshot.usage.cache_read_input_tokens, snapshot.usage.output_tokens) == \
        (6, 4, 5)


async def test_count_tokens(client: httpx.AsyncClient) -> None:
    c = sdk_on(client)
    count = await c.messages.count_tokens(model="fake-model", system="one two",
                                          messages=[{"role": "user", "content": "three four five"}])
    assert count.input_tokens == 5  # the fake engine counts words
    resp = await client.post("/v1/messages/count_tokens", json={"model": "fake-model", "max_tokens": 5,
                                                                "messages": [{"role": "user", "content": "x"}]})
    assert "max_tokens" in assert_anthropic_error(resp, 400, "invalid_request_error")


@pytest.mark.parametrize(("body", "status", "error_type", "named"), [
    ({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error",
     "max_tokens"),
    (messages_body(max_token=5), 400, "invalid_request_error", "max_token"),
    (messages_body(temperature=1.5), 400, "invalid_request_error", "temperature"),
    (messages_body(max_tokens=0), 400, "invalid_request_error", "max_tokens"),
    (messages_body(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]), 400, "invalid_request_error", "image"),
    (messages_body(tools=[{"type": "web_search_20250305", "name": "web_search", "max_uses": 2}]), 400,
     "invalid_request_error", "web_search_20250305"),
    (messages_body(tools=[{"name": "f", "input_schema": {}, "colour": "red"}]), 400, "invalid_request_error",
     "colour"),
    (messages_body(tool_choice={"type": "any"}), 400, "invalid_request_error", "tools"),
    (messages_body(mcp_servers=[{"type": "url", "url": "https://x", "name": "x"}]), 400, "invalid_request_error",
     "mcp_servers"),
    (messages_body(model="claude-opus-9"), 404, "not_found_error", "claude-opus-9"),
])
async def test_bad_requests_get_anthropic_errors(client: httpx.AsyncClient, body: dict[str, Any], status: int,
                                                 error_type: str, named: str) -> None:
    resp = await client.post("/v1/messages", json=body)
    assert named in assert_anthropic_error(resp, status, error_type)


async def test_the_sdk_raises_its_own_error_for_a_missing_max_tokens(client: httpx.AsyncClient) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        # The SDK insists on max_tokens; extra_body overrides it with null, as a client without it sends none.
        await sdk_on(client).messages.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=1, extra_body={"max_tokens": None})
    assert info.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert info.value.status_code == 400


async def test_other_routes_keep_the_openai_shape(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/chat/completions", json=chat_body(model="claude-opus-9"))
    assert set(resp.json()) == {"error"} and resp.json()["error"]["type"] == "not_found_error"


async def test_413_429_and_503_in_anthropic_shape(make_settings: Any) -> None:
    engine = FakeEngine()
    release = asyncio.Event()
    real_start = engine.start

    async def slow_start() -> None:
        await release.wait()
        await real_start()

    engine.start = slow_start  # type: ignore[method-assign]
    settings = make_settings(server__max_body_bytes="2KB", admission__max_concurrent_misses=1,
                             admission__max_queue=0)
    async with serve_in_process(create_app(settings, engine=engine), ready=False) as c:
        assert_anthropic_error(await c.post("/v1/messages", json=messages_body()), 503, "overloaded_error")
        release.set()
        for _ in range(500):
            if (await c.get("/health")).status_code == 200:
                break
            await asyncio.sleep(0.01)
        assert_anthropic_error(await c.post("/v1/messages", json=messages_body("x" * 5000)), 413,
                               "request_too_large")
        engine.gate = asyncio.Event()
        running = asyncio.create_task(c.post("/v1/messages", json=messages_body("first")))
        for _ in range(500):
            if engine.running:
                break
            await asyncio.sleep(0.01)
        refused = await c.post("/v1/messages", json=messages_body("second"))
        assert_anthropic_error(refused, 429, "rate_limit_error")
        assert refused.headers["retry-after"]
        engine.gate.set()
        assert (await running).status_code == 200


async def test_keys_by_x_api_key_or_bearer(make_settings: Any, tmp_path: Path) -> None:
    tenants = write_tenants_file(tmp_path / "tenants.toml")
    async with serve_in_process(create_app(make_settings(tenants_file=str(tenants)), engine=FakeEngine())) as c:
        assert_anthropic_error(await c.post("/v1/messages", json=messages_body()), 401, "authentication_error")
        unknown = await c.post("/v1/messages", json=messages_body(), headers={"x-api-key": "sk-nope-0000"})
        assert_anthropic_error(unknown, 401, "authentication_error")
        by_sdk = await sdk_on(c, api_key=key_of("t01")).messages.with_raw_response.create(**sdk_request("k"))
        assert by_sdk.headers["x-edgecache"] == "miss"
        bearer = await c.post("/v1/messages", json=messages_body("k"), headers={
            "Authorization": f"Bearer {key_of('t01')}", "anthropic-version": "2023-06-01",
            "anthropic-beta": "prompt-caching-2024-07-31"})
        assert bearer.headers["x-edgecache"] == "exact"  # the same tenant, whichever header names it
        same = await c.post("/v1/messages", json=messages_body("k"), headers={
            "Authorization": f"Bearer {key_of('t01')}", "x-api-key": key_of("t01")})
        assert same.headers["x-edgecache"] == "exact"
        other = await c.post("/v1/messages", json=messages_body("k"), headers={"x-api-key": key_of("t02")})
        assert other.headers["x-edgecache"] == "miss"  # another tenant never reads t01's answer
        both = await c.post("/v1/messages", json=messages_body("k"), headers={
            "Authorization": f"Bearer {key_of('t01')}", "x-api-key": key_of("t02")})
        assert "different keys" in assert_anthropic_error(both, 400, "invalid_request_error")
        twice = await c.post("/v1/messages", json=messages_body("k"), headers=[
            ("x-api-key", key_of("t01")), ("x-api-key", key_of("t01"))])
        assert_anthropic_error(twice, 400, "invalid_request_error")
        # The OpenAI routes take x-api-key by the same rule.
        chat = await c.post("/v1/chat/completions", json=chat_body("k"), headers={"x-api-key": key_of("t01")})
        assert chat.status_code == 200


# --- end to end: the real server, the CPU engine ---------------------------------------------------------------


def sdk(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.mark.e2e
def test_e2e_create_twice_and_stream(server: Server) -> None:
    c = sdk(server)
    request = dict(model=MODEL, max_tokens=12, extra_body={"temperature": 0},
                   messages=[{"role": "user", "content": "What is the capital of France?"}])
    first = c.messages.with_raw_response.create(**request)
    second = c.messages.with_raw_response.create(**request)
    assert (first.headers["x-edgecache"], second.headers["x-edgecache"]) == ("miss", "exact")
    assert first.parse().content == second.parse().content and first.parse().content[0].text
    with c.messages.stream(**request) as stream:
        assert stream.response.headers["x-edgecache"] == "exact"
        final = stream.get_final_message()
    assert [b.text for b in final.content] == [b.text for b in first.parse().content]  # type: ignore[union-attr]
    assert final.stop_reason == first.parse().stop_reason
    fresh = dict(request, messages=[{"role": "user", "content": "Name a colour."}])
    with c.messages.stream(**fresh) as stream:
        assert stream.response.headers["x-edgecache"] == "miss"
        texts = list(stream.text_stream)
        streamed = stream.get_final_message()
    assert "".join(texts) == streamed.content[0].text
    again = c.messages.with_raw_response.create(**fresh)
    assert again.headers["x-edgecache"] == "exact"  # the stream was stored whole
    assert again.parse().content[0].text == streamed.content[0].text  # type: ignore[union-attr]
    assert streamed.usage.input_tokens > 0 and streamed.usage.output_tokens > 0


@pytest.mark.e2e
def test_e2e_tool_use_round_trip(server: Server) -> None:
    c = sdk(server)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    request = dict(model=MODEL, max_tokens=48, extra_body={"temperature": 0}, tools=[WEATHER],
                   tool_choice={"type": "tool", "name": "get_weather"})
    call = c.messages.create(messages=ask, **request)
    assert call.stop_reason == "tool_use"
    use = next(b for b in call.content if b.type == "tool_use")
    assert use.name == "get_weather" and set(use.input) == {"city"}
    with c.messages.stream(messages=ask, **request) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, getattr(b, "id", None), getattr(b, "input", None)) for b in streamed.content] == \
        [(b.type, getattr(b, "id", None), getattr(b, "input", None)) for b in call.content]
    answer = c.messages.create(messages=[
        *ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in call.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C and sunny"}]}],
        model=MODEL, max_tokens=24, extra_body={"temperature": 0}, tools=[WEATHER])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content


@pytest.mark.e2e
def test_e2e_count_tokens_matches_the_engines_count(server: Server) -> None:
    c = sdk(server)
    messages = [{"role": "user", "content": "Count the tokens of this question, please."}]
    counted = c.messages.count_tokens(model=MODEL, system="You are terse.", messages=messages)
    answer = c.messages.create(model=MODEL, system="You are terse.", messages=messages, max_tokens=1)
    assert counted.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens > 10
    with_tools = c.messages.count_tokens(model=MODEL, system="You are terse.", messages=messages, tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens


@pytest.mark.e2e
def test_e2e_a_shared_long_system_prompt_is_read_from_the_prefix_cache(server: Server) -> None:
    c = sdk(server)
    system = [{"type": "text", "cache_control": {"type": "ephemeral"},
               "text": "You are the support assistant of a bicycle shop. " + " ".join(
                   f"Rule {i}: answer politely and mention the opening hours, nine to six." for i in range(20))}]
    first = c.messages.create(model=MODEL, system=system, max_tokens=4,
                              messages=[{"role": "user", "content": "Do you sell tyres?"}])
    second = c.messages.create(model=MODEL, system=system, max_tokens=4,
                               messages=[{"role": "user", "content": "Do you repair brakes?"}])
    assert second.usage.cache_read_input_tokens > 100
    assert second.usage.input_tokens < first.usage.input_tokens
    assert second.usage.cache_creation_input_tokens == 0


@pytest.mark.e2e
def test_e2e_missing_max_tokens_is_anthropics_error(server: Server) -> None:
    resp = httpx.post(server.url + "/v1/messages", headers={"anthropic-version": "2023-06-01"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert "max_tokens" in assert_anthropic_error(resp, 400, "invalid_request_error")


@pytest.mark.e2e
def test_e2e_a_stop_sequence_that_ended_the_answer_is_named(server: Server) -> None:
    """The llama.cpp engine says which stop string ended an answer: Messages reports stop_reason "stop_sequence"
    with the string, on the miss, in the stream and on a hit (the stored answer keeps it)."""
    c = sdk(server)
    ask = dict(model=MODEL, max_tokens=16, extra_body={"temperature": 0},
               messages=[{"role": "user", "content": "List three fruits, separated by commas."}])
    free = c.messages.create(**ask)
    text = free.content[0].text  # type: ignore[union-attr]
    assert free.stop_sequence is None and free.stop_reason in ("end_turn", "max_tokens")
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]  # a word the greedy answer writes after its start: it ends the same answer there
    stopped = dict(ask, stop_sequences=[stop, "never-written-xyz"])
    miss = c.messages.with_raw_response.create(**stopped)
    hit = c.messages.with_raw_response.create(**stopped)
    assert (miss.headers["x-edgecache"], hit.headers["x-edgecache"]) == ("miss", "exact")
    for message in (miss.parse(), hit.parse()):
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
        assert message.content[0].text == text[:text.index(stop)]  # type: ignore[union-attr]
    # Streamed, as a miss (no-cache: computed again; the greedy answer stops at the same place).
    with c.messages.stream(**dict(stopped, max_tokens=17), extra_headers={"Cache-Control": "no-cache"}) as stream:
        assert stream.response.headers["x-edgecache"] == "miss"
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)
    assert streamed.content[0].text == text[:text.index(stop)]  # type: ignore[union-attr]
    # A larger max_tokens is served the answer that a stop sequence ended, and says so.
    with c.messages.stream(**dict(stopped, max_tokens=40)) as stream:
        assert stream.response.headers["x-edgecache"] == "exact"
        larger = stream.get_final_message()
    assert (larger.stop_reason, larger.stop_sequence, larger.content) == ("stop_sequence", stop, streamed.content)


@pytest.mark.e2e
def test_e2e_a_prompt_longer_than_the_context_is_anthropics_prompt_is_too_long(server: Server) -> None:
    """What Claude Code reads to say the conversation is too long (instead of retrying it in other shapes): a 400
    invalid_request_error "prompt is too long: N tokens > M maximum". The OpenAI routes keep their own shape, code
    context_length_exceeded (which Codex reads as "ran out of room in the model's context window")."""
    long = " ".join(f"word{i}" for i in range(6000))  # past the cpu profile's 4096-token context
    resp = httpx.post(server.url + "/v1/messages", timeout=120, json={
        "model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": long}]})
    message = assert_anthropic_error(resp, 400, "invalid_request_error")
    tokens, maximum = re.match(r"prompt is too long: (\d+) tokens > (\d+) maximum", message).groups()  # type: ignore[union-attr]
    assert int(tokens) > int(maximum) and "context holds 4096" in message
    resp = httpx.post(server.url + "/v1/responses", timeout=120, json={"model": MODEL, "input": long})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded", resp.text
    assert "4096" in resp.json()["error"]["message"]


@pytest.mark.e2e
def test_e2e_langchain_chat_anthropic_invoke_and_stream(server: Server) -> None:
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(base_url=server.url, api_key="unused", model=MODEL, temperature=0,  # type: ignore[call-arg]
                        max_tokens=16, max_retries=0)
    first = llm.invoke("Say hello to the bicycle shop.")
    assert first.content and first.response_metadata["stop_reason"] in ("end_turn", "max_tokens")
    chunks = list(llm.stream("Say hello to the bicycle shop."))
    assert "".join(ch.text for ch in chunks) == first.text
    assert sum(ch.usage_metadata["output_tokens"] for ch in chunks if ch.usage_metadata) > 0
