"""EdgeCache fronting a real upstream: a second `edgecache serve` (cpu profile, real llama.cpp engine) is the upstream,
and a front `edgecache serve --upstream URL` caches in front of it. The official openai client talks to the front."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import front_server
from tests.real_server import Server

pytestmark = pytest.mark.e2e


class Instance(Server):
    """The e2e Server helper, with the upstream's engine-call count."""

    def engine_calls(self) -> int:
        return int(self.stats()["engine"]["calls"])


#: The upstream runs with the semantic layer off, as front_server runs the front: a miss at the front is a miss at the
#: upstream, and the pair stays light.
LIGHT = {"EDGECACHE_SEMANTIC__ENABLED": "false"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Instance, Server]]:
    root = tmp_path_factory.mktemp("upstream-e2e")
    upstream = Instance(root / "upstream", env=LIGHT).start()
    try:
        with front_server(root / "front", upstream.url + "/v1", "--upstream-key", "sk-upstream") as front:
            yield upstream, front
    finally:
        upstream.stop()


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_front_serves_the_upstream_model(pair: tuple[Instance, Server]) -> None:
    upstream, front = pair
    upstream_ids = [m.id for m in client(upstream).models.list()]
    assert [m.id for m in client(front).models.list()] == upstream_ids[:1]
    assert front.stats()["model"]["id"] == upstream_ids[0]


def test_non_stream_miss_then_exact_without_reaching_the_upstream(pair: tuple[Instance, Server]) -> None:
    upstream, front = pair
    c = client(front)
    body = {"model": client(front).models.list().data[0].id, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    calls_before = upstream.engine_calls()
    first = c.chat.completions.with_raw_response.create(**body)
    assert first.headers["x-edgecache"] == "miss"
    answer = first.parse()
    assert answer.choices[0].message.content
    assert answer.usage.completion_tokens > 0  # usage travelled from the upstream's engine
    assert upstream.engine_calls() == calls_before + 1

    second = c.chat.completions.with_raw_response.create(**body)
    assert second.headers["x-edgecache"] == "exact"
    assert second.parse().choices[0].message.content == answer.choices[0].message.content
    assert upstream.engine_calls() == calls_before + 1  # the exact hit never left the front


def test_stream_miss_then_exact(pair: tuple[Instance, Server]) -> None:
    upstream, front = pair
    c = client(front)
    model = c.models.list().data[0].id
    request = {"model": model, "max_tokens": 8, "temperature": 0, "stream": True,
               "messages": [{"role": "user", "content": "Name a colour."}]}
    calls_before = upstream.engine_calls()
    with c.chat.completions.with_streaming_response.create(**request) as resp:
        assert resp.headers["x-edgecache"] == "miss"
        pieces = [chunk.choices[0].delta.content or "" for chunk in resp.parse() if chunk.choices]
    streamed = "".join(pieces)
    assert streamed
    assert len([p for p in pieces if p]) > 1, "a miss streams through token by token"
    assert upstream.engine_calls() == calls_before + 1

    with c.chat.completions.with_streaming_response.create(**request) as resp:
        assert resp.headers["x-edgecache"] == "exact"
        again = "".join(chunk.choices[0].delta.content or "" for chunk in resp.parse() if chunk.choices)
    assert again == streamed
    # The stored answer replays to a non-streaming client too.
    whole = c.chat.completions.with_raw_response.create(**{**request, "stream": False})
    assert whole.headers["x-edgecache"] == "exact"
    assert whole.parse().choices[0].message.content == streamed
    assert upstream.engine_calls() == calls_before + 1


def test_completions_pass_through(pair: tuple[Instance, Server]) -> None:
    _, front = pair
    c = client(front)
    model = c.models.list().data[0].id
    raw = c.completions.with_raw_response.create(model=model, prompt="The sky is", max_tokens=5, temperature=0)
    assert raw.headers["x-edgecache"] == "miss"
    assert raw.parse().choices[0].text


def test_tools_and_a_json_schema_through_the_front(pair: tuple[Instance, Server]) -> None:
    """The front passes tools and a schema through; the upstream (an EdgeCache on llama.cpp) honours them; the
    front stores the whole answer and replays it."""
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    upstream, front = pair
    c = client(front)
    model = c.models.list().data[0].id
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"]}}}
    request = dict(model=model, messages=[{"role": "user", "content": "Weather in Lisbon?"}], tools=[tool],
                   tool_choice="required", temperature=0, max_tokens=48)
    calls_before = upstream.engine_calls()
    first = c.chat.completions.with_raw_response.create(**request)
    second = c.chat.completions.with_raw_response.create(**request)
    assert (first.headers["x-edgecache"], second.headers["x-edgecache"]) == ("miss", "exact")
    call = first.parse().choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    assert second.parse().choices[0].message.tool_calls[0].id == call.id
    assert first.parse().usage.prompt_tokens > 0

    parsed = c.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Lisbon as JSON."}],
                                      response_format=City, temperature=0, max_tokens=48)
    assert isinstance(parsed.choices[0].message.parsed, City)
    assert upstream.engine_calls() == calls_before + 2


def test_upstream_down_is_a_clean_502(tmp_path: Path) -> None:
    upstream = Instance(tmp_path / "upstream", env=LIGHT).start()
    try:
        with front_server(tmp_path / "front", upstream.url + "/v1") as front:
            model = client(front).models.list().data[0].id
            upstream.stop()  # the upstream goes away after the front has started
            body = {"model": model, "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "user", "content": "Are you there?"}]}
            plain = httpx.post(front.url + "/v1/chat/completions", json=body, timeout=60)
            assert plain.status_code == 502
            error = plain.json()["error"]
            assert error["message"] and "upstream" in error["message"]
            assert "Traceback" not in plain.text

            streamed = httpx.post(front.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60)
            assert streamed.status_code == 502
            assert "error" in streamed.json() and "Traceback" not in streamed.text

            with pytest.raises(openai.APIStatusError) as caught:
                client(front).chat.completions.create(**body)
            assert caught.value.status_code == 502

            # Nothing was stored: the front still misses (and still fails) on the same request.
            again = httpx.post(front.url + "/v1/chat/completions", json=body, timeout=60)
            assert again.status_code == 502 and again.headers.get("x-edgecache") != "exact"
            assert front.stats()["store"]["entries"] == 0
    finally:
        upstream.stop()
