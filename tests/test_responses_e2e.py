"""The Responses API end to end: the real `edgecache serve` (cpu profile, llama.cpp, SmolLM2) driven by the openai
SDK's ``client.responses``: a repeated request is an exact hit with the same payload, streams parse, stored
responses read back and delete, a follow-up with ``previous_response_id`` reuses the earlier turn from the engine's
prefix cache, a forced function call and its output turn, and structured output through ``responses.parse``."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from tests.real_server import LONG_SYSTEM, MODEL, Server

pytestmark = pytest.mark.e2e

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                          "required": ["city"], "additionalProperties": False}}


class Weather(BaseModel):
    city: str
    celsius: int


def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def stable(response: Any) -> dict[str, Any]:
    data = response.model_dump()
    for item in data["output"]:
        item.pop("id", None)
    return {k: v for k, v in data.items() if k not in ("id", "created_at", "usage")}


def test_create_twice_then_stream_the_hit(server: Server) -> None:
    c = sdk(server)
    request = dict(model=MODEL, input="What is the capital of France?", instructions="Answer in one sentence.",
                   temperature=0, max_output_tokens=24)
    first = c.responses.with_raw_response.create(**request)
    second = c.responses.with_raw_response.create(**request)
    assert (first.headers["x-edgecache"], second.headers["x-edgecache"]) == ("miss", "exact")
    one, two = first.parse(), second.parse()
    assert one.output_text and stable(one) == stable(two)
    assert one.usage.input_tokens > 0 and one.usage.output_tokens > 0
    assert two.usage.input_tokens_details.cached_tokens == two.usage.input_tokens
    with c.responses.stream(**request) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        streamed = stream.get_final_response() if one.status == "completed" else None
    assert "".join(deltas) == one.output_text
    if streamed is not None:
        assert streamed.output_text == one.output_text


def test_a_streamed_miss_is_stored_and_deleted(server: Server) -> None:
    c = sdk(server)
    with c.responses.stream(model=MODEL, input="Name three colours.", temperature=0, max_output_tokens=32) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds
    made_id = events[0].response.id
    got = c.responses.retrieve(made_id)
    assert got.id == made_id and got.output_text
    assert [i.content[0].text for i in c.responses.input_items.list(made_id).data] == ["Name three colours."]
    c.responses.delete(made_id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(made_id)


def test_a_follow_up_reuses_the_earlier_turn_from_the_prefix_cache(server: Server) -> None:
    c = sdk(server)
    first = c.responses.create(model=MODEL, instructions=LONG_SYSTEM, temperature=0, max_output_tokens=16,
                               input="Which series ships within three days?")
    follow = c.responses.create(model=MODEL, instructions=LONG_SYSTEM, temperature=0, max_output_tokens=16,
                                previous_response_id=first.id, input="And which carries a two-year warranty?")
    # The whole earlier prompt (and more: its answer) was not computed again.
    assert follow.usage.input_tokens > first.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_a_forced_function_call_and_its_output_turn(server: Server) -> None:
    c = sdk(server)
    called = c.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                max_output_tokens=48)
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert set(json.loads(call.arguments)) == {"city"}
    turn = dict(model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=24, previous_response_id=called.id,
                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}])
    answer = c.responses.with_raw_response.create(**turn)
    assert answer.headers["x-edgecache"] == "miss"
    assert answer.parse().output[0].type in ("message", "function_call")
    # The same turn sent whole (the call and its output as items) is the same generation: a hit.
    whole = c.responses.with_raw_response.create(
        model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=24, input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}])
    assert whole.headers["x-edgecache"] == "exact" and stable(whole.parse()) == {
        **stable(answer.parse()), "previous_response_id": None}


def test_structured_output_through_parse(server: Server) -> None:
    c = sdk(server)
    request = dict(model=MODEL, input="Give the weather in Oslo as JSON.", text_format=Weather, temperature=0,
                   max_output_tokens=48)
    first = c.responses.parse(**request)
    assert isinstance(first.output_parsed, Weather)
    raw = c.responses.with_raw_response.parse(**request)
    assert raw.headers["x-edgecache"] == "exact" and raw.parse().output_parsed == first.output_parsed
