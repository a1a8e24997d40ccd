"""The OpenAI request surface over HTTP with fake engines: which fields are accepted and left out of the key, which
go into it, which are refused (naming the field, and the engine that cannot honour it), and whole answers (tool
calls, logprobs, several choices) stored and replayed in the client's shape."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest

from edgecache.http.app import create_app
from edgecache.engines.base import Choice, Chunk, GenerationRequest, TokenLogprob, ToolCall, TopLogprob
from edgecache.stores import CachedAnswer
from tests.conftest import chat_body, serve_in_process
from tests.fakes import FakeEngine
from tests.test_app import assert_openai_error, sse_events


async def test_fields_that_cannot_change_the_output_are_accepted_and_share_the_key(
        client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    first = await client.post("/v1/chat/completions", json=chat_body("no-ops"))
    assert first.headers["x-edgecache"] == "miss"
    for extra in ({"store": False}, {"metadata": {"a": "b"}}, {"service_tier": "auto"}, {"user": "u1"},
                  {"logprobs": False}, {"response_format": {"type": "text"}}, {"tool_choice": "none"},
                  {"tool_choice": "auto"}, {"parallel_tool_calls": False}, {"logit_bias": {}}, {"n": 1},
                  {"stream_options": {"include_usage": True}}, {"prompt_cache_key": "k"},
                  {"safety_identifier": "s"}, {"modalities": ["text"]}, {"chat_template_kwargs": {}},
                  {"top_k": -1}, {"top_k": 0}, {"min_p": 0.0}, {"repetition_penalty": 1.0},
                  {"prediction": {"type": "content", "content": "x"}}, {"tools": []},
                  {"prompt_cache_retention": "24h"}, {"prompt_cache_retention": "in-memory"},
                  {"min_tokens": 0}, {"ignore_eos": False}, {"stop_token_ids": []}, {"skip_special_tokens": True},
                  {"audio": None}, {"function_call": None}):
        resp = await client.post("/v1/chat/completions", json=chat_body("no-ops", **extra))
        assert resp.status_code == 200, (extra, resp.text)
        assert resp.headers["x-edgecache"] == "exact", extra
    assert fake_engine.calls == 1


@pytest.mark.parametrize(("extra", "field"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"n": 2, "seed": 1}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"top_k": 5}, "top_k"),
    ({"min_p": 0.1}, "min_p"),
    ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ({"logit_bias": {"42": 5}}, "logit_bias"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ({"min_tokens": 4}, "min_tokens"),
    ({"ignore_eos": True}, "ignore_eos"),
    ({"stop_token_ids": [2]}, "stop_token_ids"),
    ({"skip_special_tokens": False}, "skip_special_tokens"),
])
async def test_a_field_the_engine_cannot_honour_is_a_400_naming_it_and_the_engine(
        client: httpx.AsyncClient, fake_engine: FakeEngine, extra: dict[str, Any], field: str) -> None:
    error = assert_openai_error(await client.post("/v1/chat/completions", json=chat_body("x", **extra)), 400)
    assert error["param"] == field
    assert field in error["message"] and "FakeEngine" in error["message"]
    assert fake_engine.calls == 0


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/chat/completions", chat_body("x", tools=[{"type": "function", "function": {"name": "f"}}], max_token=3),
     "max_token"),
    ("/v1/chat/completions", chat_body("x", stop=[""]), "stop"),
    ("/v1/chat/completions", chat_body("x", stop=["ok", ""]), "stop"),
    ("/v1/completions", {"model": "fake-model", "prompt": "", "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "best_of": 3}, "best_of"),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "suffix": "end"}, "suffix"),
    ("/v1/chat/completions", chat_body("x", top_logprobs=2), "top_logprobs"),
    ("/v1/chat/completions", chat_body("x", tool_choice="required"), "tool_choice"),
    ("/v1/chat/completions", chat_body("x", tool_choice={"type": "function", "function": {"name": "nope"}},
                                       tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice"),
    ("/v1/chat/completions", chat_body("x", reasoning_effort="maximal"), "reasoning_effort"),
    ("/v1/chat/completions", chat_body("x", verbosity="none"), "verbosity"),
    ("/v1/chat/completions", chat_body("x", prompt_cache_retention="1h"), "prompt_cache_retention"),
    ("/v1/chat/completions", chat_body("x", reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}),
     "reasoning_effort"),
    ("/v1/chat/completions", chat_body("x", min_tokens=20, max_tokens=8), "min_tokens"),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "min_tokens": 20, "max_tokens": 8}, "min_tokens"),
    ("/v1/chat/completions", chat_body("x", stop_token_ids=[-1]), "stop_token_ids[0]"),
    ("/v1/chat/completions", chat_body("x", web_search_options={}), "web_search_options"),
    ("/v1/chat/completions", chat_body("x", function_call="auto"), "function_call"),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [
        {"role": "user", "content": "hi", "reasoning_content": "hmm"}]}, "messages[0].reasoning_content"),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "custom", "custom": {"name": "sql", "input": "select 1"}}]},
        {"role": "user", "content": "and?"}]}, "messages[0].tool_calls[0]"),
    ("/v1/chat/completions", chat_body("x", tools=[{"type": "function", "function": {"name": "f"}}],
                                       tool_choice={"type": "allowed_tools", "allowed_tools": {
                                           "mode": "auto", "tools": [{"type": "function",
                                                                      "function": {"name": "g"}}]}}),
     "tool_choice.allowed_tools.tools"),
    ("/v1/chat/completions", chat_body("x", audio={"voice": "alloy", "format": "mp3"}), "audio"),
    ("/v1/chat/completions", chat_body("x", modalities=["text", "audio"]), "modalities"),
    ("/v1/chat/completions", chat_body("x", functions=[{"name": "f"}]), "functions"),
    ("/v1/chat/completions", chat_body("x", logit_bias={"abc": 1}), "logit_bias"),
    ("/v1/chat/completions", chat_body("x", n=99), "n"),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]},
     "messages[0].content[0]"),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "tool", "content": "42"}]},
     "messages[0].tool_call_id"),
])
async def test_bad_fields_are_400s_naming_the_field(client: httpx.AsyncClient, fake_engine: FakeEngine,
                                                    route: str, body: dict[str, Any], param: str) -> None:
    error = assert_openai_error(await client.post(route, json=body), 400)
    assert error["param"] == param, error
    assert fake_engine.calls == 0


@pytest.mark.parametrize("extra", [
    {"reasoning_effort": "none"}, {"reasoning_effort": "minimal"}, {"reasoning_effort": "xhigh"},
    {"verbosity": "low"}, {"reasoning_effort": "high", "verbosity": "high"},
])
async def test_reasoning_effort_and_verbosity_are_accepted_and_in_the_key(
        client: httpx.AsyncClient, fake_engine: FakeEngine, extra: dict[str, Any]) -> None:
    """Every OpenAI value is accepted (the Agents SDK sends "none"); each is a template variable, so in the key."""
    plain = await client.post("/v1/chat/completions", json=chat_body("effort"))
    first = await client.post("/v1/chat/completions", json=chat_body("effort", **extra))
    again = await client.post("/v1/chat/completions", json=chat_body("effort", **extra))
    assert [r.headers["x-edgecache"] for r in (plain, first, again)] == ["miss", "miss", "exact"]
    request = fake_engine.requests[-1]
    assert (request.reasoning_effort, request.verbosity) == (extra.get("reasoning_effort", ""),
                                                             extra.get("verbosity", ""))


async def test_echoed_assistant_reasoning_and_annotations_are_accepted_and_left_out_of_the_key(
        client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    def body(**assistant_extra: Any) -> dict[str, Any]:
        return {"model": "fake-model", "temperature": 0, "max_tokens": 8, "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", **assistant_extra},
            {"role": "user", "content": "and 3+3?"}]}

    assert (await client.post("/v1/chat/completions", json=body())).headers["x-edgecache"] == "miss"
    for extra in ({"reasoning_content": "adding"}, {"reasoning": "adding"},
                  {"reasoning_details": [{"type": "reasoning.text", "text": "adding"}]},
                  {"annotations": [{"type": "url_citation", "url_citation": {"url": "https://example.invalid"}}]}):
        resp = await client.post("/v1/chat/completions", json=body(**extra))
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-edgecache"] == "exact", extra
    assert fake_engine.calls == 1


async def test_custom_tools_are_a_400_naming_them_and_the_engine(client: httpx.AsyncClient,
                                                                  fake_engine: FakeEngine) -> None:
    custom = {"type": "custom", "custom": {"name": "sql", "description": "runs SQL",
                                          "format": {"type": "text"}}}
    for choice in (None, {"type": "custom", "custom": {"name": "sql"}}):
        error = assert_openai_error(await client.post("/v1/chat/completions", json=chat_body(
            "x", tools=[custom], **({"tool_choice": choice} if choice else {}))), 400)
        assert error["param"] == "tools"
        assert "custom tools" in error["message"] and "FakeEngine" in error["message"]
        assert "unknown" not in error["message"].lower() and "invalid value" not in error["message"].lower()
    assert fake_engine.calls == 0


async def test_an_upstream_engine_refuses_custom_tools_and_takes_everything_else(make_settings: Any) -> None:
    from edgecache.engines.openai_upstream import OpenAIUpstreamEngine
    from edgecache.http.request_surface import check_engine_supports
    from edgecache.errors import BadRequest

    engine = OpenAIUpstreamEngine("http://upstream.invalid/v1", model="m")
    every = frozenset(("min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens", "logit_bias"))
    check_engine_supports(every, engine)
    with pytest.raises(BadRequest, match="custom tools"):
        check_engine_supports(frozenset({"tools", "custom_tools"}), engine)


async def test_allowed_tools_is_its_mode_over_only_the_allowed_tools(whole_client: httpx.AsyncClient) -> None:
    """allowed_tools narrows the tools the model sees: the same key as sending only those tools."""
    other = {"type": "function", "function": {"name": "stocks", "parameters": {"type": "object"}}}
    allowed = await whole_client.post("/v1/chat/completions", json=chat_body("a", tools=[other, *TOOLS], tool_choice={
        "type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
            {"type": "function", "function": {"name": "weather"}}]}}))
    assert allowed.status_code == 200, allowed.text
    assert allowed.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "weather"
    direct = await whole_client.post("/v1/chat/completions", json=chat_body("a", tools=TOOLS,
                                                                             tool_choice="required"))
    assert (allowed.headers["x-edgecache"], direct.headers["x-edgecache"]) == ("miss", "exact")


async def test_an_image_part_says_the_model_is_text_only(client: httpx.AsyncClient) -> None:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}]}]}
    error = assert_openai_error(await client.post("/v1/chat/completions", json=body), 400)
    assert "text-only" in error["message"]


async def test_text_parts_names_and_tool_history_are_accepted_and_in_the_key(
        client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    history = [
        {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
        {"role": "user", "content": "Weather in Paris?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
    ]
    body = {"model": "fake-model", "messages": history, "temperature": 0, "max_tokens": 8}
    assert (await client.post("/v1/chat/completions", json=body)).headers["x-edgecache"] == "miss"
    assert (await client.post("/v1/chat/completions", json=body)).headers["x-edgecache"] == "exact"
    other = json.loads(json.dumps(body))
    other["messages"][2]["tool_calls"][0]["id"] = "call_2"
    other["messages"][3]["tool_call_id"] = "call_2"
    assert (await client.post("/v1/chat/completions", json=other)).headers["x-edgecache"] == "miss"
    assert fake_engine.requests[0].messages[2].tool_calls == (ToolCall("call_1", "weather", "{\"city\":\"Paris\"}"),)


async def test_models_retrieve(client: httpx.AsyncClient) -> None:
    resp = await client.get("/v1/models/fake-model")
    assert resp.status_code == 200 and resp.json()["id"] == "fake-model" and resp.json()["object"] == "model"
    assert_openai_error(await client.get("/v1/models/gpt-9"), 404)


async def test_a_stream_carries_usage_only_when_asked(client: httpx.AsyncClient) -> None:
    plain = sse_events((await client.post("/v1/chat/completions", json=chat_body("u", stream=True))).text)
    assert all("usage" not in e or e["usage"] is None for e in plain)
    assert plain[-1]["choices"][0]["finish_reason"] == "stop"
    asked = sse_events((await client.post("/v1/chat/completions", json=chat_body(
        "u", stream=True, stream_options={"include_usage": True}))).text)
    assert asked[-1]["choices"] == [] and asked[-1]["usage"]["total_tokens"] > 0


# --- whole answers -----------------------------------------------------------------------------------------------


class WholeAnswerEngine(FakeEngine):
    """Honours tools, logprobs and n like a real engine's shape: one final chunk carrying every choice."""

    kind = "whole"
    features = frozenset({"tools", "tool_choice", "n", "logprobs", "top_logprobs", "response_format"})

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        self.calls += 1
        self.requests.append(request)
        choices = []
        for i in range(request.n):
            if request.tools:
                choices.append(Choice(index=i, text="", finish_reason="tool_calls", tool_calls=(
                    ToolCall(id=f"call_{i}", name=request.tools[0].name, arguments='{"city": "Paris"}'),)))
            else:
                lp = None if request.logprobs is None else (TokenLogprob(
                    token="hi", logprob=-0.5, bytes=(104, 105), top=(TopLogprob("hi", -0.5, (104, 105)),)),)
                choices.append(Choice(index=i, text=f"hi {i}", finish_reason="stop", logprobs=lp))
        yield Chunk(finish_reason=choices[0].finish_reason, prompt_tokens=3, completion_tokens=request.n,
                    choices=tuple(choices))


TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture
async def whole_client(make_settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with serve_in_process(create_app(make_settings(), engine=WholeAnswerEngine())) as c:
        yield c


def _stable(body: dict[str, Any]) -> dict[str, Any]:
    """The answer without what differs per response: id, time, and usage's cached_tokens (all of a hit's)."""
    return {k: v for k, v in body.items() if k not in ("id", "created", "usage")}


@pytest.mark.parametrize("extra", [
    {"tools": TOOLS, "tool_choice": "required"},
    {"n": 3, "seed": 5},
    {"logprobs": True, "top_logprobs": 1},
])
async def test_a_whole_answer_replays_identically_streamed_or_not(whole_client: httpx.AsyncClient,
                                                                   extra: dict[str, Any]) -> None:
    miss = await whole_client.post("/v1/chat/completions", json=chat_body("w", **extra))
    hit = await whole_client.post("/v1/chat/completions", json=chat_body("w", **extra))
    assert (miss.headers["x-edgecache"], hit.headers["x-edgecache"]) == ("miss", "exact")
    assert _stable(hit.json()) == _stable(miss.json())
    streamed = await whole_client.post("/v1/chat/completions", json=chat_body("w", stream=True, **extra))
    assert streamed.headers["x-edgecache"] == "exact"
    events = sse_events(streamed.text)
    rebuilt: dict[int, dict[str, Any]] = {}
    for event in events:
        for c in event["choices"]:
            slot = rebuilt.setdefault(c["index"], {"content": None, "tool_calls": [], "logprobs": None})
            delta = c["delta"]
            if delta.get("content"):
                slot["content"] = (slot["content"] or "") + delta["content"]
            slot["tool_calls"] += delta.get("tool_calls") or []
            if c.get("logprobs"):
                slot["logprobs"] = c["logprobs"]
            if c.get("finish_reason"):
                slot["finish_reason"] = c["finish_reason"]
    for choice in miss.json()["choices"]:
        slot = rebuilt[choice["index"]]
        assert slot["finish_reason"] == choice["finish_reason"]
        assert slot["content"] == choice["message"]["content"]
        assert [{"id": t["id"], "function": t["function"]} for t in slot["tool_calls"]] == \
            [{"id": t["id"], "function": t["function"]} for t in choice["message"].get("tool_calls") or []]
        assert slot["logprobs"] == choice["logprobs"]


async def test_tool_call_answer_shape(whole_client: httpx.AsyncClient) -> None:
    body = (await whole_client.post("/v1/chat/completions", json=chat_body(
        "t", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}}))).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [
        {"id": "call_0", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]


async def test_tools_and_schemas_split_the_key(whole_client: httpx.AsyncClient) -> None:
    other_tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"town": {"type": "string"}}}}}]
    a = await whole_client.post("/v1/chat/completions", json=chat_body("k", tools=TOOLS, tool_choice="required"))
    b = await whole_client.post("/v1/chat/completions", json=chat_body("k", tools=other_tools,
                                                                       tool_choice="required"))
    c = await whole_client.post("/v1/chat/completions", json=chat_body("k", tools=TOOLS, tool_choice="auto"))
    assert [r.headers["x-edgecache"] for r in (a, b, c)] == ["miss", "miss", "miss"]
    # Key order inside a schema is not a difference.
    reordered = [{"function": {"parameters": {"required": ["city"], "properties": {"city": {"type": "string"}},
                                              "type": "object"}, "name": "weather"}, "type": "function"}]
    d = await whole_client.post("/v1/chat/completions", json=chat_body("k", tools=reordered,
                                                                       tool_choice="required"))
    assert d.headers["x-edgecache"] == "exact"


def test_an_entry_written_before_choices_existed_still_decodes() -> None:
    old = msgspec.msgpack.encode(["text", "stop", 3, 4, 1.0, 2.0])
    answer = msgspec.msgpack.decode(old, type=CachedAnswer)
    assert answer.text == "text" and answer.choices is None


async def test_openapi_document_is_generated_from_the_request_structs(client: httpx.AsyncClient) -> None:
    from edgecache.http.feedback import FeedbackRequest
    from edgecache.http.request_surface import ChatCompletionRequest, CompletionRequest

    resp = await client.get("/openapi.json")
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    doc = resp.json()
    assert doc["openapi"].startswith("3.")
    schemas = doc["components"]["schemas"]
    for struct in (ChatCompletionRequest, CompletionRequest, FeedbackRequest):
        # Every field the decoder accepts is in the schema, and nothing else (it is the same struct).
        assert set(schemas[struct.__name__]["properties"]) == set(struct.__struct_encode_fields__)
        assert schemas[struct.__name__].get("additionalProperties") is False
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/feedback", "/v1/models",
                 "/v1/models/{model_id}"):
        assert path in doc["paths"]
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}


def test_tools_tool_choice_and_response_format_name_the_semantic_namespace() -> None:
    from edgecache.engines.base import Message, OutputFormat, SamplingParams, ToolSpec
    from edgecache.semantic.lookup import probe_for

    base = GenerationRequest(messages=(Message("user", "What is the weather in Paris?"),),
                             params=SamplingParams(temperature=0.0))
    tool = ToolSpec(name="weather", parameters='{"type":"object"}')
    variants = [base, msgspec.structs.replace(base, tools=(tool,)),
                msgspec.structs.replace(base, tools=(tool,), tool_choice="required"),
                msgspec.structs.replace(base, tools=(ToolSpec(name="forecast"),)),
                msgspec.structs.replace(base, response_format=OutputFormat(kind="json_object")),
                msgspec.structs.replace(base, response_format=OutputFormat(kind="json_schema", schema="{}"))]
    namespaces = [probe_for(r, "m@1").namespace for r in variants]  # type: ignore[union-attr]
    assert len(set(namespaces)) == len(variants)
    # The user's text is what is embedded, never part of the namespace.
    paraphrase = msgspec.structs.replace(base, messages=(Message("user", "Weather in Paris now?"),))
    assert probe_for(paraphrase, "m@1").namespace == namespaces[0]  # type: ignore[union-attr]


# What SGLang's router 0.3.2 adds to every body it forwards (its fields at their defaults), beside max_tokens
# renamed max_completion_tokens: tests/test_router.py sends requests through the real router.
ROUTER_CHAT_DEFAULTS = {"logprobs": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
                        "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
                        "return_hidden_states": False}
ROUTER_COMPLETION_DEFAULTS = {"echo": False, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                              "return_hidden_states": False}


async def test_what_sglang_s_router_adds_is_accepted_and_shares_the_key(
        client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    from edgecache.http.request_surface import SGLANG_PASSED_OVER

    first = await client.post("/v1/chat/completions", json=chat_body("routed"))
    assert first.headers["x-edgecache"] == "miss"
    routed = chat_body("routed", **ROUTER_CHAT_DEFAULTS)
    routed["max_completion_tokens"] = routed.pop("max_tokens")
    passed_over = {"rid": "r1", "extra_key": ["k"], "priority": 3, "custom_labels": {"team": "a"}, "routing_id": "w1",
                   "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7, "routed_dp_rank": 0,
                   "data_parallel_rank": 0, "disagg_prefill_dp_rank": 0, "separate_reasoning": False,
                   "stream_reasoning": False}
    assert set(passed_over) == set(SGLANG_PASSED_OVER)
    off = {"return_routed_experts": False, "return_cached_tokens_details": False, "return_token_ids": False,
           "return_prompt_token_ids": False, "return_meta_info": False, "regex": None, "lora_path": None,
           "stream_options": {"include_usage": True, "continuous_usage_stats": False}}
    for body in (routed, {**routed, **passed_over}, {**routed, **off, "stream": True}):
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, (body, resp.text)
        assert resp.headers["x-edgecache"] == "exact", body
    text = {"model": "fake-model", "prompt": "routed", "max_tokens": 8, "temperature": 0}
    assert (await client.post("/v1/completions", json=text)).headers["x-edgecache"] == "miss"
    resp = await client.post("/v1/completions", json={**text, **ROUTER_COMPLETION_DEFAULTS, "rid": "r2",
                                                      "json_schema": None})
    assert resp.status_code == 200 and resp.headers["x-edgecache"] == "exact", resp.text
    assert fake_engine.calls == 2


async def test_sampling_seed_is_the_seed(client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    first = await client.post("/v1/chat/completions", json=chat_body("seeded", seed=7, temperature=0.7))
    again = await client.post("/v1/chat/completions", json=chat_body("seeded", sampling_seed=7, temperature=0.7))
    other = await client.post("/v1/chat/completions", json=chat_body("seeded", sampling_seed=8, temperature=0.7))
    assert [r.headers["x-edgecache"] for r in (first, again, other)] == ["miss", "exact", "miss"]
    assert fake_engine.requests[-1].params.seed == 8
    error = assert_openai_error(await client.post("/v1/chat/completions", json=chat_body(
        "seeded", seed=7, sampling_seed=8)), 400)
    assert error["param"] == "sampling_seed"


@pytest.mark.parametrize(("route", "field", "value"), [
    ("/v1/chat/completions", "no_stop_trim", True),
    ("/v1/chat/completions", "continue_final_message", True),
    ("/v1/chat/completions", "return_hidden_states", True),
    ("/v1/chat/completions", "return_hidden_states", "last"),
    ("/v1/chat/completions", "return_token_ids", True),
    ("/v1/chat/completions", "return_meta_info", True),
    ("/v1/chat/completions", "regex", "[a-z]+"),
    ("/v1/chat/completions", "ebnf", 'root ::= "a"'),
    ("/v1/chat/completions", "stop_regex", ["x+"]),
    ("/v1/chat/completions", "lora_path", "adapter"),
    ("/v1/chat/completions", "session_params", {"id": "s"}),
    ("/v1/chat/completions", "custom_logit_processor", "{}"),
    ("/v1/chat/completions", "input_ids", [1, 2]),
    ("/v1/completions", "no_stop_trim", True),
    ("/v1/completions", "json_schema", "{}"),
    ("/v1/completions", "regex", "a"),
    ("/v1/completions", "return_hidden_states", True),
])
async def test_sglang_s_fields_that_change_the_answer_are_400s_naming_them(
        client: httpx.AsyncClient, fake_engine: FakeEngine, route: str, field: str, value: Any) -> None:
    body = chat_body("x") if route == "/v1/chat/completions" else {"model": "fake-model", "prompt": "x"}
    error = assert_openai_error(await client.post(route, json={**body, field: value}), 400)
    assert error["param"] == field and field in error["message"], error
    assert fake_engine.calls == 0


async def test_continuous_usage_stats_and_a_completion_only_field_on_chat_are_refused(
        client: httpx.AsyncClient) -> None:
    error = assert_openai_error(await client.post("/v1/chat/completions", json=chat_body(
        "x", stream=True, stream_options={"continuous_usage_stats": True})), 400)
    assert error["param"] == "stream_options.continuous_usage_stats"
    # chat has response_format, not SGLang's completions-only json_schema: an unknown field, named
    error = assert_openai_error(await client.post("/v1/chat/completions", json=chat_body("x", json_schema="{}")), 400)
    assert error["param"] == "json_schema"
    error = assert_openai_error(await client.post("/v1/completions", json={
        "model": "fake-model", "prompt": "x", "continue_final_message": False}), 400)
    assert error["param"] == "continue_final_message"


async def test_sglang_s_router_discovery_routes(client: httpx.AsyncClient) -> None:
    for path in ("/model_info", "/get_model_info"):
        info = (await client.get(path)).json()
        assert info["served_model_name"] == info["model_id"] == "fake-model" and info["is_generation"] is True
        # a model_path would send the router to download a tokenizer
        assert "model_path" not in info and "tokenizer_path" not in info
    for path in ("/server_info", "/get_server_info"):
        info = (await client.get(path)).json()
        assert info["served_model_name"] == "fake-model" and info["dp_size"] == 1
        assert info["max_running_requests"] >= 1
    doc = (await client.get("/openapi.json")).json()
    assert {"/model_info", "/get_model_info", "/server_info", "/get_server_info"} <= set(doc["paths"])
