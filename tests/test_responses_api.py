"""The OpenAI Responses API (``/v1/responses``) through the real openai SDK, on the app served in process with a
scripted engine: one key with chat, the event stream, stored responses per tenant and their byte bound, function
calls, structured output, and the fields it refuses. The real CPU engine runs these end to end in
tests/test_responses_e2e.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from edgecache.engines.base import Choice, Chunk, GenerationRequest, ToolCall
from edgecache.http import response_store
from edgecache.http.app import create_app
from edgecache.http.response_store import SqliteResponseStore
from edgecache.settings import Settings
from tests.conftest import serve_in_process
from tests.fakes import FakeEngine
from tests.test_tenants import auth, write_tenants_file

MODEL = "fake-model"


class ToolScriptEngine(FakeEngine):
    """Calls the first (or the forced) tool while the conversation has no tool result yet, then answers in text
    that names the result; with a response format, answers JSON."""

    features = frozenset({"tools", "tool_choice", "response_format"})

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.arguments = '{"city": "Paris"}'

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        messages = request.messages or ()
        if request.tools and request.tool_choice != "none" and not any(m.role == "tool" for m in messages):
            self.calls += 1
            self.requests.append(request)
            name = request.tool_choice if request.tool_choice not in ("auto", "required") else request.tools[0].name
            call = ToolCall(id=f"call_{self.calls}", name=name, arguments=self.arguments)
            yield Chunk(finish_reason="tool_calls", prompt_tokens=10, completion_tokens=5, choices=(
                Choice(index=0, text="", finish_reason="tool_calls", tool_calls=(call,)),))
            return
        if request.response_format is not None:
            self.calls += 1
            self.requests.append(request)
            yield Chunk(text='{"city": "Oslo", "celsius": 3}')
            yield Chunk(finish_reason="stop", prompt_tokens=10, completion_tokens=9)
            return
        async for chunk in super().generate(request):
            yield chunk

    def answer_for(self, request: GenerationRequest) -> str:
        tool_results = [m.content for m in request.messages or () if m.role == "tool"]
        if tool_results:
            return f"the tool said {tool_results[-1]}"
        return super().answer_for(request)


@pytest.fixture
def engine() -> ToolScriptEngine:
    return ToolScriptEngine()


@pytest.fixture
async def client(make_settings: Callable[..., Settings], engine: ToolScriptEngine
                 ) -> AsyncIterator[httpx.AsyncClient]:
    async with serve_in_process(create_app(make_settings(), engine=engine)) as c:
        yield c


def sdk(client: httpx.AsyncClient, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://testserver/v1", api_key=key, max_retries=0, http_client=client)


def stable(response: Any) -> dict[str, Any]:
    """A Response without what differs per response: its id, time, and usage's cached tokens."""
    data = response.model_dump() if hasattr(response, "model_dump") else dict(response)
    for item in data["output"]:
        item.pop("id", None)
    return {k: v for k, v in data.items() if k not in ("id", "created_at", "usage")}


async def test_create_twice_is_a_miss_then_an_identical_exact_hit(client: httpx.AsyncClient,
                                                                  engine: ToolScriptEngine) -> None:
    c = sdk(client)
    request = dict(model=MODEL, input="What is 2 + 2?", instructions="Answer briefly.", temperature=0,
                   max_output_tokens=16)
    first = await c.responses.with_raw_response.create(**request)
    second = await c.responses.with_raw_response.create(**request)
    assert (first.headers["x-edgecache"], second.headers["x-edgecache"]) == ("miss", "exact")
    assert engine.calls == 1
    one, two = first.parse(), second.parse()
    assert one.output_text == "answer to: What is 2 + 2?" and one.status == "completed"
    assert stable(one) == stable(two) and one.id != two.id and one.id.startswith("resp_")
    assert one.usage.input_tokens_details.cached_tokens == 0
    assert two.usage.input_tokens_details.cached_tokens == two.usage.input_tokens  # nothing computed
    assert one.usage.output_tokens_details.reasoning_tokens == 0
    assert one.instructions == "Answer briefly." and one.max_output_tokens == 16 and one.temperature == 0
    # Hits are rendered once and copied: each still has its own id, item ids, time, and stored copy.
    for _ in range(2):
        hit = (await c.responses.with_raw_response.create(**request)).parse()
        assert hit.output[0].id == "msg_" + hit.id.removeprefix("resp_") and hit.id not in (one.id, two.id)
        assert abs(hit.created_at - time.time()) < 600
        stored = await c.responses.retrieve(hit.id)
        assert stored.model_dump() == hit.model_dump()


async def test_chat_and_responses_asking_the_same_share_one_key(client: httpx.AsyncClient,
                                                                engine: ToolScriptEngine) -> None:
    chat = await client.post("/v1/chat/completions", json={
        "model": MODEL, "temperature": 0, "max_tokens": 16,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]})
    assert chat.headers["x-edgecache"] == "miss"
    as_items = await sdk(client).responses.with_raw_response.create(
        model=MODEL, instructions="Be brief.", temperature=0, max_output_tokens=16,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}])
    assert as_items.headers["x-edgecache"] == "exact"
    assert as_items.parse().output_text == chat.json()["choices"][0]["message"]["content"]
    assert engine.calls == 1


async def test_fields_that_cannot_change_the_output_stay_out_of_the_key(client: httpx.AsyncClient,
                                                                        engine: ToolScriptEngine) -> None:
    base = {"model": MODEL, "input": "Say hi.", "temperature": 0}
    assert (await client.post("/v1/responses", json=base)).headers["x-edgecache"] == "miss"
    codex_like = {**base, "store": False, "stream": False, "include": ["reasoning.encrypted_content"],
                  "reasoning": {"summary": "auto"}, "prompt_cache_key": "session-1",
                  "client_metadata": {"x-codex": "1"}, "metadata": {"run": "a"}, "user": "u1",
                  "truncation": "auto", "service_tier": "auto", "parallel_tool_calls": True,
                  "prompt_cache_retention": "24h", "safety_identifier": "s", "text": {"format": {"type": "text"}},
                  "input": [{"type": "message", "role": "user", "id": "msg_client_1", "status": "completed",
                             "content": [{"type": "input_text", "text": "Say hi."}]},
                            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"}]}
    resp = await client.post("/v1/responses", json=codex_like)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-edgecache"] == "exact" and engine.calls == 1


async def test_reasoning_effort_and_verbosity_are_in_the_key_as_on_chat(client: httpx.AsyncClient,
                                                                        engine: ToolScriptEngine) -> None:
    chat = await client.post("/v1/chat/completions", json={
        "model": MODEL, "temperature": 0, "messages": [{"role": "user", "content": "Plan a trip."}],
        "reasoning_effort": "low", "verbosity": "high"})
    assert chat.headers["x-edgecache"] == "miss"
    body = {"model": MODEL, "input": "Plan a trip.", "temperature": 0, "reasoning": {"effort": "low",
                                                                                     "summary": "auto"},
            "text": {"verbosity": "high"}}
    same = await client.post("/v1/responses", json=body)
    assert same.headers["x-edgecache"] == "exact" and engine.calls == 1
    assert same.json()["reasoning"] == {"effort": "low", "summary": "auto"}
    other = await client.post("/v1/responses", json={**body, "reasoning": {"effort": "high"}})
    assert other.headers["x-edgecache"] == "miss" and engine.requests[-1].reasoning_effort == "high"


async def test_a_streamed_answer_is_the_sdks_event_sequence_and_matches_the_stored_one(
        client: httpx.AsyncClient) -> None:
    c = sdk(client)
    request = dict(model=MODEL, input="Tell me a story.", temperature=0)
    for served in ("miss", "exact"):
        async with c.responses.stream(**request) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_response()
        assert [e.sequence_number for e in events] == list(range(len(events)))
        kinds = [e.type for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.completed"]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
        assert final.output_text == "answer to: Tell me a story." and final.status == "completed"
        stored = await c.responses.retrieve(final.id)
        assert stored.output_text == final.output_text and stored.id == final.id
    raw = await client.post("/v1/responses", json={**request, "stream": True})
    assert raw.headers["x-edgecache"] == "exact" and raw.headers["content-type"].startswith("text/event-stream")


async def test_an_engine_failure_mid_stream_ends_with_error_and_response_failed(
        make_settings: Callable[..., Settings]) -> None:
    failing = FakeEngine(fail_after=1, pieces=4)
    async with serve_in_process(create_app(make_settings(), engine=failing)) as c:
        resp = await c.post("/v1/responses", json={"model": MODEL, "input": "Fail, please.", "temperature": 0,
                                                   "stream": True})
        frames = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: ")]
        assert [f["type"] for f in frames[-2:]] == ["error", "response.failed"]
        assert frames[-1]["response"]["status"] == "failed" and frames[-1]["response"]["error"]["message"]
        assert [f["sequence_number"] for f in frames] == list(range(len(frames)))
        # Nothing of a failed answer is stored, as a cached answer or as a stored response.
        again = await c.post("/v1/responses", json={"model": MODEL, "input": "Fail, please.", "temperature": 0})
        assert again.status_code == 502 and again.json()["error"]["type"] == "engine_error"
        created = frames[0]["response"]["id"]
        assert (await c.get(f"/v1/responses/{created}")).status_code == 404


async def test_retrieve_input_items_and_delete(client: httpx.AsyncClient) -> None:
    c = sdk(client)
    made = await c.responses.create(model=MODEL, temperature=0, input=[
        {"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Hello there."}])
    got = await c.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    items = await c.responses.input_items.list(made.id, order="asc")
    assert [(i.role, i.content[0].text) for i in items.data] == [("developer", "Be terse."),
                                                                ("user", "Hello there.")]
    assert all(i.id for i in items.data)
    assert [i.role for i in (await c.responses.input_items.list(made.id)).data] == ["user", "developer"]
    await c.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        await c.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        await c.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        await c.responses.create(model=MODEL, input="More.", previous_response_id=made.id)


async def test_store_false_keeps_nothing(client: httpx.AsyncClient) -> None:
    c = sdk(client)
    made = await c.responses.create(model=MODEL, input="Not kept.", temperature=0, store=False)
    assert made.store is False
    with pytest.raises(openai.NotFoundError):
        await c.responses.retrieve(made.id)


async def test_previous_response_id_continues_the_stored_conversation(client: httpx.AsyncClient,
                                                                      engine: ToolScriptEngine) -> None:
    c = sdk(client)
    first = await c.responses.create(model=MODEL, input="My name is Ada.", instructions="Be kind.", temperature=0)
    follow = await c.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                      instructions="Be brief.", temperature=0)
    assert follow.previous_response_id == first.id
    seen = engine.requests[-1].messages
    # The earlier turn comes first (its instructions do not carry over: this request's do), then the new input.
    assert [(m.role, m.content) for m in seen] == [
        ("system", "Be brief."), ("user", "My name is Ada."), ("assistant", first.output_text),
        ("user", "What is my name?")]
    # The same conversation sent whole is the same generation: one key.
    whole = await c.responses.with_raw_response.create(model=MODEL, instructions="Be brief.", temperature=0, input=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert whole.headers["x-edgecache"] == "exact" and whole.parse().output_text == follow.output_text
    items = await c.responses.input_items.list(follow.id)
    assert [i.content[0].text for i in items.data] == ["What is my name?"]


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


async def test_a_forced_function_call_and_its_output_turn(client: httpx.AsyncClient,
                                                          engine: ToolScriptEngine) -> None:
    c = sdk(client)
    request = dict(model=MODEL, input="Weather in Paris?", tools=[WEATHER], temperature=0,
                   tool_choice={"type": "function", "name": "get_weather"})
    called = await c.responses.create(**request)
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {
        "city": "Paris"}
    assert called.tools[0].name == "get_weather" and called.tool_choice.name == "get_weather"
    assert engine.requests[-1].tool_choice == "get_weather"
    # The stream of a whole answer: the call's added, arguments delta and done, item done.
    async with c.responses.stream(**request) as stream:
        kinds = [e.type async for e in stream]
        streamed = await stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert streamed.output[0].call_id == call.call_id and streamed.output[0].arguments == call.arguments
    # The next turn: the call and its output sent back as items.
    answer = await c.responses.create(model=MODEL, tools=[WEATHER], temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments,
         "id": call.id, "status": "completed"},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}])
    assert answer.output_text == "the tool said 18 C and sunny"
    seen = engine.requests[-1].messages
    assert seen[1].role == "assistant" and seen[1].tool_calls[0].id == call.call_id
    assert (seen[2].role, seen[2].tool_call_id) == ("tool", call.call_id)
    # The same turn through previous_response_id: one key with the whole history.
    calls = engine.calls
    continued = await c.responses.with_raw_response.create(
        model=MODEL, tools=[WEATHER], temperature=0, previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}])
    assert continued.headers["x-edgecache"] == "exact" and engine.calls == calls


def codex_body(run: str, *, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """What Codex CLI 0.169 sends (`codex exec`, captured from a real run against this server; texts shortened,
    tools cut from 12 to 3). ``run`` stands for what changes from run to run: item ids, the session id in
    prompt_cache_key and client_metadata."""
    exec_command = {"type": "function", "name": "exec_command", "description": "Runs a command in a PTY.",
                    "strict": False, "parameters": {"type": "object", "properties": {
                        "cmd": {"type": "string", "description": "Shell command to execute."}},
                        "required": ["cmd"], "additionalProperties": False}}
    agents = {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for spawning sub-agents.",
              "tools": [{"type": "function", "name": "close_agent", "description": "Close an agent.",
                         "strict": False, "parameters": {"type": "object", "properties": {
                             "target": {"type": "string"}}, "required": ["target"],
                             "additionalProperties": False}}]}
    return {
        "model": MODEL, "stream": True, "tool_choice": "auto", "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"}, "store": False, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": run, "client_metadata": {"x-codex-installation-id": run, "session_id": run},
        "tools": tools if tools is not None else [agents, exec_command],
        "input": [
            {"type": "message", "id": f"msg_{run}_0", "role": "developer",
             "content": [{"type": "input_text", "text": "You are a coding agent running in the Codex CLI."}]},
            {"type": "message", "id": f"msg_{run}_1", "role": "user", "content": [
                {"type": "input_text", "text": "<environment_context>\n  <cwd>/work</cwd>\n</environment_context>"}]},
            {"type": "message", "id": f"msg_{run}_2", "role": "user",
             "content": [{"type": "input_text", "text": "Say hello."}]}]}


async def test_a_request_shaped_as_codexs_is_served(client: httpx.AsyncClient, engine: ToolScriptEngine) -> None:
    """Codex's fields are accepted and its per-run ids stay out of the key; a namespace's functions are offered
    as functions, and a call to one names its namespace (Codex looks the function up by both)."""
    headers = {"X-EdgeCache-Policy": "reuse"}  # Codex sends no temperature: sampled, so reuse is what caches it
    first = await client.post("/v1/responses", json=codex_body("run-a"), headers=headers)
    assert first.status_code == 200, first.text
    second = await client.post("/v1/responses", json=codex_body("run-b"), headers=headers)
    assert (first.headers["x-edgecache"], second.headers["x-edgecache"]) == ("miss", "exact")
    assert engine.calls == 1
    offered = engine.requests[0].tools
    assert [t.name for t in offered] == ["close_agent", "exec_command"]
    assert [m.role for m in engine.requests[0].messages or ()] == ["developer", "user", "user"]
    done = [json.loads(line[6:]) for line in first.text.splitlines() if line.startswith("data: ")][-1]
    assert done["type"] == "response.completed"
    (call,) = done["response"]["output"]
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "close_agent", "multi_agent_v1")
    assert done["response"]["tools"][0]["type"] == "namespace"
    # The call and its output sent back, as Codex does: the namespace is accepted and changes nothing.
    turn = codex_body("run-a")
    turn["input"] += [{"type": "function_call", "call_id": call["call_id"], "name": "close_agent",
                       "namespace": "multi_agent_v1", "arguments": call["arguments"]},
                      {"type": "function_call_output", "call_id": call["call_id"], "output": "closed"}]
    answered = await client.post("/v1/responses", json=turn, headers=headers)
    assert answered.status_code == 200, answered.text
    del turn["input"][-2]["namespace"]
    again = await client.post("/v1/responses", json=turn, headers=headers)
    assert again.headers["x-edgecache"] == "exact"
    # Codex's web_search tool (sent unless its config says web_search = "disabled") is refused, saying so.
    refused = await client.post("/v1/responses", json=codex_body("run-a", tools=[
        {"type": "web_search", "external_web_access": False}]))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools[0].type"
    assert 'web_search = \\"disabled\\"' in refused.text


async def test_allowed_tools_is_chats_allowed_tools(client: httpx.AsyncClient, engine: ToolScriptEngine) -> None:
    other = {**WEATHER, "name": "get_time", "description": "The time in a city"}
    made = await sdk(client).responses.create(
        model=MODEL, input="Weather in Paris?", tools=[other, WEATHER], temperature=0,
        tool_choice={"type": "allowed_tools", "mode": "required", "tools": [{"type": "function",
                                                                               "name": "get_weather"}]})
    assert made.output[0].name == "get_weather" and made.tool_choice.mode == "required"
    # Served as "required" over only the allowed tool, so it shares its key with a request that sends just that.
    seen = engine.requests[-1]
    assert [t.name for t in seen.tools] == ["get_weather"] and seen.tool_choice == "required"
    only = await client.post("/v1/responses", json={"model": MODEL, "input": "Weather in Paris?", "temperature": 0,
                                                    "tools": [WEATHER], "tool_choice": "required"})
    assert only.headers["x-edgecache"] == "exact"


class Weather(BaseModel):
    city: str
    celsius: int


async def test_text_format_with_a_pydantic_model_through_parse(client: httpx.AsyncClient,
                                                               engine: ToolScriptEngine) -> None:
    c = sdk(client)
    parsed = await c.responses.parse(model=MODEL, input="Weather in Oslo as JSON.", text_format=Weather,
                                     temperature=0)
    assert parsed.output_parsed == Weather(city="Oslo", celsius=3)
    fmt = engine.requests[-1].response_format
    assert fmt is not None and fmt.kind == "json_schema" and fmt.name == "Weather" and fmt.strict
    assert json.loads(fmt.schema)["required"] == ["city", "celsius"]
    # The same format through chat is the same key.
    chat = await client.post("/v1/chat/completions", json={
        "model": MODEL, "temperature": 0, "messages": [{"role": "user", "content": "Weather in Oslo as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "Weather", "strict": True, "schema": json.loads(fmt.schema)}}})
    assert chat.headers["x-edgecache"] == "exact"


async def test_the_engine_not_honouring_a_field_is_named_as_the_caller_spells_it(
        make_settings: Callable[..., Settings]) -> None:
    async with serve_in_process(create_app(make_settings(), engine=FakeEngine())) as c:
        resp = await c.post("/v1/responses", json={"model": MODEL, "input": "x",
                                                   "text": {"format": {"type": "json_object"}}})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "text.format"


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[1].type"),
    ({"tools": [{"type": "computer_use_preview", "display_width": 1, "display_height": 1,
                 "environment": "linux"}]}, "tools[0].type"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0].type"),
    ({"tools": [{"type": "mcp", "server_label": "x", "server_url": "https://example.invalid"}]}, "tools[0].type"),
    ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x.invalid/a.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "user", "content": "hi", "colour": "red"}]}, "input[0].colour"),
    ({"max_output_token": 5}, "max_output_token"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
])
async def test_refused_fields_are_named_in_openais_error_shape(client: httpx.AsyncClient, extra: dict[str, Any],
                                                               param: str) -> None:
    resp = await client.post("/v1/responses", json={"model": MODEL, "input": "Hello.", **extra})
    assert resp.status_code in (400, 404), resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


async def test_another_tenants_response_is_a_404_everywhere(make_settings: Callable[..., Settings],
                                                            tmp_path: Path) -> None:
    settings = make_settings(tenants_file=str(write_tenants_file(tmp_path / "tenants.toml")))
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as client:
        mine, theirs = sdk(client, auth("t01")["Authorization"][7:]), sdk(client, auth("t02")["Authorization"][7:])
        made = await mine.responses.create(model=MODEL, input="A secret of t01.", temperature=0)
        with pytest.raises(openai.NotFoundError):
            await theirs.responses.retrieve(made.id)
        with pytest.raises(openai.NotFoundError):
            await theirs.responses.input_items.list(made.id)
        with pytest.raises(openai.NotFoundError):
            await theirs.responses.create(model=MODEL, input="What was it?", previous_response_id=made.id)
        with pytest.raises(openai.NotFoundError):
            await theirs.responses.delete(made.id)
        assert (await mine.responses.retrieve(made.id)).output_text == made.output_text  # still there
        anonymous = await client.get(f"/v1/responses/{made.id}")
        assert anonymous.status_code == 401


async def test_stored_responses_stay_within_their_byte_bound(make_settings: Callable[..., Settings]) -> None:
    bound = 16_384
    async with serve_in_process(create_app(make_settings(store__responses_bytes=bound), engine=FakeEngine())) as c:
        front = c.app.state.front  # type: ignore[attr-defined]
        ids = []
        for i in range(60):
            made = await c.post("/v1/responses", json={"model": MODEL, "input": f"question {i} " + "x" * 200,
                                                        "temperature": 0})
            ids.append(made.json()["id"])
        await front.responses.store.flushed()
        rows, used = await front.responses.store.tenant_usage("default")
        assert 0 < used <= bound and 0 < rows < 60
        # The oldest went first; the newest are all there.
        assert (await c.get(f"/v1/responses/{ids[0]}")).status_code == 404
        for response_id in ids[-rows:]:
            assert (await c.get(f"/v1/responses/{response_id}")).status_code == 200


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
async def test_an_openai_agents_sdk_agent_runs_to_its_answer_and_the_second_run_is_all_hits(
        client: httpx.AsyncClient, engine: ToolScriptEngine, api: str) -> None:
    """The OpenAI Agents SDK (its Responses model, its default, and its Chat Completions model): an agent with one
    function tool calls it, gets its result and answers. The engine is scripted (the tiny CPU model does not call
    tools reliably): a tool call while there is no tool result, then an answer naming it."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, RunConfig, Runner
    from agents import function_tool

    looked_up: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        looked_up.append(city)
        return f"sunny in {city}"

    model_type = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    agent = Agent(name="forecaster", instructions="Answer with the weather.", tools=[get_weather],
                  model=model_type(model=MODEL, openai_client=sdk(client)),
                  model_settings=ModelSettings(temperature=0))
    config = RunConfig(tracing_disabled=True)
    first = await Runner.run(agent, "What is the weather in Paris?", run_config=config)
    assert first.final_output == "the tool said sunny in Paris" and looked_up == ["Paris"]
    assert engine.calls == 2  # the tool call, then the answer
    second = await Runner.run(agent, "What is the weather in Paris?", run_config=config)
    assert second.final_output == first.final_output and looked_up == ["Paris", "Paris"]
    assert engine.calls == 2  # both turns answered from the cache


async def test_feedback_finds_a_responses_id(client: httpx.AsyncClient) -> None:
    made = (await client.post("/v1/responses", json={"model": MODEL, "input": "Mark me.", "temperature": 0})).json()
    marked = await client.post("/v1/feedback", json={"response_id": made["id"], "correct": True})
    assert marked.status_code == 200 and marked.json()["effect"] == "recorded"
    assert (await client.post("/v1/feedback", json={"response_id": "resp_never", "correct": True})).status_code == 404


async def test_stored_responses_live_in_the_data_dir_until_their_ttl(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings(store__responses_ttl_s=1.0)
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        made = (await c.post("/v1/responses", json={"model": MODEL, "input": "Keep me.", "temperature": 0})).json()
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:  # a restart: read from disk
        got = await c.get(f"/v1/responses/{made['id']}")
        assert got.status_code == 200 and got.json() == made
        await asyncio.sleep(1.2)
        assert (await c.get(f"/v1/responses/{made['id']}")).status_code == 404


async def test_a_store_that_cannot_write_still_answers_and_says_why_it_cannot_read(
        make_settings: Callable[..., Settings]) -> None:
    settings = make_settings()
    settings.data_path.mkdir(parents=True, exist_ok=True)
    (settings.data_path / "responses").write_text("a file where the store's folder goes")
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        made = await c.post("/v1/responses", json={"model": MODEL, "input": "Unkept.", "temperature": 0})
        assert made.status_code == 200 and made.json()["output"][0]["content"][0]["text"] == "answer to: Unkept."
        await c.app.state.front.responses.store.flushed()  # type: ignore[attr-defined]
        got = await c.get(f"/v1/responses/{made.json()['id']}")
        assert got.status_code == 503 and got.json()["error"]["type"] == "storage_unavailable"


async def test_a_response_too_big_for_its_tenants_bound_is_served_but_not_kept(
        make_settings: Callable[..., Settings]) -> None:
    """A record bigger than the whole bound would evict everything the tenant keeps and still not fit: it is
    served, not stored, and the tenant's stored responses stay."""
    bound = 4_096
    async with serve_in_process(create_app(make_settings(store__responses_bytes=bound), engine=FakeEngine())) as c:
        front = c.app.state.front  # type: ignore[attr-defined]
        small = (await c.post("/v1/responses", json={"model": MODEL, "input": "short", "temperature": 0})).json()
        big = await c.post("/v1/responses", json={"model": MODEL, "input": "long " + "y" * 8_000, "temperature": 0})
        assert big.status_code == 200 and big.json()["output"]
        await front.responses.store.flushed()
        assert (await c.get(f"/v1/responses/{big.json()['id']}")).status_code == 404
        assert (await c.get(f"/v1/responses/{small['id']}")).status_code == 200
        assert (await front.responses.store.tenant_usage("default"))[0] == 1


async def test_a_batch_bigger_than_one_insert_statement_is_kept_whole(tmp_path: Path) -> None:
    """The writer puts many rows in each INSERT: a batch of more rows than one statement takes (and a last,
    shorter statement) keeps every record, each under its own tenant and id."""
    store = SqliteResponseStore(tmp_path, tenant_bytes=1 << 30, ttl_s=3600)
    now = time.time()
    try:
        count = 2 * response_store._ROWS_PER_INSERT + 7
        for i in range(count):
            store.put(f"tenant-{i % 3}", f"resp_{i}", b"record %d" % i, now, now + 3600)
        await store.flushed()
        assert [await store.tenant_usage(f"tenant-{t}") for t in range(3)] == [
            (len(range(t, count, 3)), sum(len(b"record %d" % i) for i in range(t, count, 3))) for t in range(3)]
        for i in (0, 1, response_store._ROWS_PER_INSERT, count - 1):
            assert await store.get(f"tenant-{i % 3}", f"resp_{i}") == b"record %d" % i
        assert await store.get("tenant-1", "resp_0") is None  # another tenant's id
    finally:
        await store.close()
