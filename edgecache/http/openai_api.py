"""The OpenAI wire format: the response bodies and SSE frames we send (the request structs are in
:mod:`edgecache.http.request_surface`).

Responses are built from engine :class:`~edgecache.engines.base.Chunk` values, or from a stored answer's
:class:`~edgecache.engines.base.Choice` list, so a fresh answer, a cached one and a shared one all leave through
the same code and in the same shape: a plain answer (one text choice) as today's bodies and deltas; a whole answer
(tool calls, logprobs, several choices) with every choice, tool call and logprob, streamed or not.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from typing import ClassVar, Literal

import msgspec

from edgecache.engines.base import Choice, TokenLogprob
from edgecache.errors import EdgeCacheError, error_body
from edgecache.http.replies import Counts
from edgecache.http.request_surface import (
    CacheOptions,
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
    decode_request,
)

# The request structs live in request_surface; re-exported here, where callers have always found them.
__all__ = ["CacheOptions", "ChatCompletionRequest", "CompletionRequest", "StreamOptions", "decode_request"]


# --- responses -------------------------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class FunctionOut(msgspec.Struct):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionOut
    type: str = "function"


class ChatMessageOut(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    refusal: str | None = None


class TopLogprobOut(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprobOut] | None
    refusal: None = None


class TextLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class ToolCallDelta(msgspec.Struct):
    index: int
    id: str
    function: FunctionOut
    type: str = "function"


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    refusal: str | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class TextChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: TextLogprobs | None = None


class TextCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "edgecache"
    object: str = "model"


def _chat_logprobs(tokens: tuple[TokenLogprob, ...] | None) -> ChatLogprobs | None:
    if tokens is None:
        return None
    return ChatLogprobs(content=[
        TokenLogprobOut(token=t.token, logprob=t.logprob, bytes=list(t.bytes) if t.bytes is not None else None,
                        top_logprobs=[TopLogprobOut(token=a.token, logprob=a.logprob,
                                                    bytes=list(a.bytes) if a.bytes is not None else None)
                                      for a in t.top])
        for t in tokens])


def _text_logprobs(tokens: tuple[TokenLogprob, ...] | None) -> TextLogprobs | None:
    if tokens is None:
        return None
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t.token)
    return TextLogprobs(tokens=[t.token for t in tokens], token_logprobs=[t.logprob for t in tokens],
                        top_logprobs=[{a.token: a.logprob for a in t.top} for t in tokens], text_offset=offsets)


def _tool_calls(choice: Choice) -> list[ToolCallOut] | None:
    if not choice.tool_calls:
        return None
    return [ToolCallOut(id=c.id, function=FunctionOut(name=c.name, arguments=c.arguments))
            for c in choice.tool_calls]


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ModelInfo(msgspec.Struct):
    """``GET /model_info`` (and SGLang's older ``/get_model_info``), as SGLang's router reads it when it registers
    a worker. No ``model_path`` or ``tokenizer_path``: the router would take either for a Hugging Face repository
    and try to download its tokenizer; it routes by text and needs none."""

    model_id: str
    served_model_name: str
    weight_version: str
    is_generation: bool = True
    has_image_understanding: bool = False
    has_audio_understanding: bool = False


class ServerInfo(msgspec.Struct):
    """``GET /server_info`` (and ``/get_server_info``): what SGLang's router reads of a worker at registration
    (the served model's name, one data-parallel rank, how many requests it runs at once)."""

    served_model_name: str
    version: str
    dp_size: int
    max_running_requests: int


def usage(counts: Counts) -> Usage:
    return Usage(prompt_tokens=counts.prompt, completion_tokens=counts.completion,
                 total_tokens=counts.prompt + counts.completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=counts.cached))


class IdSource:
    """Response ids: a counter hashed under a random per-process key (BLAKE2b, 96 bits). Unique, and unguessable
    from any other id: no tenant can tell from its own ids how many others were answered between them."""

    def __init__(self) -> None:
        self._key = os.urandom(16)
        self._counter = itertools.count()

    # Each API's own spelling: OpenAI's chatcmpl-/cmpl-/resp_, Anthropic's msg_.
    _KINDS: ClassVar[dict[str, str]] = {"chat": "chatcmpl-", "text": "cmpl-", "response": "resp_", "message": "msg_"}

    def next(self, kind: Literal["chat", "text", "response", "message"]) -> str:
        digest = hashlib.blake2b(next(self._counter).to_bytes(8, "little"), key=self._key, digest_size=12)
        return self._KINDS[kind] + digest.hexdigest()


class ResponseWriter:
    """Renders one answer, for one request, as a JSON body or as SSE frames (an
    :class:`~edgecache.http.replies.AnswerWriter` for OpenAI's Chat Completions and Completions).

    ``chat`` picks the chat or the text-completion shape; every frame of one response shares one id.
    """

    __slots__ = ("_delta_around", "_encoder", "chat", "created", "id", "include_usage", "model", "replay_shape")

    # Encoders hold no per-call state; one per class saves building one per response.
    _shared_encoder = msgspec.json.Encoder()

    def __init__(self, *, chat: bool, model: str, response_id: str, include_usage: bool = False) -> None:
        self.chat = chat
        self.model = model
        self.id = response_id
        self.created = int(time.time())
        self.include_usage = include_usage
        self.replay_shape = (chat, model, include_usage, self.created)  # all but the id (see AnswerWriter)
        self._encoder = self._shared_encoder
        self._delta_around: tuple[bytes, bytes] | None = None  # a text frame's bytes before and after its text

    def body(self, text: str, finish_reason: str | None, counts: Counts,
             choices: tuple[Choice, ...] | None = None, stop_sequence: str | None = None) -> bytes:
        use = usage(counts)
        if choices is not None:
            return self._whole_body(choices, use)
        if self.chat:
            return self._encoder.encode(ChatCompletion(
                id=self.id, created=self.created, model=self.model, usage=use,
                choices=[ChatChoice(index=0, message=ChatMessageOut(role="assistant", content=text),
                                    finish_reason=finish_reason)]))
        return self._encoder.encode(TextCompletion(
            id=self.id, created=self.created, model=self.model, usage=use,
            choices=[TextChoice(index=0, text=text, finish_reason=finish_reason)]))

    def _whole_body(self, choices: tuple[Choice, ...], use: Usage) -> bytes:
        if self.chat:
            return self._encoder.encode(ChatCompletion(
                id=self.id, created=self.created, model=self.model, usage=use,
                choices=[ChatChoice(index=c.index, finish_reason=c.finish_reason, logprobs=_chat_logprobs(c.logprobs),
                                    message=ChatMessageOut(role="assistant", refusal=c.refusal,
                                                           content=c.text if c.text or not c.tool_calls else None,
                                                           tool_calls=_tool_calls(c)))
                         for c in choices]))
        return self._encoder.encode(TextCompletion(
            id=self.id, created=self.created, model=self.model, usage=use,
            choices=[TextChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                                logprobs=_text_logprobs(c.logprobs)) for c in choices]))

    def sse_whole(self, choices: tuple[Choice, ...], counts: Counts) -> bytes:
        """A whole answer as one SSE stream: per choice its content (with its logprobs), its tool calls as
        OpenAI's tool-call deltas (index, id, name, arguments), its finish; then usage if asked, then [DONE]."""
        frames = []
        head = {"id": self.id, "created": self.created, "model": self.model}
        for c in choices:
            if self.chat:
                content = c.text if c.text or not c.tool_calls else None
                frames.append(self._frame(ChatCompletionChunk(**head, choices=[ChunkChoice(
                    index=c.index, delta=Delta(role="assistant", content=content, refusal=c.refusal),
                    logprobs=_chat_logprobs(c.logprobs))])))
                for j, call in enumerate(c.tool_calls):
                    frames.append(self._frame(ChatCompletionChunk(**head, choices=[ChunkChoice(
                        index=c.index, delta=Delta(tool_calls=[ToolCallDelta(
                            index=j, id=call.id, function=FunctionOut(name=call.name, arguments=call.arguments))]))])))
                frames.append(self._frame(ChatCompletionChunk(**head, choices=[ChunkChoice(
                    index=c.index, delta=Delta(), finish_reason=c.finish_reason)])))
            else:
                frames.append(self._frame(TextCompletion(**head, choices=[TextChoice(
                    index=c.index, text=c.text, finish_reason=c.finish_reason,
                    logprobs=_text_logprobs(c.logprobs))])))
        if self.include_usage:
            frames.append(self._usage_frame(usage(counts)))
        return b"".join(frames) + b"data: [DONE]\n\n"

    def _usage_frame(self, use: Usage) -> bytes:
        if self.chat:
            return self._frame(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                                   usage=use))
        return self._frame(TextCompletion(id=self.id, created=self.created, model=self.model, choices=[],
                                          usage=use))

    def _frame(self, payload: msgspec.Struct) -> bytes:
        return b"data: " + self._encoder.encode(payload) + b"\n\n"

    def sse_start(self) -> bytes:
        if not self.chat:
            return b""
        return self._frame(ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                               choices=[ChunkChoice(index=0, delta=Delta(role="assistant",
                                                                                         content=""))]))

    def sse_delta(self, text: str) -> bytes:
        # A text frame is the same bytes around its text every time: made once per response (the frame with an
        # empty text, cut at the text), each delta is then one string encode and a join, not a struct per token.
        # (The field's name is part of the cut: a model name's quotes are escaped, so it cannot match there.)
        if self._delta_around is None:
            field = b'"content":' if self.chat else b'"text":'
            head, tail = self._delta_frame("").split(field + b'""', 1)
            self._delta_around = (head + field, tail)
        head, tail = self._delta_around
        return head + self._encoder.encode(text) + tail

    def _delta_frame(self, text: str) -> bytes:
        if self.chat:
            return self._frame(ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                                   choices=[ChunkChoice(index=0, delta=Delta(content=text))]))
        return self._frame(TextCompletion(id=self.id, created=self.created, model=self.model,
                                          choices=[TextChoice(index=0, text=text, finish_reason=None)]))

    def sse_end(self, finish_reason: str | None, counts: Counts, stop_sequence: str | None = None) -> bytes:
        # Usage travels only in OpenAI's separate usage frame (no choices), and only when the caller asked for it
        # with stream_options.include_usage: a client that did not ask may not expect a choiceless frame.
        if self.chat:
            out = self._frame(ChatCompletionChunk(
                id=self.id, created=self.created, model=self.model,
                choices=[ChunkChoice(index=0, delta=Delta(), finish_reason=finish_reason)]))
        else:
            out = self._frame(TextCompletion(id=self.id, created=self.created, model=self.model,
                                             choices=[TextChoice(index=0, text="", finish_reason=finish_reason)]))
        if self.include_usage:
            out += self._usage_frame(usage(counts))
        return out + b"data: [DONE]\n\n"

    def sse_error(self, error: EdgeCacheError) -> bytes:
        return b"data: " + self._encoder.encode(error_body(error)) + b"\n\ndata: [DONE]\n\n"
