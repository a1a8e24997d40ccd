"""The OpenAI Responses API: ``POST /v1/responses`` and the responses it stores.

A thin adapter. A Responses request becomes the chat request that asks the same thing: ``instructions`` is the
system message; ``input`` the messages, its ``function_call`` items the assistant's ``tool_calls`` and its
``function_call_output`` items the tool messages; ``previous_response_id`` puts the stored conversation first;
``text.format`` is the ``response_format``, ``max_output_tokens`` the ``max_tokens``. From there chat's own code
builds the call (:func:`edgecache.http.calls.parsed_from`), so the same generation asked through chat or Responses
has one key and one engine call. :class:`ResponsesWriter` renders the answer as a Response object or as the
Responses event stream, and hands each complete answer to the :class:`~edgecache.http.response_store.ResponseStore`.

Each field is one of three kinds (docs/api.md lists them):

- **in the key**: ``input``, ``instructions``, ``previous_response_id`` (the conversation it brings), function
  ``tools`` (also inside ``namespace`` tools, whose own name and description the model is not shown), ``tool_choice`` (incl. ``allowed_tools``), ``parallel_tool_calls`` (with tools), ``text.format``,
  ``max_output_tokens``, ``temperature``, ``top_p``, ``seed``, and, as on chat, ``reasoning.effort`` and
  ``text.verbosity`` (chat-template variables);
- **accepted, out of the key** (they cannot change what the model writes): ``store``, ``stream``,
  ``stream_options``, ``metadata``, ``user``, ``safety_identifier``, ``prompt_cache_key``,
  ``prompt_cache_retention``, ``include``, ``reasoning.summary``, ``truncation``, ``service_tier``,
  ``client_metadata``, ``max_tool_calls`` (it counts built-in tool calls), items' ``id``, ``status`` and ``phase``,
  a ``function_call`` item's ``namespace``,
  ``reasoning`` input items (this model reads none), ``prompt_cache_breakpoint`` on text parts (the engine's
  prefix cache is automatic);
- **refused** with a 400 naming the field: built-in tools (web search, file search, computer use, code
  interpreter, MCP, shell, ...) and custom tools, ``background: true``, ``conversation``, ``prompt``,
  ``top_logprobs``, image, file and audio input, ``item_reference`` items; an unknown field, as OpenAI answers.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import Meta

from edgecache.engines.base import Choice
from edgecache.errors import BadRequest, EdgeCacheError, NotFound, PayloadTooLarge
from edgecache.http.calls import Parsed, ParsedRequests, parsed_from
from edgecache.http.replies import Counts, id_tail
from edgecache.http.request_surface import (
    MAX_TOOLS,
    AllowedTools,
    AllowedToolsChoice,
    CacheOptions,
    ChatCompletionRequest,
    ChatMessageIn,
    FunctionCallIn,
    FunctionDef,
    JsonSchemaIn,
    NamedFunction,
    NamedToolChoice,
    Probability,
    ResponseFormatIn,
    ToolCallIn,
    ToolIn,
    decode_body,
)
from edgecache.http.response_store import ResponseStore, StoredResponse, keeps, open_response_store
from edgecache.settings import Settings
from edgecache.stores import CachedAnswer
from edgecache.tenants import Tenant

if TYPE_CHECKING:
    from edgecache.fleet import Fleet

ROUTE = "responses"  # this API's requests in the front's ParsedRequests
MAX_ITEMS = 2048  # input items per request; server.max_messages bounds the conversation they make

log = logging.getLogger("edgecache")

_json = msgspec.json.Encoder()


# --- the request ---------------------------------------------------------------------------------------------------


class InputPart(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A part of an input message's content. Only text (and an assistant's refusal) reaches a text-only model."""

    type: Literal["input_text", "output_text", "refusal", "input_image", "input_file", "input_audio"]
    text: str | None = None
    refusal: str | None = None
    # Accepted, no effect: what a client echoes back of an earlier output, and explicit cache breakpoints (the
    # engine's prefix cache is automatic).
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None
    # Refused: the model is text-only.
    image_url: str | None = None
    file_id: str | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None
    detail: str | None = None
    input_audio: dict[str, Any] | None = None


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class MessageItem(msgspec.Struct, forbid_unknown_fields=True):
    """An input message (``type`` may be left out), or an assistant's earlier output message sent back."""

    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]
    type: Literal["message"] = "message"
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(msgspec.Struct, forbid_unknown_fields=True):
    """A function call the model made earlier, sent back as history."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None
    # The namespace tool the function belongs to: its name already says which function it was (names are unique
    # across namespaces here), so it is accepted and left out of the key.
    namespace: str | None = None


class FunctionCallOutputItem(msgspec.Struct, forbid_unknown_fields=True):
    """The caller's result of a function call."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputPart]
    id: str | None = None
    status: ItemStatus | None = None


class ReasoningItem(msgspec.Struct, forbid_unknown_fields=True):
    """Another model's reasoning, sent back as history: accepted and left out (this model reads none)."""

    type: Literal["reasoning"]
    summary: list[Any] = []
    id: str | None = None
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None


#: The input items this server reads; the request's ``input`` is a list of these (or a string).
INPUT_ITEMS: tuple[type, ...] = (MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem)


class _Typed(msgspec.Struct):
    """The ``type`` of an item or a tool, read first to pick the struct that decodes the rest strictly."""

    type: str | None = None


class FunctionTool(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, tag_field="type",
                   tag="function"):
    """A function the model may call (Responses spell it flat: no ``function`` wrapper)."""

    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # OpenAI's Responses default is strict; a tool sent without it is strict here too.
    strict: bool | None = None


class NamespaceTool(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, tag_field="type",
                    tag="namespace"):
    """A group of function tools (Codex sends its sub-agent tools as one). The functions are offered to the model
    as the plain function tools they are; the group's name and description are not shown to it (no chat template
    here renders them), so they stay out of the key. A call to one of the functions names its namespace."""

    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    tools: Annotated[list[FunctionTool], Meta(max_length=MAX_TOOLS)] = []


class FunctionToolChoice(msgspec.Struct, forbid_unknown_fields=True, tag_field="type", tag="function"):
    name: str


class AllowedToolChoice(msgspec.Struct, forbid_unknown_fields=True, tag_field="type", tag="allowed_tools"):
    """Only these function tools may be called, ``auto`` or ``required`` (chat's ``allowed_tools``)."""

    mode: Literal["auto", "required"]
    tools: Annotated[list[FunctionToolChoice], Meta(min_length=1, max_length=MAX_TOOLS)]


class Reasoning(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """``effort`` is chat's ``reasoning_effort`` (a chat-template variable: in the key, as on chat); a summary is
    accepted and left out (this model writes no reasoning to summarise)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None


class TextFormat(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, rename={"schema_": "schema"}):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    schema_: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    format: TextFormat | None = None
    # Chat's verbosity: a chat-template variable, in the key (as on chat).
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesStreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_obfuscation: bool | None = None


#: The request fields refused when set to anything but their "off" value (false, 0) or null, each with why.
REFUSED_WHEN_SET: dict[str, str] = {
    "background": "this server answers while the request is open; send background: false or leave it out",
    "conversation": "this server keeps no conversations; send previous_response_id",
    "prompt": "this server keeps no reusable prompts; send input and instructions",
    "top_logprobs": "logprobs are served on /v1/chat/completions here",
}


#: What decoding the input items into chat messages checks, for the OpenAPI document (as
#: :data:`~edgecache.http.request_surface.SCHEMA_RULES`; a ``properties`` entry is merged into that field's schema).
SCHEMA_RULES: dict[str, dict[str, Any]] = {
    "FunctionCallOutputItem": {"properties": {"call_id": {"minLength": 1}}},
    # Text parts only (the model is text-only), each with its text (a refusal with its refusal).
    "InputPart": {
        "properties": {"type": {"enum": ["input_text", "output_text", "refusal"]}},
        "if": {"properties": {"type": {"const": "refusal"}}},
        "then": {"required": ["refusal"], "properties": {"refusal": {"type": "string"}}},
        "else": {"required": ["text"], "properties": {"text": {"type": "string"}}}},
}


def _refused(name: str, off: object = None) -> Meta:
    """The schema of a :data:`REFUSED_WHEN_SET` field: only its off value or null, and why."""
    return Meta(extra_json_schema={"enum": [off, None]} if off is not None else {"type": "null"},
                description=f"Refused when set: {REFUSED_WHEN_SET[name]}.")


class ResponseCreateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /v1/responses``. ``input`` items and ``tools`` are decoded item by item (each by its
    ``type``, strictly), so an unsupported one is named; /openapi.json lists the item shapes."""

    model: str
    input: str | Annotated[list[msgspec.Raw], Meta(max_length=MAX_ITEMS)] | None = None
    instructions: str | None = None
    previous_response_id: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    tools: Annotated[list[msgspec.Raw], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    reasoning: Reasoning | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Probability | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None
    edgecache: CacheOptions | None = None
    # Accepted and left out of the key: none of them changes what this server's model writes.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    client_metadata: dict[str, Any] | None = None
    max_tool_calls: Annotated[int, Meta(ge=1)] | None = None
    # Refused when set (their "off" value and null are accepted): each needs what this server does not have.
    background: Annotated[bool | None, _refused("background", False)] = None
    conversation: Annotated[str | dict[str, Any] | None, _refused("conversation")] = None
    prompt: Annotated[dict[str, Any] | None, _refused("prompt")] = None
    top_logprobs: Annotated[int | None, _refused("top_logprobs", 0)] = None

    def refuse_unsupported(self) -> None:
        for name in REFUSED_WHEN_SET:
            if getattr(self, name):
                raise BadRequest(f"{name} is not supported: {REFUSED_WHEN_SET[name]}", param=name)


# --- from the request to chat's request --------------------------------------------------------------------------


def _decode_item(raw: msgspec.Raw, at: str) -> Any:
    try:
        kind = msgspec.json.decode(raw, type=_Typed).type
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise BadRequest(f"invalid input item: {exc}", param=at) from exc
    struct: type | None = {None: MessageItem, "message": MessageItem, "function_call": FunctionCallItem,
                           "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}.get(kind)
    if struct is None:
        if kind == "item_reference":
            raise BadRequest("item_reference items are not supported: send the items themselves, or continue a "
                             "stored response with previous_response_id", param=f"{at}.type")
        raise BadRequest(f"input items of type {kind!r} are not supported: this server reads messages, "
                         f"function_call, function_call_output and reasoning items", param=f"{at}.type")
    return _decode_at(raw, struct, at)


def _decode_at(raw: msgspec.Raw, struct: type, at: str) -> Any:
    try:
        return msgspec.json.decode(raw, type=struct)
    except msgspec.ValidationError as exc:
        text = str(exc)
        where = text.split("at `$", 1)[1].rstrip("`") if "at `$" in text else ""
        if not where and "unknown field `" in text:
            where = "." + text.split("unknown field `", 1)[1].split("`", 1)[0]
        raise BadRequest(f"invalid {at}: {text}", param=at + where) from exc


def _part_text(parts: str | list[InputPart], at: str) -> str:
    if isinstance(parts, str):
        return parts
    texts = []
    for j, part in enumerate(parts):
        if part.type in ("input_image", "input_file", "input_audio"):
            raise BadRequest(f"{part.type} content needs a multimodal model; this server's model is text-only: "
                             f"send input_text parts", param=f"{at}[{j}]")
        value = part.refusal if part.type == "refusal" else part.text
        if value is None:
            field = "refusal" if part.type == "refusal" else "text"
            raise BadRequest(f"a {part.type} part needs its {field} field", param=f"{at}[{j}].{field}")
        texts.append(value)
    return "".join(texts)


class Conversation(msgspec.Struct, frozen=True):
    """A request's input as chat messages (without the instructions) and as the items ``input_items`` lists."""

    messages: tuple[ChatMessageIn, ...]
    items: tuple[dict[str, Any], ...]


def conversation_of(request: ResponseCreateRequest) -> Conversation:
    """``input`` as chat messages: messages as they are, each ``function_call`` joined to the assistant message
    before it (as chat's ``tool_calls``), each ``function_call_output`` a tool message."""
    if request.input is None:
        return Conversation(messages=(), items=())
    if isinstance(request.input, str):
        return Conversation(messages=(ChatMessageIn(role="user", content=request.input),),
                            items=({"type": "message", "role": "user", "status": "completed",
                                    "content": [{"type": "input_text", "text": request.input}]},))
    messages: list[ChatMessageIn] = []
    items: list[dict[str, Any]] = []
    for i, raw in enumerate(request.input):
        at = f"input[{i}]"
        item = _decode_item(raw, at)
        if isinstance(item, MessageItem):
            text = _part_text(item.content, f"{at}.content")
            messages.append(ChatMessageIn(role=item.role, content=text))
            part = ({"type": "output_text", "text": text, "annotations": []} if item.role == "assistant"
                    else {"type": "input_text", "text": text})
            items.append({"type": "message", "role": item.role, "status": "completed", "content": [part],
                          **({"id": item.id} if item.id else {})})
        elif isinstance(item, FunctionCallItem):
            call = ToolCallIn(id=item.call_id, function=FunctionCallIn(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                messages[-1] = msgspec.structs.replace(last, tool_calls=[*(last.tool_calls or ()), call],
                                                       content=last.content or None)
            else:
                messages.append(ChatMessageIn(role="assistant", content=None, tool_calls=[call]))
            items.append({"type": "function_call", "call_id": item.call_id, "name": item.name,
                          "arguments": item.arguments, "status": "completed", **({"id": item.id} if item.id else {})})
        elif isinstance(item, FunctionCallOutputItem):
            text = _part_text(item.output, f"{at}.output")
            messages.append(ChatMessageIn(role="tool", content=text, tool_call_id=item.call_id))
            items.append({"type": "function_call_output", "call_id": item.call_id, "output": text,
                          "status": "completed", **({"id": item.id} if item.id else {})})
        # A reasoning item adds nothing: this model reads none.
    return Conversation(messages=tuple(messages), items=tuple(items))


#: Why a built-in tool is refused, and for Codex (which sends ``web_search`` unless told not to) how to leave it out.
_BUILT_IN = {"web_search": "this server searches nothing; Codex leaves the tool out with web_search = \"disabled\" "
                           "in its config.toml"}


def _tool(raw: msgspec.Raw, at: str, *, nested: bool = False) -> FunctionTool | NamespaceTool:
    try:
        kind = msgspec.json.decode(raw, type=_Typed).type
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise BadRequest(f"invalid tool: {exc}", param=at) from exc
    if kind == "namespace" and not nested:
        group = _decode_at(raw, _NamespaceRaw, at)
        return NamespaceTool(name=group.name, description=group.description, tools=[
            _tool(t, f"{at}.tools[{j}]", nested=True) for j, t in enumerate(group.tools)])  # type: ignore[misc]
    if kind != "function":
        what = "custom (free-form) tools" if kind == "custom" else f"the built-in tool {kind!r}"
        why = _BUILT_IN.get(str(kind), "this server runs the model alone; send function tools")
        raise BadRequest(f"{what} is not supported: {why}", param=f"{at}.type")
    return _decode_at(raw, FunctionTool, at)


class _NamespaceRaw(msgspec.Struct, forbid_unknown_fields=True):
    """A namespace tool whose functions are decoded one by one (so an unsupported one is named)."""

    type: Literal["namespace"]
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    tools: Annotated[list[msgspec.Raw], Meta(max_length=MAX_TOOLS)] = []


def _tools(request: ResponseCreateRequest) -> list[FunctionTool | NamespaceTool]:
    """The tools as sent (a namespace holds its functions)."""
    return [_tool(raw, f"tools[{i}]") for i, raw in enumerate(request.tools or ())]


def _functions(tools: list[FunctionTool | NamespaceTool]) -> list[FunctionTool]:
    """Every function the model is offered: the top-level ones and those in namespaces, in order."""
    return [f for t in tools for f in (t.tools if isinstance(t, NamespaceTool) else (t,))]


def _namespaces(tools: list[FunctionTool | NamespaceTool]) -> dict[str, str]:
    """The namespace of each function that is in one (what a call to it names)."""
    return {f.name: t.name for t in tools if isinstance(t, NamespaceTool) for f in t.tools}


ToolChoice = Literal["none", "auto", "required"] | FunctionToolChoice | AllowedToolChoice


def _tool_choice(request: ResponseCreateRequest) -> ToolChoice | None:
    choice = request.tool_choice
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") not in ("function", "allowed_tools"):
        raise BadRequest(f"tool_choice {choice.get('type')!r} is not supported: this server runs function tools "
                         f"only; send 'none', 'auto', 'required', a function or allowed_tools", param="tool_choice")
    try:
        return msgspec.convert(choice, FunctionToolChoice | AllowedToolChoice)  # type: ignore[arg-type]
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid tool_choice: {exc}", param="tool_choice") from exc


def _chat_tool_choice(named: ToolChoice | None) -> str | NamedToolChoice | AllowedToolsChoice | None:
    if not isinstance(named, (FunctionToolChoice, AllowedToolChoice)):
        return named
    if isinstance(named, AllowedToolChoice):
        return AllowedToolsChoice(allowed_tools=AllowedTools(mode=named.mode, tools=[
            NamedToolChoice(function=NamedFunction(name=t.name)) for t in named.tools]))
    return NamedToolChoice(function=NamedFunction(name=named.name))


def _response_format(text: TextConfig | None) -> ResponseFormatIn | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return ResponseFormatIn(type=fmt.type) if fmt is not None else None
    if fmt.name is None or fmt.schema_ is None:
        raise BadRequest("text.format json_schema needs its name and schema", param="text.format")
    return ResponseFormatIn(type="json_schema", json_schema=JsonSchemaIn(
        name=fmt.name, description=fmt.description, schema_=fmt.schema_, strict=fmt.strict))


#: Chat's names for the fields a Responses caller spells differently (a 400 names the caller's own field).
_CHAT_PARAMS = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens"}


class responses_names:  # lower case: used as ``with responses_names():``, as the function it replaced
    """A 400 raised by chat's code names the field as a Responses caller spells it. A class, not a
    ``@contextmanager`` generator: it wraps a check on every Responses hit, where the generator's machinery cost
    ~2 % of the hit's CPU."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, BadRequest) and exc.param in _CHAT_PARAMS:
            exc.message = exc.message.replace(exc.param, _CHAT_PARAMS[exc.param])
            exc.param = _CHAT_PARAMS[exc.param]


def chat_request(request: ResponseCreateRequest, messages: list[ChatMessageIn], tools: list[FunctionTool],
                 tool_choice: ToolChoice | None) -> ChatCompletionRequest:
    """The chat request that asks what ``request`` asks (its messages already include history and instructions)."""
    return ChatCompletionRequest(
        model=request.model, messages=messages, max_completion_tokens=request.max_output_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p, seed=request.seed, stream=request.stream,
        tools=[ToolIn(function=FunctionDef(
            name=t.name, description=t.description, parameters=t.parameters,
            strict=True if t.strict is None else t.strict)) for t in tools] or None,
        tool_choice=_chat_tool_choice(tool_choice), parallel_tool_calls=request.parallel_tool_calls,
        response_format=_response_format(request.text), edgecache=request.edgecache,
        reasoning_effort=request.reasoning.effort if request.reasoning is not None else None,
        verbosity=request.text.verbosity if request.text is not None else None,
        prompt_cache_key=request.prompt_cache_key,
        prompt_cache_retention=request.prompt_cache_retention  # type: ignore[arg-type]
        if request.prompt_cache_retention in ("in-memory", "in_memory", "24h") else None)


# --- what the answer looks like ------------------------------------------------------------------------------------


class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputRefusal(msgspec.Struct, tag_field="type", tag="refusal"):
    refusal: str


class OutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    status: ItemStatus
    content: list[OutputText | OutputRefusal]
    role: str = "assistant"


class OutputFunctionCall(msgspec.Struct, tag_field="type", tag="function_call", omit_defaults=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus
    namespace: str | None = None  # the namespace tool the function is in (absent for a top-level function)


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseError(msgspec.Struct):
    code: str
    message: str


class TextOut(msgspec.Struct, omit_defaults=True):
    format: TextFormat = msgspec.field(default_factory=lambda: TextFormat(type="text"))
    verbosity: str | None = None


class ReasoningOut(msgspec.Struct):
    effort: str | None = None
    summary: str | None = None


class ResponseObject(msgspec.Struct, kw_only=True):
    """A Response as the openai SDK reads it: the answer, and the request's settings echoed back."""

    id: str
    object: str = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputMessage | OutputFunctionCall] = []
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningOut = msgspec.field(default_factory=ReasoningOut)
    store: bool = True
    temperature: float = 1.0
    text: TextOut = msgspec.field(default_factory=TextOut)
    tool_choice: str | FunctionToolChoice | AllowedToolChoice = "auto"
    tools: list[FunctionTool | NamespaceTool] = []
    top_p: float = 1.0
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = {}


class DeletedResponse(msgspec.Struct):
    id: str
    object: str = "response.deleted"
    deleted: bool = True


class InputItemList(msgspec.Struct):
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"


def _usage(counts: Counts) -> ResponseUsage:
    return ResponseUsage(input_tokens=counts.prompt, input_tokens_details=InputTokensDetails(cached_tokens=counts.cached),
                         output_tokens=counts.completion, output_tokens_details=OutputTokensDetails(),
                         total_tokens=counts.prompt + counts.completion)


def said_in(text: str, choices: tuple[Choice, ...] | None) -> ChatMessageIn:
    """An answer as the assistant's chat message (what a follow-up's conversation holds)."""
    calls = choices[0].tool_calls if choices else ()
    if choices:
        text = choices[0].text
    return ChatMessageIn(role="assistant", content=text or None if calls else text, tool_calls=[
        ToolCallIn(id=c.id, function=FunctionCallIn(name=c.name, arguments=c.arguments)) for c in calls] or None)


#: Called with each complete answer: the response's id, its JSON, and its output as the assistant's chat message.
OnComplete = Callable[[str, bytes, ChatMessageIn], None]


class ResponsesWriter:
    """Renders one answer, for one request, as a Response object or as the Responses event stream (an
    :class:`~edgecache.http.replies.AnswerWriter`). Every event carries its ``sequence_number``; the items' ids
    carry the response id's tail. ``on_complete`` receives each complete answer (never an error or a part).

    A stored answer is rendered once per ``replay_shape`` (:class:`~edgecache.http.replies.Renderings`): the
    request's settings the Response echoes (``shape``, the template encoded), the model and the time; a hit joins
    in its own id, and ``replayed`` hands the answer to ``on_complete``.
    """

    __slots__ = ("id", "template", "on_complete", "replay_shape", "replayed", "_seq", "_texts")

    _encoder = msgspec.json.Encoder()

    def __init__(self, template: ResponseObject, on_complete: OnComplete | None, shape: bytes = b"") -> None:
        self.id = template.id
        self.template = template
        self.on_complete = on_complete
        self.replay_shape = ("responses", shape, template.model, template.created_at)
        # What a hit does besides sending its rendering (see AnswerWriter): keep it, or nothing.
        self.replayed = self._keep_replayed if on_complete is not None else None
        self._seq = 0
        self._texts: list[str] = []

    @property
    def _suffix(self) -> str:
        """The id's tail, which the items' ids carry (so a rendering for replay puts the hit's own in them)."""
        return id_tail(self.id)[1]

    # ---- the output ----

    def _output(self, text: str, choices: tuple[Choice, ...] | None,
                finish_reason: str | None) -> tuple[list[OutputMessage | OutputFunctionCall], ChatMessageIn]:
        status: ItemStatus = "incomplete" if finish_reason == "length" else "completed"
        refusal, calls = None, ()
        if choices:
            first = choices[0]
            text, refusal, calls = first.text, first.refusal, first.tool_calls
        output: list[OutputMessage | OutputFunctionCall] = []
        if text or refusal is not None or not calls:
            content: list[OutputText | OutputRefusal] = [OutputText(text=text)] if text or refusal is None else []
            if refusal is not None:
                content.append(OutputRefusal(refusal=refusal))
            output.append(OutputMessage(id=f"msg_{self._suffix}", status=status, content=content))
        namespaces = _namespaces(self.template.tools) if calls else {}
        for j, call in enumerate(calls):
            output.append(OutputFunctionCall(id=f"fc_{self._suffix}_{j}", call_id=call.id, name=call.name,
                                             arguments=call.arguments, status="completed",
                                             namespace=namespaces.get(call.name)))
        return output, said_in(text, choices)

    def _final(self, output: list[OutputMessage | OutputFunctionCall], finish_reason: str | None,
               counts: Counts) -> ResponseObject:
        incomplete = finish_reason == "length"
        return msgspec.structs.replace(
            self.template, id=self.id, status="incomplete" if incomplete else "completed", output=output,
            usage=_usage(counts), incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None)

    def _complete(self, response: ResponseObject, said: ChatMessageIn) -> bytes:
        body = self._encoder.encode(response)
        if self.on_complete is not None and self.id == self.template.id:
            # (a rendering for replay runs under a placeholder id: that is no response of anyone's)
            self.on_complete(self.id, body, said)
        return body

    def _keep_replayed(self, answer: CachedAnswer, body: bytes) -> None:
        """A stored answer was served as this response (a hit), ``body`` its JSON: kept like any other."""
        assert self.on_complete is not None
        self.on_complete(self.id, body, said_in(answer.text, answer.choices))

    def body(self, text: str, finish_reason: str | None, counts: Counts,
             choices: tuple[Choice, ...] | None = None, stop_sequence: str | None = None) -> bytes:
        output, said = self._output(text, choices, finish_reason)
        return self._complete(self._final(output, finish_reason, counts), said)

    # ---- the event stream ----

    def _event(self, event: Any) -> bytes:
        """One SSE frame: ``event`` is one of the event structs below, its ``sequence_number`` set here."""
        event.sequence_number = self._seq
        self._seq += 1
        return b"event: " + event.type.encode() + b"\ndata: " + self._encoder.encode(event) + b"\n\n"

    def _lifecycle(self, kind: bytes, response: bytes) -> bytes:
        """A response.* event around an already encoded Response (encoded once, for the store and the event)."""
        data = (b'{"type":"' + kind + b'","sequence_number":' + str(self._seq).encode() + b',"response":' +
                response + b"}")
        self._seq += 1
        return b"event: " + kind + b"\ndata: " + data + b"\n\n"

    def _opening(self) -> bytes:
        started = self._encoder.encode(msgspec.structs.replace(self.template, id=self.id, status="in_progress"))
        return self._lifecycle(b"response.created", started) + self._lifecycle(b"response.in_progress", started)

    def _closing(self, response: ResponseObject, said: ChatMessageIn) -> bytes:
        body = self._complete(response, said)
        return self._lifecycle(b"response.incomplete" if response.status == "incomplete" else b"response.completed",
                               body)

    def _item_events(self, index: int, item: OutputMessage | OutputFunctionCall) -> bytes:
        """One whole output item as its events: added, its content (one delta), done."""
        if isinstance(item, OutputFunctionCall):
            return (self._event(_ItemEvent("response.output_item.added", index, msgspec.structs.replace(
                        item, arguments="", status="in_progress")))
                    + self._event(_ArgumentsDelta("response.function_call_arguments.delta", item.id, index,
                                                  item.arguments))
                    + self._event(_ArgumentsDone("response.function_call_arguments.done", item.id, index,
                                                 item.arguments))
                    + self._event(_ItemEvent("response.output_item.done", index, item)))
        out = [self._event(_ItemEvent("response.output_item.added", index,
                                      msgspec.structs.replace(item, content=[], status="in_progress")))]
        for j, part in enumerate(item.content):
            if isinstance(part, OutputText):
                out.append(self._event(_PartEvent("response.content_part.added", item.id, index, j,
                                                  OutputText(text=""))))
                out.append(self._event(_TextDelta("response.output_text.delta", item.id, index, j, part.text)))
                out.append(self._event(_TextDone("response.output_text.done", item.id, index, j, part.text)))
            else:
                out.append(self._event(_PartEvent("response.content_part.added", item.id, index, j,
                                                  OutputRefusal(refusal=""))))
                out.append(self._event(_RefusalDelta("response.refusal.delta", item.id, index, j, part.refusal)))
                out.append(self._event(_RefusalDone("response.refusal.done", item.id, index, j, part.refusal)))
            out.append(self._event(_PartEvent("response.content_part.done", item.id, index, j, part)))
        out.append(self._event(_ItemEvent("response.output_item.done", index, item)))
        return b"".join(out)

    def sse_start(self) -> bytes:
        item_id = f"msg_{self._suffix}"
        return (self._opening()
                + self._event(_ItemEvent("response.output_item.added", 0,
                                         OutputMessage(id=item_id, status="in_progress", content=[])))
                + self._event(_PartEvent("response.content_part.added", item_id, 0, 0, OutputText(text=""))))

    def sse_delta(self, text: str) -> bytes:
        self._texts.append(text)
        return self._event(_TextDelta("response.output_text.delta", f"msg_{self._suffix}", 0, 0, text))

    def sse_end(self, finish_reason: str | None, counts: Counts, stop_sequence: str | None = None) -> bytes:
        text = "".join(self._texts)
        output, said = self._output(text, None, finish_reason)
        item = output[0]
        assert isinstance(item, OutputMessage)
        return (self._event(_TextDone("response.output_text.done", item.id, 0, 0, text))
                + self._event(_PartEvent("response.content_part.done", item.id, 0, 0, item.content[0]))
                + self._event(_ItemEvent("response.output_item.done", 0, item))
                + self._closing(self._final(output, finish_reason, counts), said))

    def sse_whole(self, choices: tuple[Choice, ...], counts: Counts) -> bytes:
        finish = choices[0].finish_reason
        output, said = self._output("", choices, finish)
        return (self._opening() + b"".join(self._item_events(i, item) for i, item in enumerate(output))
                + self._closing(self._final(output, finish, counts), said))

    def sse_error(self, error: EdgeCacheError) -> bytes:
        failed = msgspec.structs.replace(self.template, id=self.id, status="failed", error=ResponseError(
            code="server_error" if error.status >= 500 else "invalid_prompt", message=error.message))
        return (self._event(_ErrorEvent("error", error.code or error.error_type, error.message, error.param))
                + self._lifecycle(b"response.failed", self._encoder.encode(failed)))


# The stream's events other than the response.* ones (those wrap an encoded Response). ``type`` leads, as OpenAI
# writes it; the writer sets ``sequence_number``.


class _ItemEvent(msgspec.Struct):
    type: str
    output_index: int
    item: OutputMessage | OutputFunctionCall
    sequence_number: int = 0


class _PartEvent(msgspec.Struct):
    type: str
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | OutputRefusal
    sequence_number: int = 0


class _TextDelta(msgspec.Struct):
    type: str
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = []
    sequence_number: int = 0


class _TextDone(msgspec.Struct):
    type: str
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []
    sequence_number: int = 0


class _RefusalDelta(msgspec.Struct):
    type: str
    item_id: str
    output_index: int
    content_index: int
    delta: str
    sequence_number: int = 0


class _RefusalDone(msgspec.Struct):
    type: str
    item_id: str
    output_index: int
    content_index: int
    refusal: str
    sequence_number: int = 0


class _ArgumentsDelta(msgspec.Struct):
    type: str
    item_id: str
    output_index: int
    delta: str
    sequence_number: int = 0


class _ArgumentsDone(msgspec.Struct):
    type: str
    item_id: str
    output_index: int
    arguments: str
    sequence_number: int = 0


class _ErrorEvent(msgspec.Struct):
    type: str
    code: str | None
    message: str
    param: str | None
    sequence_number: int = 0


# --- the front's side: parsing, storing, reading back ------------------------------------------------------------


def _strict(tool: FunctionTool | NamespaceTool) -> FunctionTool | NamespaceTool:
    """The tool as echoed: a function without ``strict`` is strict (OpenAI's Responses default)."""
    if isinstance(tool, NamespaceTool):
        return msgspec.structs.replace(tool, tools=[_strict(f) for f in tool.tools])  # type: ignore[misc]
    return msgspec.structs.replace(tool, strict=True if tool.strict is None else tool.strict)


class Asked(msgspec.Struct, frozen=True, kw_only=True):
    """A validated Responses request: the call (as chat would build it) and what its answer echoes and stores."""

    parsed: Parsed
    template: ResponseObject  # the Response without id, status, output and usage
    shape: bytes              # the template encoded: what a rendering of an answer to it depends on
    store: bool
    # What each stored response of this request keeps, encoded once (a hit's record costs copies, not an encode
    # of a conversation that grows every turn): the conversation without the instructions, what a follow-up
    # continues (msgpack); this request's own input items (JSON), split where each response's id tail goes.
    history: msgspec.Raw
    items: tuple[bytes, ...]


class ResponsesApi:
    """The front's Responses state: the stored responses. A repeated body without ``previous_response_id`` (the hit
    path's common case) is parsed once: ``parsed`` (the front's :class:`~edgecache.http.calls.ParsedRequests`)
    keeps it."""

    def __init__(self, settings: Settings, parsed: ParsedRequests, fleet: Fleet | None = None) -> None:
        self.settings = settings
        self.parsed = parsed
        self.store: ResponseStore = open_response_store(settings, fleet)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(StoredResponse)
        self._slot = f"edgecacheitems{os.urandom(12).hex()}"  # stands for the id tail in Asked.items

    async def close(self) -> None:
        await self.store.close()

    async def _get(self, tenant: str, response_id: str) -> StoredResponse | None:
        record = await self.store.get(tenant, response_id)
        if record is None:
            return None
        try:
            return self._decoder.decode(record)
        except msgspec.DecodeError:
            log.warning("stored response %s of tenant %s is unreadable: treated as gone", response_id, tenant)
            return None

    async def parse(self, body: bytes, tenant: Tenant) -> Asked:
        asked: Asked | None = self.parsed.recalled(ROUTE, body, tenant)
        if asked is not None:
            return asked
        request = decode_body(body, ResponseCreateRequest)
        previous: StoredResponse | None = None
        if request.previous_response_id is not None:
            previous = await self._get(tenant.id, request.previous_response_id)
            if previous is None:
                raise NotFound(f"no stored response has the id {request.previous_response_id!r}",
                               param="previous_response_id")
        asked = self.asked(request, tenant, previous)
        if previous is None:  # a stored conversation may be gone by the next request that names it
            self.parsed.remember(ROUTE, body, tenant, asked)
        return asked

    def asked(self, request: ResponseCreateRequest, tenant: Tenant, previous: StoredResponse | None) -> Asked:
        request.refuse_unsupported()
        conversation = conversation_of(request)
        history = (*(previous.conversation if previous is not None else ()), *conversation.messages)
        if not history:
            raise BadRequest("input is empty: send a string or at least one message", param="input")
        messages = ([ChatMessageIn(role="system", content=request.instructions)]
                    if request.instructions is not None else []) + list(history)
        if len(messages) > self.settings.server.max_messages:
            raise PayloadTooLarge(f"at most {self.settings.server.max_messages} messages per request, counting "
                                  f"the stored conversation previous_response_id brings")
        tools, choice = _tools(request), _tool_choice(request)
        with responses_names():
            parsed = parsed_from(chat_request(request, messages, _functions(tools), choice), tenant, self.settings)
        text = request.text
        template = ResponseObject(
            id="", created_at=0, status="completed", model=request.model, instructions=request.instructions,
            max_output_tokens=request.max_output_tokens, previous_response_id=request.previous_response_id,
            parallel_tool_calls=request.parallel_tool_calls is not False, store=request.store is not False,
            temperature=parsed.call.request.params.temperature, top_p=parsed.call.request.params.top_p,
            text=TextOut(format=text.format or TextFormat(type="text"), verbosity=text.verbosity)
            if text is not None else TextOut(),
            tool_choice=choice or "auto",
            tools=[_strict(t) for t in tools],
            truncation=request.truncation or "disabled", user=request.user, metadata=request.metadata or {},
            reasoning=ReasoningOut(effort=request.reasoning.effort, summary=request.reasoning.summary)
            if request.reasoning is not None else ReasoningOut())
        store = request.store is not False
        items = [{**item, "id": item.get("id") or f"{'msg' if item['type'] == 'message' else 'fc'}_{self._slot}_in{i}"}
                 for i, item in enumerate(conversation.items)] if store else []
        return Asked(parsed=parsed, template=template, shape=_json.encode(template), store=store,
                     history=msgspec.Raw(self._encoder.encode(history) if store else b""),
                     items=tuple(_json.encode(items).split(self._slot.encode())))

    def writer(self, asked: Asked, response_id: str, model: str, tenant: str) -> ResponsesWriter:
        template = msgspec.structs.replace(asked.template, id=response_id, created_at=int(time.time()), model=model)
        if not asked.store:
            return ResponsesWriter(template, None, asked.shape)
        input_items = id_tail(response_id)[1].encode().join(asked.items)

        def keep(response_id: str, body: bytes, said: ChatMessageIn) -> None:
            now = time.time()
            expires_at = now + self.store.ttl_s
            # history goes as encoded already (msgspec writes a Raw value's bytes as they are)
            record = StoredResponse(body=body, input_items=input_items, history=asked.history,  # type: ignore[arg-type]
                                    said=said, created_at=now, expires_at=expires_at)
            encoded = self._encoder.encode(record)
            if keeps(self.store, tenant, response_id, encoded):
                self.store.put(tenant, response_id, encoded, now, expires_at)

        return ResponsesWriter(template, keep, asked.shape)

    async def stored(self, tenant: str, response_id: str) -> StoredResponse:
        record = await self._get(tenant, response_id)
        if record is None:
            raise NotFound(f"no stored response has the id {response_id!r}", param="response_id")
        return record

    async def delete(self, tenant: str, response_id: str) -> bytes:
        if not await self.store.delete(tenant, response_id):
            raise NotFound(f"no stored response has the id {response_id!r}", param="response_id")
        return _json.encode(DeletedResponse(id=response_id))

    async def input_items(self, tenant: str, response_id: str, *, limit: int = 20, order: str = "desc",
                          after: str | None = None) -> bytes:
        record = await self.stored(tenant, response_id)
        items: list[dict[str, Any]] = msgspec.json.decode(record.input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[:limit]
        return _json.encode(InputItemList(data=page, first_id=page[0]["id"] if page else None,
                                          last_id=page[-1]["id"] if page else None, has_more=len(items) > limit))
