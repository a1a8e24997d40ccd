"""A stored answer's rendering made once (:class:`~edgecache.http.replies.Renderings`): the bytes a hit writes are
the bytes the streaming path writes for the same answer, for every answer kind and every API's writer (Chat and
Completions, Responses), and each response has its own id (and a Response its own item ids and stored copy)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest

from edgecache.call import Call
from edgecache.engines.base import Choice, GenerationRequest, Message, TokenLogprob, ToolCall, TopLogprob
from edgecache.http.openai_api import ResponseWriter
from edgecache.http.replies import AnswerWriter, Counts, Renderings, _sse, render_answer
from edgecache.http.request_surface import ChatMessageIn
from edgecache.http.responses_api import (
    FunctionTool,
    NamespaceTool,
    ResponseObject,
    ResponsesWriter,
    TextFormat,
    TextOut,
)
from edgecache.pipeline import Reply, replay
from edgecache.stores import CachedAnswer
from tests.conftest import chat_body

NOW = 1_764_730_000.0


def answer(text: str = "Paris.", choices: tuple[Choice, ...] | None = None, finish: str = "stop") -> CachedAnswer:
    return CachedAnswer(text=text, finish_reason=finish, prompt_tokens=40, completion_tokens=3, created_at=NOW,
                        expires_at=NOW + 3600, choices=choices)


LOGPROBS = (TokenLogprob("Par", -0.1, (80, 97, 114), (TopLogprob("Par", -0.1, (80, 97, 114)), TopLogprob("Lon", -2.5))),
            TokenLogprob("is.", -0.01, None, ()))
KINDS = {
    "plain": answer(),
    "plain, quotes and unicode": answer('He said "ok"\n— née ✓'),
    "empty text": answer(""),
    "length": answer("cut", finish="length"),
    "tool call": answer("", (Choice(0, "", "tool_calls", (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),
                                                          ToolCall("call_2", "get_time", "{}"))),)),
    "structured": answer('{"city": "Oslo", "celsius": 4}'),
    "n = 3": answer("a", (Choice(0, "a", "stop"), Choice(1, "b", "length"), Choice(2, "", "stop"))),
    "logprobs": answer("Paris.", (Choice(0, "Paris.", "stop", (), LOGPROBS),)),
    "refusal": answer("", (Choice(0, "", "stop", refusal="I cannot help with that."),)),
}


class _Metrics:
    def observe_request(self, *args: Any) -> None:
        pass


class _Ledger:
    def request(self, *args: Any, **kwargs: Any) -> None:
        pass


class _Runtime:
    metrics = _Metrics()
    ledger = _Ledger()


async def old_stream(writer: AnswerWriter, stored: CachedAnswer) -> bytes:
    """What the streaming path writes for a stored answer: its replay's chunks through the SSE renderer."""
    call = Call(request=GenerationRequest(messages=(Message(role="user", content="q"),)), tenant="t")
    chunks = replay(stored)
    first = await anext(chunks)
    frames: AsyncIterator[bytes] = _sse(_Runtime(), call, Reply(served="exact", answer=stored), writer, first,  # type: ignore[arg-type]
                                        chunks, 0.0)
    return b"".join([frame async for frame in frames])


def writer(chat: bool = True, include_usage: bool = False, response_id: str = "chatcmpl-x1") -> ResponseWriter:
    return ResponseWriter(chat=chat, model="m", response_id=response_id, include_usage=include_usage)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "text"])
@pytest.mark.parametrize("include_usage", [False, True], ids=["", "usage"])
async def test_a_streamed_hit_writes_what_the_streaming_path_writes(kind: str, chat: bool,
                                                                     include_usage: bool) -> None:
    stored = KINDS[kind]
    renderings = Renderings()
    first = writer(chat, include_usage)
    for response_id in ("chatcmpl-first", "chatcmpl-second"):  # the second is served from the memo
        w, before = writer(chat, include_usage, response_id), writer(chat, include_usage, response_id)
        # All in the first writer's second (writers made a second apart are rightly two shapes), so the second
        # response is served from the memo and the bytes compare whole.
        w.created = before.created = first.created
        w.replay_shape = before.replay_shape = first.replay_shape
        old = await old_stream(before, stored)
        assert renderings.render(w, stored, stream=True) == old
        assert response_id.encode() in old
    assert len(renderings) == 1


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "text"])
def test_a_json_hit_writes_what_the_writer_renders(kind: str, chat: bool) -> None:
    stored = KINDS[kind]
    renderings = Renderings()
    for response_id in ("cmpl-a", "cmpl-b"):
        w, fresh_writer = writer(chat, response_id=response_id), writer(chat, response_id=response_id)
        fresh_writer.created = w.created
        counts = Counts(stored.prompt_tokens, stored.completion_tokens, stored.prompt_tokens)
        fresh = fresh_writer.body(stored.text, stored.finish_reason, counts, stored.choices)
        assert renderings.render(w, stored, stream=False) == fresh
        assert json.loads(fresh)["id"] == response_id


def test_an_entry_written_before_choices_existed_still_replays() -> None:
    """Entries stored before ``choices`` was a field decode as plain answers and render like any plain answer."""
    old_entry = msgspec.json.encode(["Paris.", "stop", 40, 3, NOW, NOW + 3600])
    stored = msgspec.json.decode(old_entry, type=CachedAnswer)
    assert stored.choices is None
    out = Renderings().render(writer(), stored, stream=True)
    assert out == render_answer(writer(), stored, stream=True)
    assert b'"content":"Paris."' in out and out.endswith(b"data: [DONE]\n\n")


def test_renderings_are_kept_per_writer_shape_and_bounded() -> None:
    stored = answer()
    renderings = Renderings(max_entries=2)
    plain, usage = writer(), writer(include_usage=True)
    assert b'"usage":{' not in renderings.render(plain, stored, stream=True)
    assert b'"usage":{' in renderings.render(usage, stored, stream=True)
    assert len(renderings) == 2
    other = answer("Rome.")
    assert b"Rome." in renderings.render(plain, other, stream=False)
    assert len(renderings) == 2  # the oldest went
    renderings.clear()
    assert len(renderings) == 0 and renderings.bytes == 0


def test_a_writer_without_a_shape_renders_each_time() -> None:
    class Shapeless(ResponseWriter):
        __slots__ = ()

    w = Shapeless(chat=True, model="m", response_id="chatcmpl-s")
    w.replay_shape = None
    renderings = Renderings()
    assert renderings.render(w, answer(), stream=False) == writer(response_id="chatcmpl-s").body(
        "Paris.", "stop", Counts(40, 3, 40))
    assert len(renderings) == 0


def test_an_id_in_the_answer_text_is_not_the_response_id() -> None:
    """The id is put where the writer put it, never where an answer's text happens to say something alike."""
    stored = answer("chatcmpl-first was the last reply's id")
    renderings = Renderings()
    renderings.render(writer(response_id="chatcmpl-first"), stored, stream=False)
    second = json.loads(renderings.render(writer(response_id="chatcmpl-other"), stored, stream=False))
    assert second["id"] == "chatcmpl-other"
    assert second["choices"][0]["message"]["content"] == "chatcmpl-first was the last reply's id"


async def test_streamed_hits_over_http_carry_their_own_ids(client: httpx.AsyncClient) -> None:
    await client.post("/v1/chat/completions", json=chat_body("twice"))
    ids = []
    for _ in range(2):
        resp = await client.post("/v1/chat/completions", json=chat_body("twice", stream=True))
        assert resp.headers["x-edgecache"] == "exact"
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["cache-control"] == "no-cache"
        frames = [json.loads(f[6:]) for f in resp.text.split("\n\n") if f.startswith("data: {")]
        assert "".join(f["choices"][0]["delta"].get("content") or "" for f in frames) == "answer to: twice"
        assert len({f["id"] for f in frames}) == 1
        ids.append(frames[0]["id"])
    assert ids[0] != ids[1]
    assert len(client.app.state.front.renderings) == 1  # type: ignore[attr-defined]


# --- Responses: the same, with the item ids that carry the response id's tail and the copy each response stores ---

Kept = list[tuple[str, bytes, ChatMessageIn]]
RESPONSE_KINDS = ("plain", "plain, quotes and unicode", "empty text", "length", "tool call", "structured", "refusal")
STRUCTURED = TextOut(format=TextFormat(type="json_schema", name="weather", schema_={"type": "object"}, strict=True))


def responses_writer(kind: str, response_id: str, store: bool, kept: Kept, created_at: int) -> ResponsesWriter:
    """A writer as :meth:`ResponsesApi.writer` builds one; ``kept`` collects what it stores."""
    template = ResponseObject(
        id=response_id, created_at=created_at, status="completed", model="m", store=store, max_output_tokens=48,
        text=STRUCTURED if kind == "structured" else TextOut(),
        tools=[FunctionTool(name="get_weather", parameters={"type": "object"}, strict=True),
               NamespaceTool(name="clock", tools=[FunctionTool(name="get_time", strict=True)])])
    keep = (lambda response_id, body, said: kept.append((response_id, body, said))) if store else None
    return ResponsesWriter(template, keep, shape=msgspec.json.encode(template.text))


def hit(renderings: Renderings, writer: ResponsesWriter, stored: CachedAnswer, stream: bool) -> bytes:
    """What :func:`~edgecache.http.replies.respond` does for a hit: the rendering, then the writer's replayed."""
    out = renderings.render(writer, stored, stream)
    if writer.replayed is not None:
        writer.replayed(stored, renderings.render(writer, stored, False) if stream else out)
    return out


@pytest.mark.parametrize("kind", RESPONSE_KINDS)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("store", [True, False], ids=["stored", "unstored"])
async def test_a_responses_hit_writes_and_stores_what_the_streaming_path_does(kind: str, stream: bool,
                                                                               store: bool) -> None:
    stored = KINDS[kind]
    renderings = Renderings()
    seen: set[bytes] = set()
    for response_id in ("resp_first", "resp_second", "resp_third"):  # the later ones are served from the memo
        kept_hit: Kept = []
        kept_fresh: Kept = []
        now = int(NOW)
        w = responses_writer(kind, response_id, store, kept_hit, now)
        fresh = responses_writer(kind, response_id, store, kept_fresh, now)
        if stream:
            expected = await old_stream(fresh, stored)
        else:
            counts = Counts(stored.prompt_tokens, stored.completion_tokens, stored.prompt_tokens)
            expected = fresh.body(stored.text, stored.finish_reason, counts, stored.choices)
        out = hit(renderings, w, stored, stream)
        assert out == expected  # byte for byte: the same id and time, so nothing is set aside
        assert out not in seen  # each response its own bytes (its id in the response and its items)
        seen.add(out)
        assert kept_hit == kept_fresh and len(kept_hit) == (1 if store else 0)  # the same stored copy, once
        if store:
            (kept_id, body, said), = kept_hit
            response = json.loads(body)
            assert kept_id == response["id"] == response_id
            assert all(item["id"].startswith(("msg_second", "fc_second", "msg_third", "fc_third", "msg_first",
                                              "fc_first")) and response_id[5:] in item["id"]
                       for item in response["output"])
            if kind == "tool call":
                assert [item.get("namespace") for item in response["output"]] == [None, "clock"]
                assert said.tool_calls and [c.function.name for c in said.tool_calls] == ["get_weather", "get_time"]
            else:
                assert said.content == (stored.choices[0].text if stored.choices else stored.text)
    assert len(renderings) == (2 if store and stream else 1)  # the stream, and the JSON body a stored hit keeps
    assert (w.replayed is None) is (not store)  # an unstored hit does nothing besides its rendering


async def test_responses_renderings_are_per_shape_and_per_second() -> None:
    """A Response echoes the request's settings and carries its time: writers that differ in either are not
    served one rendering."""
    stored = answer()
    renderings = Renderings()
    plain = json.loads(renderings.render(responses_writer("plain", "resp_a", False, [], 100), stored, False))
    structured = json.loads(renderings.render(responses_writer("structured", "resp_b", False, [], 100), stored,
                                              False))
    later = json.loads(renderings.render(responses_writer("plain", "resp_c", False, [], 101), stored, False))
    assert plain["text"]["format"]["type"] == "text" and structured["text"]["format"]["type"] == "json_schema"
    assert (plain["created_at"], later["created_at"]) == (100, 101)
    assert len(renderings) == 3
