"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``): the request bodies, decoded
strictly, turned into the same :class:`~edgecache.engines.base.GenerationRequest` an OpenAI chat request becomes
(so one generation asked through either API has one key and one engine call), and the answer rendered in
Anthropic's shapes: a message body, its SSE events, its usage, its errors.

Each request field is one of three kinds, as on the OpenAI routes (:mod:`edgecache.http.request_surface`):

- **in the key** (it changes the output): ``system``, ``messages`` (text, ``tool_use`` and ``tool_result`` blocks),
  ``tools``, ``tool_choice``, ``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k`` and
  ``output_config.format``; the running engine must honour each one used, or the request is refused naming it;
- **accepted, not in the key** (it cannot change what this server's model writes): ``cache_control`` anywhere (a hint
  to the engine's prefix cache: what it keeps, how long, and the usage it reports; never the answer), ``metadata``, ``stream``, ``thinking`` (these models have no thinking mode
  to switch; no thinking block is returned), ``thinking`` and ``redacted_thinking`` blocks echoed back in the
  history (Anthropic drops earlier turns' thinking from the context too), ``output_config.effort``,
  ``context_management`` (this server never edits the context), ``service_tier``, ``speed``, ``inference_geo``,
  ``diagnostics``, a tool's ``eager_input_streaming``, a tool with ``defer_loading: true`` (tool search: a deferred
  tool is not in the model's context, so it is not offered), a tool result's ``is_error`` and a text block's
  ``citations`` (no chat template here renders them);
- **refused** with a 400 naming it: ``image`` and ``document`` blocks (the models are text-only), server tools
  (``web_search``, ``bash``, ``code_execution``, ...), ``mcp_servers``, ``container``, ``max_tokens: 0`` (cache
  pre-warming: use ``/admin/warmup``), and any field not listed here.

Tool calls keep the ids the engine gave them, so a ``tool_use`` block and an OpenAI tool call of one answer are
one id, and a ``tool_result`` names it back.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from edgecache.engines.base import (
    CacheBreakpoint,
    CacheHints,
    Choice,
    GenerationRequest,
    Message,
    OutputFormat,
    SamplingParams,
    ToolCall,
    ToolSpec,
)
from edgecache.errors import BadRequest, EdgeCacheError, PayloadTooLarge, PromptTooLong
from edgecache.http.calls import Parsed, build_call
from edgecache.http.replies import Counts
from edgecache.http.request_surface import MAX_STOPS, MAX_TOOLS, CacheOptions, decode_body, features_used
from edgecache.settings import Settings
from edgecache.tenants import Tenant

# --- request ----------------------------------------------------------------------------------------------------


class CacheControl(msgspec.Struct, forbid_unknown_fields=True):
    """A prompt-cache breakpoint: the engine keeps the prompt up to the end of its block at least ``ttl`` from its
    last read (5 minutes unset). Left out of the key: it changes what is kept, never an answer."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None

    @property
    def ttl_s(self) -> float:
        return 3600.0 if self.ttl == "1h" else 300.0


#: Anthropic's limit on blocks with ``cache_control`` in one request (the top-level one counts as one).
MAX_BREAKPOINTS = 4


class TextBlock(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None


class ImageBlock(msgspec.Struct, tag_field="type", tag="image", forbid_unknown_fields=True):
    source: dict[str, Any]
    cache_control: CacheControl | None = None


class DocumentBlock(msgspec.Struct, tag_field="type", tag="document", forbid_unknown_fields=True):
    source: dict[str, Any]
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking", forbid_unknown_fields=True):
    thinking: str
    signature: str | None = None
    cache_control: CacheControl | None = None


class RedactedThinkingBlock(msgspec.Struct, tag_field="type", tag="redacted_thinking", forbid_unknown_fields=True):
    data: str
    cache_control: CacheControl | None = None


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use", forbid_unknown_fields=True):
    id: Annotated[str, Meta(min_length=1)]
    name: Annotated[str, Meta(min_length=1)]
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(msgspec.Struct, tag_field="type", tag="tool_result", forbid_unknown_fields=True):
    tool_use_id: Annotated[str, Meta(min_length=1)]
    content: str | list[TextBlock | ImageBlock | DocumentBlock] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None


Block = TextBlock | ImageBlock | DocumentBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock


class MessageIn(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ClientTool(msgspec.Struct, forbid_unknown_fields=True):
    """A client tool (``type`` absent or ``custom``); server tools are refused before this is decoded."""

    name: Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]+$")]
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: CacheControl | None = None
    eager_input_streaming: bool | None = None
    # Tool search: a deferred tool is not loaded into the model's context (Claude Code sends a placeholder so
    # marked, and lists its deferred tools by name in the conversation), so it is not offered, and not in the key.
    defer_loading: bool | None = None


class ToolChoiceAuto(msgspec.Struct, tag_field="type", tag="auto", forbid_unknown_fields=True):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(msgspec.Struct, tag_field="type", tag="any", forbid_unknown_fields=True):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(msgspec.Struct, tag_field="type", tag="tool", forbid_unknown_fields=True):
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(msgspec.Struct, tag_field="type", tag="none", forbid_unknown_fields=True):
    pass


class ThinkingConfig(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class JsonOutputFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, forbid_unknown_fields=True):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class MessageMetadata(msgspec.Struct, forbid_unknown_fields=True):
    user_id: str | None = None


# Why each refused request field is refused: in the 400 and in the OpenAPI document.
_NO_MCP = "this server connects to no MCP server; run the tools client-side"
_NO_PREWARM = ("max_tokens 0 (warming the prompt cache without an answer) is not supported here; POST /admin/warmup "
               "warms the caches")
_NO_CONTAINER = "this server runs no code-execution container"
# Their schemas: what the server takes (an empty mcp_servers is not set), and why.
_NO_MCP_SERVERS = Meta(extra_json_schema={"maxItems": 0}, description=f"Refused when set: {_NO_MCP}.")
_AT_LEAST_ONE = Meta(description=f"At least 1: {_NO_PREWARM}.")
#: What the handlers check in code, for the OpenAPI document (as :data:`~edgecache.http.request_surface.SCHEMA_RULES`).
_INPUT_RULES: dict[str, Any] = {
    # Client tools only (a server tool is decoded only to be refused by name).
    "properties": {"tools": {"anyOf": [
        {"type": "array", "items": {"$ref": "#/components/schemas/ClientTool"}, "maxItems": MAX_TOOLS},
        {"type": "null"}]}},
    # tool_choice any or tool needs a tool that is offered (one not deferred).
    "if": {"required": ["tool_choice"], "properties": {"tool_choice": {
        "required": ["type"], "properties": {"type": {"enum": ["any", "tool"]}}}}},
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "contains": {
        "properties": {"defer_loading": {"enum": [False, None]}}}}}},
}
SCHEMA_RULES: dict[str, dict[str, Any]] = {
    "CountTokensRequest": _INPUT_RULES,
    "MessagesRequest": {**_INPUT_RULES, "properties": {
        **_INPUT_RULES["properties"],
        # 0 is decoded so that its refusal can say what to use instead; the schema starts at 1.
        "max_tokens": {"minimum": 1},
        # No empty stop sequence.
        "stop_sequences": {"anyOf": [
            {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOPS},
            {"type": "null"}]}}},
}
_NO_CONTAINERS = Meta(extra_json_schema={"type": "null"}, description=f"Refused when set: {_NO_CONTAINER}.")


class _MessagesInput(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What both routes read: the conversation and what the model is offered."""

    model: str
    messages: Annotated[list[MessageIn], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    # Decoded one by one (:func:`_tools`), so that a server tool is named as such instead of as unknown fields.
    tools: Annotated[list[dict[str, Any]], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone | None = None
    output_config: OutputConfig | None = None
    # Accepted and left out of the key.
    thinking: ThinkingConfig | None = None
    cache_control: CacheControl | None = None
    context_management: dict[str, Any] | None = None
    speed: Literal["standard", "fast"] | None = None
    # Refused when set (an empty list is not set): they need server-side tools this server does not run.
    mcp_servers: Annotated[list[dict[str, Any]] | None, _NO_MCP_SERVERS] = None


class MessagesRequest(_MessagesInput, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/messages``."""

    max_tokens: Annotated[int, Meta(ge=0), _AT_LEAST_ONE]
    stop_sequences: Annotated[list[str], Meta(max_length=MAX_STOPS)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    stream: bool = False
    edgecache: CacheOptions | None = None
    # Accepted and left out of the key.
    metadata: MessageMetadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    # Refused when set.
    container: Annotated[str | dict[str, Any] | None, _NO_CONTAINERS] = None


class CountTokensRequest(_MessagesInput, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/messages/count_tokens``."""


def _block_text(blocks: list[TextBlock | ImageBlock | DocumentBlock], at: str, marks: _Marks | None = None) -> str:
    """Text blocks joined as OpenAI's content parts are (``""``), so the same texts make the same key."""
    texts = []
    length = 0
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise BadRequest(f"{block.__struct_config__.tag} blocks need a multimodal model; this server's model "
                             f"is text-only: send text blocks", param=f"{at}[{j}]")
        texts.append(block.text)
        length += len(block.text)
        if marks is not None:
            marks.block(block.cache_control, length)
    return "".join(texts)


class _Marks:
    """The ``cache_control`` marks met while a request's blocks become messages: each as the message it ends in
    (its index among the messages made so far) and where in that message's text its block ends."""

    def __init__(self) -> None:
        self.marks: list[tuple[int, int | None, float]] = []  # (message, end or None for the message's end, ttl)
        self.pending: list[tuple[int, float]] = []  # (end, ttl) in the message being built

    def block(self, control: CacheControl | None, end: int) -> None:
        if control is not None:
            self.pending.append((end, control.ttl_s))

    def whole(self, control: CacheControl | None) -> None:
        """A block that ends the message being built (a tool call, a tool result)."""
        if control is not None:
            self.pending.append((-1, control.ttl_s))

    def made(self, index: int, message: Message) -> None:
        """The message being built is ``messages[index]``: its pending marks are placed."""
        for end, ttl in self.pending:
            self.marks.append((index, None if end < 0 or end >= len(message.content) else end, ttl))
        self.pending = []


def _messages(system: str | list[TextBlock] | None, turns: list[MessageIn],
              marks: _Marks | None = None) -> tuple[Message, ...]:
    marks = marks or _Marks()
    out: list[Message] = []
    if system:
        text = system if isinstance(system, str) else _block_text(list(system), "system", marks)
        if text:  # an empty system prompt and none are the same request
            out.append(Message(role="system", content=text))
            marks.made(0, out[0])
        marks.pending = []
    for i, turn in enumerate(turns):
        at = f"messages[{i}].content"
        if isinstance(turn.content, str):
            out.append(Message(role=turn.role, content=turn.content))
        elif turn.role == "assistant":
            out.append(_assistant(turn.content, at, marks))
            marks.made(len(out) - 1, out[-1])
        else:
            out.extend(_user(turn.role, turn.content, at, marks, len(out)))
    return tuple(out)


def _assistant(blocks: list[Block], at: str, marks: _Marks) -> Message:
    texts: list[str] = []
    calls: list[ToolCall] = []
    length = 0
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
            length += len(block.text)
            marks.block(block.cache_control, length)
        elif isinstance(block, ToolUseBlock):
            marks.whole(block.cache_control)
            # The engines write arguments as json.dumps does (structured_output.parse_tool_calls): the same call
            # echoed back through either API is the same text, hence the same key.
            calls.append(ToolCall(id=block.id, name=block.name,
                                  arguments=json.dumps(block.input, ensure_ascii=False)))
        elif isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
            continue  # an earlier turn's thinking: not part of the context (as on Anthropic's own API)
        else:
            raise BadRequest(f"an assistant message cannot carry {block.__struct_config__.tag} blocks",
                             param=f"{at}[{j}]")
    return Message(role="assistant", content="".join(texts), tool_calls=tuple(calls))


def _user(role: Literal["user", "system"], blocks: list[Block], at: str, marks: _Marks,
          first: int) -> list[Message]:
    """A user turn's text blocks become one user message; each tool result its own tool message, in order.
    ``first``: the index the first of them will have among the request's messages."""
    out: list[Message] = []
    texts: list[str] = []
    length = 0
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
            length += len(block.text)
            marks.block(block.cache_control, length)
        elif isinstance(block, ToolResultBlock) and role == "user":
            if texts:
                out.append(Message(role=role, content="".join(texts)))
                marks.made(first + len(out) - 1, out[-1])
                texts, length = [], 0
            content = block.content if isinstance(block.content, str) else \
                _block_text(list(block.content), f"{at}[{j}].content", marks)
            out.append(Message(role="tool", content=content, tool_call_id=block.tool_use_id))
            marks.whole(block.cache_control)
            marks.made(first + len(out) - 1, out[-1])
        elif isinstance(block, (ImageBlock, DocumentBlock)):
            raise BadRequest(f"{block.__struct_config__.tag} blocks need a multimodal model; this server's model "
                             f"is text-only: send text blocks", param=f"{at}[{j}]")
        else:
            raise BadRequest(f"a {role} message cannot carry {block.__struct_config__.tag} blocks",
                             param=f"{at}[{j}]")
    if texts or not out:
        out.append(Message(role=role, content="".join(texts)))
        marks.made(first + len(out) - 1, out[-1])
    return out


def _tools(raw: list[dict[str, Any]] | None) -> tuple[ToolSpec, ...]:
    tools = []
    for i, item in enumerate(raw or ()):
        kind = item.get("type")
        if kind not in (None, "custom"):
            raise BadRequest(f"server tools ({kind}) are not supported: this server runs no tools itself; send "
                             f"client tools (name, description, input_schema)", param=f"tools[{i}].type")
        try:
            tool = msgspec.convert(item, ClientTool)
        except msgspec.ValidationError as exc:
            raise BadRequest(f"invalid request: {exc} (in tools[{i}])", param=f"tools[{i}]") from exc
        if tool.defer_loading:
            continue
        tools.append(ToolSpec(name=tool.name, description=tool.description or "",
                              parameters=_canonical(tool.input_schema), strict=bool(tool.strict)))
    if len({t.name for t in tools}) != len(tools):
        raise BadRequest("two tools share a name", param="tools")
    return tuple(tools)


def _canonical(value: Any) -> str:
    return msgspec.json.encode(value, order="sorted").decode()


_CHOICES: dict[type, str] = {ToolChoiceAuto: "auto", ToolChoiceAny: "required", ToolChoiceNone: "none"}


def _tool_choice(req: _MessagesInput, tools: tuple[ToolSpec, ...]) -> tuple[str, bool]:
    """OpenAI's spelling of the choice (auto, required, none or the tool's name) and whether calls may be parallel,
    normalised as the chat route does: without tools neither can matter."""
    choice = req.tool_choice
    if choice is None:
        return "auto", True
    if not tools:
        if isinstance(choice, (ToolChoiceAny, ToolChoiceTool)):
            raise BadRequest(f"tool_choice {choice.__struct_config__.tag!r} needs tools", param="tool_choice")
        return "auto", True
    parallel = not getattr(choice, "disable_parallel_tool_use", None)
    if isinstance(choice, ToolChoiceTool):
        if choice.name not in {t.name for t in tools}:
            raise BadRequest(f"tool_choice names {choice.name!r}, which is not among the tools",
                             param="tool_choice.name")
        return choice.name, parallel
    return _CHOICES[type(choice)], parallel


def generation(req: _MessagesInput, *, max_tokens: int, salt: str) -> GenerationRequest:
    """The request as the pipeline keys it; the sampling of ``req`` when it is a :class:`MessagesRequest`."""
    if req.mcp_servers:
        raise BadRequest(f"mcp_servers is not supported: {_NO_MCP}", param="mcp_servers")
    tools = _tools(req.tools)
    choice, parallel = _tool_choice(req, tools)
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None and tools and choice != "none":
        raise BadRequest("output_config.format together with tools is not supported: the answer would have to be "
                         "either a tool call or the format; send one of them", param="output_config.format")
    params = SamplingParams(max_tokens=max_tokens)
    if isinstance(req, MessagesRequest):
        stops = req.stop_sequences or []
        if any(not s for s in stops):
            raise BadRequest("stop sequences must not be empty", param="stop_sequences")
        params = SamplingParams(max_tokens=max_tokens, temperature=float(req.temperature),
                                top_p=float(req.top_p) if req.top_p is not None else 1.0,
                                stop=tuple(sorted(set(stops))), top_k=req.top_k or 0)
    marks = _Marks()
    messages = _messages(req.system, req.messages, marks)
    return GenerationRequest(
        messages=messages, params=params, salt=salt, tools=tools, tool_choice=choice,
        parallel_tool_calls=parallel or not tools,
        response_format=OutputFormat(kind="json_schema", schema=_canonical(fmt.schema)) if fmt else None,
        cache=_cache_hints(req, messages, marks))


def _cache_hints(req: _MessagesInput, messages: tuple[Message, ...], marks: _Marks) -> CacheHints | None:
    """The request's ``cache_control`` marks as breakpoints, in the prompt's order (Anthropic's: tools, system,
    messages). A mark on a tool keeps the prompt up to the first message's text (where the tools, rendered in the
    system turn, end at the latest); the request's own ``cache_control`` keeps all of it. At most four."""
    points = [CacheBreakpoint(message=m, end=end, ttl_s=ttl) for m, end, ttl in marks.marks]
    tool_marks = [t.get("cache_control") for t in req.tools or () if isinstance(t.get("cache_control"), dict)]
    if tool_marks:
        ttl = max(3600.0 if mark.get("ttl") == "1h" else 300.0 for mark in tool_marks)
        points.insert(0, CacheBreakpoint(message=0, end=0, ttl_s=ttl))
    if req.cache_control is not None:
        points.append(CacheBreakpoint(message=len(messages) - 1, ttl_s=req.cache_control.ttl_s))
    count = len(marks.marks) + len(tool_marks) + (req.cache_control is not None)
    if count > MAX_BREAKPOINTS:
        raise BadRequest(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                         f"Found {count}.", param="cache_control")
    return CacheHints(breakpoints=tuple(points)) if points else None


def parse_messages(body: bytes, tenant: Tenant, settings: Settings) -> Parsed:
    """``POST /v1/messages`` to the pipeline's Call (the same Call a chat request for this generation builds)."""
    req = decode_body(body, MessagesRequest)
    if len(req.messages) > settings.server.max_messages:
        raise PayloadTooLarge(f"at most {settings.server.max_messages} messages per request")
    if req.max_tokens == 0:
        raise BadRequest(_NO_PREWARM, param="max_tokens")
    if req.container is not None:
        raise BadRequest(f"container is not supported: {_NO_CONTAINER}", param="container")
    request = generation(req, max_tokens=req.max_tokens, salt=tenant.id)
    return Parsed(call=build_call(request, req.edgecache, tenant, settings), model=req.model, chat=True,
                  stream=req.stream, include_usage=False, features=features_used(request))


def parse_count_tokens(body: bytes, tenant: Tenant, settings: Settings) -> tuple[str, GenerationRequest]:
    """``POST /v1/messages/count_tokens``: the model asked for and the generation whose prompt is counted."""
    req = decode_body(body, CountTokensRequest)
    if len(req.messages) > settings.server.max_messages:
        raise PayloadTooLarge(f"at most {settings.server.max_messages} messages per request")
    return req.model, generation(req, max_tokens=1, salt=tenant.id)


# --- response ---------------------------------------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
#: The engines' finish reasons in Anthropic's words; a ``stop`` that one of the request's stop sequences made (the
#: engine says which: :attr:`~edgecache.engines.base.Chunk.stop_sequence`) is ``stop_sequence``.
STOP_REASONS: dict[str | None, StopReason | None] = {"stop": "end_turn", "length": "max_tokens",
                                                     "tool_calls": "tool_use", None: None}


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> StopReason | None:
    return "stop_sequence" if stop_sequence is not None and finish_reason == "stop" else STOP_REASONS[finish_reason]


class CacheCreation(msgspec.Struct):
    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0


class MessageUsage(msgspec.Struct):
    """As Anthropic counts: ``cache_read_input_tokens`` is the prefix the engine read from its prefix cache (all of
    the prompt, for an answer served from a cache); ``cache_creation_input_tokens`` what this request wrote to it
    at its ``cache_control`` breakpoints (split by ttl in ``cache_creation``); ``input_tokens`` the rest."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    # None in ``message_start``, which a streamed miss sends before its counts are known: the SDKs keep that
    # event's breakdown, and a null is not a wrong figure (``message_delta`` carries the counts).
    cache_creation: CacheCreation | None = None


class TextOut(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ToolUseOut(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class MessageOut(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    model: str
    content: list[TextOut | ToolUseOut]
    stop_reason: StopReason | None
    usage: MessageUsage
    stop_sequence: str | None = None
    role: Literal["assistant"] = "assistant"


class TokenCount(msgspec.Struct):
    input_tokens: int


class AnthropicErrorDetail(msgspec.Struct):
    type: str
    message: str


class AnthropicError(msgspec.Struct, tag_field="type", tag="error"):
    """Anthropic's error body: ``{"type": "error", "error": {"type": ..., "message": ...}}``."""

    error: AnthropicErrorDetail


#: Anthropic's error type for each status this server answers with (its own 529 overloaded_error is our 503).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               504: "timeout_error"}


def error_out(error: EdgeCacheError) -> AnthropicError:
    message = error.message
    if isinstance(error, PromptTooLong):
        # Anthropic's own words, which Claude Code reads (the counts) to say the conversation is too long instead
        # of retrying the request in other shapes. The most a prompt may have is the context less the one token
        # the answer needs.
        message = (f"prompt is too long: {error.tokens} tokens > {error.context - 1} maximum ({error.message})")
    return AnthropicError(AnthropicErrorDetail(type=ERROR_TYPES.get(error.status, "api_error"), message=message))


def usage(counts: Counts) -> MessageUsage:
    long = sum(tokens for ttl, tokens in counts.writes if ttl >= 3600)
    short = sum(tokens for ttl, tokens in counts.writes if ttl < 3600)
    return MessageUsage(input_tokens=max(0, counts.prompt - counts.cached - long - short),
                        output_tokens=counts.completion, cache_creation_input_tokens=long + short,
                        cache_read_input_tokens=counts.cached,
                        cache_creation=CacheCreation(ephemeral_5m_input_tokens=short, ephemeral_1h_input_tokens=long))


def _content(choice: Choice) -> list[TextOut | ToolUseOut]:
    blocks: list[TextOut | ToolUseOut] = []
    if choice.text or not choice.tool_calls:
        blocks.append(TextOut(choice.text))
    for call in choice.tool_calls:
        arguments = json.loads(call.arguments) if call.arguments else {}
        blocks.append(ToolUseOut(id=call.id, name=call.name, input=arguments if isinstance(arguments, dict) else {}))
    return blocks


class MessageWriter:
    """Renders one answer as an Anthropic message, or as its SSE events (an
    :class:`~edgecache.http.replies.AnswerWriter`). Every event is named (``event: <type>``): the SDKs skip
    unnamed ones. ``message_start`` carries no counts yet (a streamed miss knows them only at its end), so
    ``message_delta`` carries the whole usage; the SDKs take its counts as the totals."""

    __slots__ = ("id", "model", "replay_shape")

    _encoder = msgspec.json.Encoder()
    _PING = b'event: ping\ndata: {"type": "ping"}\n\n'
    _STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'

    def __init__(self, *, model: str, message_id: str) -> None:
        self.model = model
        self.id = message_id
        self.replay_shape = ("anthropic", model)  # nothing else differs between two renderings (see AnswerWriter)

    def body(self, text: str, finish_reason: str | None, counts: Counts,
             choices: tuple[Choice, ...] | None = None, stop_sequence: str | None = None) -> bytes:
        content = _content(choices[0]) if choices else [TextOut(text)]
        reason = choices[0].finish_reason if choices else finish_reason
        stop = choices[0].stop_sequence if choices else stop_sequence
        return self._encoder.encode(MessageOut(id=self.id, model=self.model, content=content,
                                               stop_reason=stop_reason(reason, stop), usage=usage(counts),
                                               stop_sequence=stop if reason == "stop" else None))

    def _event(self, name: bytes, payload: dict[str, Any]) -> bytes:
        return b"event: " + name + b"\ndata: " + self._encoder.encode(payload) + b"\n\n"

    def _message_start(self) -> bytes:
        return self._event(b"message_start", {"type": "message_start", "message": MessageOut(
            id=self.id, model=self.model, content=[], stop_reason=None, usage=MessageUsage(0, 0))})

    def _block(self, index: int, block: TextOut | ToolUseOut) -> bytes:
        delta: dict[str, str] | None
        if isinstance(block, TextOut):
            start = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block.text} if block.text else None  # an empty text: no delta
        else:
            start = {"type": "tool_use", "id": block.id, "name": block.name, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": self._encoder.encode(block.input).decode()}
        out = self._event(b"content_block_start", {"type": "content_block_start", "index": index,
                                                   "content_block": start})
        if delta is not None:
            out += self._event(b"content_block_delta", {"type": "content_block_delta", "index": index,
                                                        "delta": delta})
        return out + self._event(b"content_block_stop", {"type": "content_block_stop", "index": index})

    def _message_end(self, finish_reason: str | None, counts: Counts, stop_sequence: str | None) -> bytes:
        stop = stop_sequence if finish_reason == "stop" else None
        return self._event(b"message_delta", {
            "type": "message_delta", "delta": {"stop_reason": stop_reason(finish_reason, stop), "stop_sequence": stop},
            "usage": usage(counts)}) + self._STOP

    def sse_start(self) -> bytes:
        return self._message_start() + self._event(b"content_block_start", {
            "type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}) + self._PING

    def sse_delta(self, text: str) -> bytes:
        return self._event(b"content_block_delta", {"type": "content_block_delta", "index": 0,
                                                    "delta": {"type": "text_delta", "text": text}})

    def sse_end(self, finish_reason: str | None, counts: Counts, stop_sequence: str | None = None) -> bytes:
        return self._event(b"content_block_stop", {"type": "content_block_stop", "index": 0}) + \
            self._message_end(finish_reason, counts, stop_sequence)

    def sse_whole(self, choices: tuple[Choice, ...], counts: Counts) -> bytes:
        """A whole answer (a tool call) at once: each block's start, its one delta (the text, or the arguments as
        one ``input_json_delta``) and its stop."""
        blocks = _content(choices[0])
        return self._message_start() + self._PING + b"".join(self._block(i, b) for i, b in enumerate(blocks)) + \
            self._message_end(choices[0].finish_reason, counts, choices[0].stop_sequence)

    def sse_error(self, error: EdgeCacheError) -> bytes:
        return b"event: error\ndata: " + self._encoder.encode(error_out(error)) + b"\n\n"
