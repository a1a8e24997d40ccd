"""The OpenAI wire format: strict request structs, and the response bodies and SSE frames we send.

Requests are decoded strictly: unknown fields are refused rather than ignored, because a field we ignored but the
caller relied on (``tools``, ``response_format``, ``logit_bias``) would make two different requests share one
cached answer. Responses are built from engine :class:`~edgecache.engines.base.Chunk` values, so a fresh answer,
a cached one and a shared one all leave through the same code.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from edgecache.engines.base import Message, SamplingParams
from edgecache.errors import BadRequest

Probability = Annotated[float, Meta(ge=0.0, le=2.0)]


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatMessageIn(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def to_message(self) -> Message:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return Message(role=self.role, content=text)


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class CacheOptions(msgspec.Struct, forbid_unknown_fields=True):
    """The ``edgecache`` body field (the openai client's ``extra_body``): how this request may use the cache."""

    scenario: str | None = None
    policy: Literal["default", "no-store", "no-cache", "exact-only", "bypass", "reuse"] | None = None
    ttl: Annotated[float, Meta(gt=0)] | None = None
    ttl_tier: Literal["realtime", "near-realtime", "static"] | None = None


class _CommonRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Probability = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    n: Annotated[int, Meta(ge=1, le=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Meta(max_length=4)] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    user: str | None = None
    # SGLang's and vLLM's per-request prefix-cache namespace. Accepted so that an EdgeCache (or any client that
    # salts) can sit in front of this one; it namespaces within the tenant, never across tenants.
    cache_salt: Annotated[str, Meta(max_length=256)] | None = None
    edgecache: CacheOptions | None = None

    def sampling(self, default_max_tokens: int, max_tokens_override: int | None = None) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens_override or self.max_tokens or default_max_tokens,
            temperature=float(self.temperature), top_p=float(self.top_p),
            # Order does not change the output, so it must not change the key.
            stop=tuple(sorted(set(stop))), seed=self.seed,
            presence_penalty=float(self.presence_penalty), frequency_penalty=float(self.frequency_penalty),
        )


class ChatCompletionRequest(_CommonRequest, kw_only=True, forbid_unknown_fields=True):
    messages: Annotated[list[ChatMessageIn], Meta(min_length=1)]
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None


class CompletionRequest(_CommonRequest, kw_only=True, forbid_unknown_fields=True):
    prompt: str


def decode_request(body: bytes, request_type: type[_CommonRequest]) -> _CommonRequest:
    """Strict decode; any problem becomes a 400 naming the field, never a traceback."""
    if not body:
        raise BadRequest("the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request: {exc}", param=_param_of(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc


def _param_of(message: str) -> str | None:
    # msgspec ends its messages with "- at `$.messages[0].role`".
    marker = "at `$."
    if marker in message:
        return message.split(marker, 1)[1].rstrip("`")
    return None


# --- responses -------------------------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatMessageOut(msgspec.Struct):
    role: str
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


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
    logprobs: None = None


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


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class IdSource:
    """Response ids: a random per-process prefix and a counter. Unique like uuid4, at a tenth of its cost."""

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._counter = itertools.count()

    def next(self, kind: Literal["chat", "text"]) -> str:
        return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{self._prefix}{next(self._counter):08x}"


class ResponseWriter:
    """Renders one answer, for one request, as a JSON body or as SSE frames.

    ``chat`` picks the chat or the text-completion shape; every frame of one response shares one id.
    """

    __slots__ = ("chat", "model", "id", "created", "include_usage", "_encoder")

    # Encoders hold no per-call state; one per class saves building one per response.
    _shared_encoder = msgspec.json.Encoder()

    def __init__(self, *, chat: bool, model: str, response_id: str, include_usage: bool = False) -> None:
        self.chat = chat
        self.model = model
        self.id = response_id
        self.created = int(time.time())
        self.include_usage = include_usage
        self._encoder = self._shared_encoder

    def body(self, text: str, finish_reason: str | None, use: Usage) -> bytes:
        if self.chat:
            return self._encoder.encode(ChatCompletion(
                id=self.id, created=self.created, model=self.model, usage=use,
                choices=[ChatChoice(index=0, message=ChatMessageOut(role="assistant", content=text),
                                    finish_reason=finish_reason)]))
        return self._encoder.encode(TextCompletion(
            id=self.id, created=self.created, model=self.model, usage=use,
            choices=[TextChoice(index=0, text=text, finish_reason=finish_reason)]))

    def _frame(self, payload: msgspec.Struct) -> bytes:
        return b"data: " + self._encoder.encode(payload) + b"\n\n"

    def sse_start(self) -> bytes:
        if not self.chat:
            return b""
        return self._frame(ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                               choices=[ChunkChoice(index=0, delta=Delta(role="assistant",
                                                                                         content=""))]))

    def sse_delta(self, text: str) -> bytes:
        if self.chat:
            return self._frame(ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                                   choices=[ChunkChoice(index=0, delta=Delta(content=text))]))
        return self._frame(TextCompletion(id=self.id, created=self.created, model=self.model,
                                          choices=[TextChoice(index=0, text=text, finish_reason=None)]))

    def sse_end(self, finish_reason: str | None, use: Usage) -> bytes:
        # The finishing frame carries usage, so every response reports cached_tokens; a caller who asked for
        # stream_options.include_usage also gets OpenAI's separate usage frame with no choices.
        if self.chat:
            out = self._frame(ChatCompletionChunk(
                id=self.id, created=self.created, model=self.model, usage=use,
                choices=[ChunkChoice(index=0, delta=Delta(), finish_reason=finish_reason)]))
            if self.include_usage:
                out += self._frame(ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                                       choices=[], usage=use))
        else:
            out = self._frame(TextCompletion(id=self.id, created=self.created, model=self.model, usage=use,
                                             choices=[TextChoice(index=0, text="", finish_reason=finish_reason)]))
            if self.include_usage:
                out += self._frame(TextCompletion(id=self.id, created=self.created, model=self.model,
                                                  choices=[], usage=use))
        return out + b"data: [DONE]\n\n"

    def sse_error(self, body: bytes) -> bytes:
        return b"data: " + body + b"\n\ndata: [DONE]\n\n"
