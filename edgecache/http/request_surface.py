"""The OpenAI request surface: every field of the Chat Completions and Completions request bodies, decoded strictly,
and what each one does to an answer.

Each field is one of three kinds:

- **changes the output** (``messages``, sampling, ``tools``, ``response_format``, ``logprobs``, ``n``, ...): it is
  copied into the :class:`~edgecache.engines.base.GenerationRequest`, the whole of which is the cache key, and the
  running engine must honour it; an engine that cannot is named in a 400 (:func:`check_engine_supports`), because
  ignoring the field would serve an answer the caller did not ask for, and cache it under a key that says it did;
- **cannot change the output** (``store``, ``metadata``, ``service_tier``, ``user``, ``stream``, SGLang's request
  ids, priorities and routing hints (:data:`SGLANG_PASSED_OVER`),
  ``stream_options``, ``prediction``, ``prompt_cache_key``, ``prompt_cache_retention``, ``safety_identifier``, the
  assistant history's ``reasoning_content`` / ``reasoning`` / ``annotations`` that other servers echo back, and
  "off" values such as ``logprobs: false``, ``response_format: {"type": "text"}``, ``logit_bias: {}``, ``n: 1``,
  ``tool_choice: "none"`` without tools): accepted and left out of the key, so it never splits the cache;
- **refused when set** (:data:`REFUSED_WHEN_SET`): a field OpenAI defines that no engine here can honour (audio
  output, web search, the deprecated ``functions``), or one of SGLang's own that changes the answer in a way no
  engine here does (``regex``, ``lora_path``, ``no_stop_trim: true``, ...). The OpenAPI document says such a field
  may only be null (or its "off" value, false), so the schema and the server agree;
- **unknown**: a 400 naming it, as OpenAI answers. A typo (``max_token``) must not pass as a default.

Normalisation happens here once: a field's "off" value and its absence build the same request, so they share a key.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import numpy as np
from msgspec import Meta

from edgecache.call import PolicyName
from edgecache.engines.base import (
    FEATURES,
    Engine,
    GenerationRequest,
    Message,
    OutputFormat,
    SamplingParams,
    ToolCall,
    ToolSpec,
)
from edgecache.errors import BadRequest
from edgecache.settings import BucketSize
from edgecache.ttl_tiers import Tier

T = TypeVar("T")
Probability = Annotated[float, Meta(ge=0.0, le=2.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
NonEmpty = Annotated[str, Meta(min_length=1)]
# Work grows with these, so they are bounded before anything runs.
MAX_CHOICES = 8
MAX_TOOLS = 128
MAX_STOPS = 4
MAX_STOP_TOKEN_IDS = 64

#: The fields refused when set (any value but null, or false for a switch), each with why: OpenAI's that no engine
#: here can honour, and SGLang's own (its OpenAI surface's extensions; its router adds the switches to every body it
#: forwards, at false) that would change the answer in a way no engine here does.
REFUSED_WHEN_SET: dict[str, str] = {
    "audio": "audio output needs an audio model; this server's model is text-only",
    "web_search_options": "this server does not search the web",
    "functions": "functions is deprecated and not supported; send tools",
    "function_call": "function_call is deprecated and not supported; send tool_choice",
    # SGLang's
    "no_stop_trim": "this server's engines leave the matched stop string out of the answer",
    "continue_final_message": "this server's engines answer after the last message; they do not continue it",
    "return_hidden_states": "this server's engines do not return hidden states",
    "return_routed_experts": "this server's engines do not return routed experts",
    "return_cached_tokens_details": "usage.prompt_tokens_details.cached_tokens is the cached-token count here",
    "return_token_ids": "this server's answers carry text, not token ids",
    "return_prompt_token_ids": "this server's answers carry text, not token ids",
    "return_meta_info": "this server's answers carry no SGLang meta info",
    "regex": "constrained decoding here takes response_format or tools",
    "ebnf": "constrained decoding here takes response_format or tools",
    "json_schema": "constrained decoding here takes response_format on /v1/chat/completions",
    "stop_regex": "stop takes strings here",
    "lora_path": "this server serves one model without adapters",
    "session_id": "this server keeps no SGLang sessions",
    "session_params": "this server keeps no SGLang sessions",
    "custom_logit_processor": "this server runs no custom logit processors",
    "custom_params": "this server runs no custom logit processors",
    "input_ids": "the prompt is built from messages here; send the messages",
    "continuous_usage_stats": "usage comes once, at the end of the stream (stream_options.include_usage)",
}

#: SGLang's fields that cannot change the answer: request ids, a priority, and the hints its router and its
#: disaggregated serving add (the router's ``routing_id`` names a worker under its manual policy). Accepted with any
#: value and left out of the key. ``separate_reasoning`` and ``stream_reasoning`` are here too: they only split a
#: reasoning parser's output into ``reasoning_content``, and no engine here splits it, so either value gives the
#: same answer.
SGLANG_PASSED_OVER = ("rid", "extra_key", "priority", "custom_labels", "routing_id", "bootstrap_host",
                      "bootstrap_port", "bootstrap_room", "routed_dp_rank", "data_parallel_rank",
                      "disagg_prefill_dp_rank", "separate_reasoning", "stream_reasoning")

#: SGLang's fields of :data:`REFUSED_WHEN_SET` that both request bodies (chat and completions) have.
SGLANG_REFUSED = ("no_stop_trim", "return_hidden_states", "return_routed_experts", "return_cached_tokens_details",
                  "return_token_ids", "regex", "ebnf", "stop_regex", "lora_path", "session_id", "session_params",
                  "custom_logit_processor", "custom_params")


def refused_when_set(name: str, off: bool | None = None) -> Meta:
    """The schema of a :data:`REFUSED_WHEN_SET` field: null only, or its "off" value (false) and null (beside the
    type's own ``anyOf``, which still says what the field holds), and why."""
    allowed: dict[str, Any] = {"type": "null"} if off is None else {"enum": [off, None]}
    return Meta(extra_json_schema={**allowed, "description": f"Refused when set: {REFUSED_WHEN_SET[name]}."})


#: Why ``modalities`` is text only in the schema (:data:`SCHEMA_RULES` says so).
_TEXT_ONLY = Meta(description=f"Only \"text\": {REFUSED_WHEN_SET['audio']}.")


def _refuse_if_set(request: msgspec.Struct, names: tuple[str, ...], at: str = "") -> None:
    for name in names:
        value = getattr(request, name)
        if value is not None and value is not False:
            raise BadRequest(f"{name} is not supported: {REFUSED_WHEN_SET[name]}", param=at + name)


def _canonical(value: Any) -> str:
    """JSON text with sorted keys: two spellings of one schema hash the same."""
    return msgspec.json.encode(value, order="sorted").decode()


# --- messages ---------------------------------------------------------------------------------------------------


class ContentPart(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A part of a message's content. Only text (and an assistant's refusal) can reach a text-only model."""

    type: Literal["text", "image_url", "input_audio", "file", "refusal"]
    text: str | None = None
    refusal: str | None = None
    image_url: dict[str, Any] | None = None
    input_audio: dict[str, Any] | None = None
    file: dict[str, Any] | None = None


class FunctionCallIn(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str


class ToolCallIn(msgspec.Struct, forbid_unknown_fields=True, tag_field="type", tag="function"):
    id: str
    function: FunctionCallIn


class CustomCallIn(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    input: str


class CustomToolCallIn(msgspec.Struct, forbid_unknown_fields=True, tag_field="type", tag="custom"):
    """A custom tool's call in the history: accepted in shape, refused (no engine here takes custom tools)."""

    id: str
    custom: CustomCallIn


class ChatMessageIn(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn | CustomToolCallIn] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    # What other servers put in an assistant turn and clients echo back (vLLM's and DeepSeek's reasoning_content,
    # vLLM's newer reasoning, OpenRouter's reasoning_details, OpenAI's annotations of web citations): accepted and
    # left out of the key, since no engine here renders them into the prompt.
    reasoning_content: str | None = None
    reasoning: str | None = None
    reasoning_details: list[dict[str, Any]] | None = None
    annotations: list[dict[str, Any]] | None = None
    # Refused when set: audio replies and the deprecated function_call need what a text model lacks.
    audio: Annotated[dict[str, Any] | None, refused_when_set("audio")] = None
    function_call: Annotated[dict[str, Any] | None, refused_when_set("function_call")] = None

    def to_message(self, index: int) -> Message:
        at = f"messages[{index}]"
        _refuse_if_set(self, ("audio", "function_call"), at=f"{at}.")
        if self.role == "tool" and not self.tool_call_id:
            raise BadRequest("a tool message needs the tool_call_id it answers", param=f"{at}.tool_call_id")
        if self.tool_calls and self.role != "assistant":
            raise BadRequest("only assistant messages carry tool_calls", param=f"{at}.tool_calls")
        for name in ("reasoning_content", "reasoning", "reasoning_details", "annotations"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise BadRequest(f"only assistant messages carry {name}", param=f"{at}.{name}")
        for j, call in enumerate(self.tool_calls or ()):
            if isinstance(call, CustomToolCallIn):
                raise BadRequest("custom tool calls are not supported: this server's engines call function tools "
                                 "only", param=f"{at}.tool_calls[{j}]")
        if isinstance(self.content, list):
            texts = []
            for j, part in enumerate(self.content):
                if part.type in ("image_url", "input_audio", "file"):
                    raise BadRequest(f"{part.type} content parts need a multimodal model; this server's model is "
                                     f"text-only: send text parts", param=f"{at}.content[{j}]")
                value = part.text if part.type == "text" else part.refusal
                if value is None:
                    raise BadRequest(f"a {part.type} part needs its {part.type} field", param=f"{at}.content[{j}]")
                texts.append(value)
            text = "".join(texts)
        else:
            text = self.content or ""
        if self.content is None and not self.tool_calls and self.refusal is None:
            raise BadRequest("a message needs content (or, from the assistant, tool_calls)", param=f"{at}.content")
        calls = tuple(ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                      for c in self.tool_calls or () if isinstance(c, ToolCallIn))
        return Message(role=self.role, content=text, name=self.name, tool_calls=calls,
                       tool_call_id=self.tool_call_id)


_NOT_NULL = {"not": {"type": "null"}}
_HOLDS = {"required": ["content"], "properties": {"content": _NOT_NULL}}

#: What :meth:`_CommonRequest.sampling` checks: no empty stop string, logit_bias keyed by token ids.
_SAMPLING_RULES: dict[str, Any] = {
    "stop": {"anyOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOPS},
                       {"type": "null"}]},
    "logit_bias": {"anyOf": [{"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                              "additionalProperties": {"type": "number", "minimum": -100.0, "maximum": 100.0}},
                             {"type": "null"}]},
}

#: What :meth:`ChatMessageIn.to_message`, its content parts and the requests' ``generation`` check in code, stated in
#: JSON Schema for the OpenAPI document (by struct name; a ``properties`` entry is merged into that field's schema),
#: so that a body the schema allows is one the server takes.
SCHEMA_RULES: dict[str, dict[str, Any]] = {
    "ChatMessageIn": {"allOf": [
        {"if": {"properties": {"role": {"const": "tool"}}},
         "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string", "minLength": 1}}}},
        {"if": {"properties": {"role": {"const": "assistant"}}},
         "then": {"anyOf": [_HOLDS, {"required": ["tool_calls"],
                                     "properties": {"tool_calls": {"type": "array", "minItems": 1}}},
                            {"required": ["refusal"], "properties": {"refusal": {"type": "string"}}}]},
         "else": {"allOf": [_HOLDS, {"properties": {
             "tool_calls": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]},
             **{name: {"type": "null"} for name in ("reasoning_content", "reasoning", "reasoning_details",
                                                    "annotations")}}}]}},
        {"properties": {"tool_calls": {"anyOf": [{"type": "null"}, {"type": "array", "items": {
            "properties": {"type": {"const": "function"}}}}]}}},
    ]},
    "ContentPart": {"allOf": [
        {"properties": {"type": {"enum": ["text", "refusal"]}}},
        {"if": {"properties": {"type": {"const": "text"}}},
         "then": {"required": ["text"], "properties": {"text": {"type": "string"}}}},
        {"if": {"properties": {"type": {"const": "refusal"}}},
         "then": {"required": ["refusal"], "properties": {"refusal": {"type": "string"}}}},
    ]},
    "ResponseFormatIn": {"if": {"properties": {"type": {"const": "json_schema"}}},
                         "then": {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}}},
    "ChatCompletionRequest": {
        "properties": {
            **_SAMPLING_RULES,
            # "audio" is decoded so that its refusal can say why; the schema allows only "text".
            "modalities": {"anyOf": [{"type": "array", "items": {"const": "text"}}, {"type": "null"}]}},
        # top_logprobs needs logprobs: true.
        "anyOf": [{"properties": {"top_logprobs": {"type": "null"}}},
                  {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}]},
    "CompletionRequest": {
        "properties": _SAMPLING_RULES,
        # best_of is taken only when it equals n (or n's default, 1): one pair for each value n can take.
        "anyOf": [
            {"properties": {"best_of": {"type": "null"}}},
            {"properties": {"best_of": {"const": 1}, "n": {"const": 1}}},
            *({"required": ["n"], "properties": {"best_of": {"const": k}, "n": {"const": k}}}
              for k in range(2, MAX_CHOICES + 1))]},
}


# --- tools and structured output ---------------------------------------------------------------------------------


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolIn(msgspec.Struct, forbid_unknown_fields=True, tag_field="type", tag="function"):
    function: FunctionDef

    def spec(self) -> ToolSpec:
        f = self.function
        return ToolSpec(name=f.name, description=f.description or "", strict=bool(f.strict),
                        parameters=_canonical(f.parameters or {"type": "object", "properties": {}}))


class CustomToolDef(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: str | None = None
    format: dict[str, Any] | None = None  # {"type": "text"} or {"type": "grammar", "grammar": {...}}


class CustomToolIn(msgspec.Struct, forbid_unknown_fields=True, tag_field="type", tag="custom"):
    """OpenAI's free-form tool (its input is text). Carried into the request (feature ``custom_tools``) so the
    engine check names it: no engine here takes one yet."""

    custom: CustomToolDef

    def spec(self) -> ToolSpec:
        c = self.custom
        return ToolSpec(name=c.name, description=c.description or "", kind="custom",
                        format=_canonical(c.format or {"type": "text"}))


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True, tag_field="type", tag="function"):
    function: NamedFunction


class NamedCustomToolChoice(msgspec.Struct, forbid_unknown_fields=True, tag_field="type", tag="custom"):
    custom: NamedFunction


class AllowedTools(msgspec.Struct, forbid_unknown_fields=True):
    mode: Literal["auto", "required"]
    tools: Annotated[list[NamedToolChoice | NamedCustomToolChoice], Meta(min_length=1, max_length=MAX_TOOLS)]


class AllowedToolsChoice(msgspec.Struct, forbid_unknown_fields=True, tag_field="type", tag="allowed_tools"):
    """Only these tools may be called, ``auto`` or ``required``: served as that mode over only these tools."""

    allowed_tools: AllowedTools


class JsonSchemaIn(msgspec.Struct, forbid_unknown_fields=True, rename={"schema_": "schema"}):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormatIn(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaIn | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None
    # SGLang's (and vLLM's): usage in every chunk.
    continuous_usage_stats: Annotated[bool | None, refused_when_set("continuous_usage_stats", False)] = None


class CacheOptions(msgspec.Struct, forbid_unknown_fields=True):
    """The ``edgecache`` body field (the openai client's ``extra_body``): how this request may use the cache."""

    scenario: str | None = None
    policy: PolicyName | None = None
    ttl: Annotated[float, Meta(gt=0)] | None = None
    ttl_tier: Tier | None = None
    bucket_size: BucketSize | None = None  # answers kept for a request that samples without a seed (edgecache.buckets)


# --- the request bodies ----------------------------------------------------------------------------------------


class _CommonRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Probability = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    n: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Meta(max_length=MAX_STOPS)] | None = None
    seed: int | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    # SGLang's and vLLM's sampling extensions (top_k -1 is vLLM's "off").
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] | None = None
    # SGLang's and vLLM's per-request prefix-cache namespace. Accepted so that an EdgeCache (or any client that
    # salts) can sit in front of this one; it namespaces within the tenant, never across tenants.
    cache_salt: Annotated[str, Meta(max_length=256)] | None = None
    # vLLM's stopping controls (SGLang's too, as min_new_tokens): see GenerationRequest.
    min_tokens: Annotated[int, Meta(ge=0)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool | None = None
    edgecache: CacheOptions | None = None
    # SGLang's seed (its router passes it on as sent): the same as seed.
    sampling_seed: Annotated[int, Meta(ge=0)] | None = None
    # SGLang's own, refused when set (REFUSED_WHEN_SET); SGLang's router adds the switches at false to every body.
    no_stop_trim: Annotated[bool | None, refused_when_set("no_stop_trim", False)] = None
    return_hidden_states: Annotated[bool | Literal["last"] | None,
                                    refused_when_set("return_hidden_states", False)] = None
    return_routed_experts: Annotated[bool | None, refused_when_set("return_routed_experts", False)] = None
    return_cached_tokens_details: Annotated[bool | None, refused_when_set("return_cached_tokens_details", False)] = None
    return_token_ids: Annotated[bool | None, refused_when_set("return_token_ids", False)] = None
    regex: Annotated[str | None, refused_when_set("regex")] = None
    ebnf: Annotated[str | None, refused_when_set("ebnf")] = None
    stop_regex: Annotated[str | list[str] | None, refused_when_set("stop_regex")] = None
    lora_path: Annotated[str | list[str | None] | None, refused_when_set("lora_path")] = None
    session_id: Annotated[str | None, refused_when_set("session_id")] = None
    session_params: Annotated[dict[str, Any] | None, refused_when_set("session_params")] = None
    custom_logit_processor: Annotated[str | list[str | None] | None, refused_when_set("custom_logit_processor")] = None
    custom_params: Annotated[dict[str, Any] | None, refused_when_set("custom_params")] = None
    # SGLang's, accepted and left out of the key (SGLANG_PASSED_OVER).
    rid: str | list[str] | None = None
    extra_key: str | list[str] | None = None
    priority: int | None = None
    custom_labels: dict[str, str] | None = None
    routing_id: str | None = None
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None

    def sampling(self, default_max_tokens: int, max_tokens_override: int | None = None) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not s for s in stop):
            raise BadRequest("stop strings must not be empty: an empty stop would end every answer before it "
                             "starts", param="stop")
        bias = []
        for token, value in (self.logit_bias or {}).items():
            if not (token.isascii() and token.isdigit()):  # int() takes no other digits ("²")
                raise BadRequest(f"logit_bias keys are token ids; {token!r} is not one", param="logit_bias")
            if value != 0.0:
                bias.append((int(token), float(value)))
        seed = self.seed
        if self.sampling_seed is not None:
            if seed is not None and seed != self.sampling_seed:
                raise BadRequest("seed and sampling_seed disagree; send one of them", param="sampling_seed")
            seed = self.sampling_seed
        return SamplingParams(
            max_tokens=max_tokens_override or self.max_tokens or default_max_tokens,
            temperature=float(self.temperature), top_p=float(self.top_p),
            # Order does not change the output, so it must not change the key.
            stop=tuple(sorted(set(stop))), seed=seed,
            presence_penalty=float(self.presence_penalty), frequency_penalty=float(self.frequency_penalty),
            top_k=max(0, self.top_k or 0), min_p=float(self.min_p or 0.0),
            repetition_penalty=float(self.repetition_penalty or 1.0), logit_bias=tuple(sorted(bias)),
        )

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def refuse_unsupported(self, names: tuple[str, ...]) -> None:
        """A 400 naming the first field set that no engine here honours (:data:`REFUSED_WHEN_SET`)."""
        _refuse_if_set(self, names)
        if self.stream_options is not None:
            _refuse_if_set(self.stream_options, ("continuous_usage_stats",), at="stream_options.")

    def stopping(self, max_tokens: int) -> dict[str, Any]:
        """The vLLM stopping controls as :class:`GenerationRequest` fields ("off" values left at their defaults)."""
        if self.min_tokens and self.min_tokens > max_tokens:
            raise BadRequest(f"min_tokens ({self.min_tokens}) is more than max_tokens ({max_tokens})",
                             param="min_tokens")
        return {"min_tokens": self.min_tokens or 0, "ignore_eos": bool(self.ignore_eos),
                "stop_token_ids": tuple(sorted(set(self.stop_token_ids or ()))),
                "skip_special_tokens": self.skip_special_tokens is not False}


class ChatCompletionRequest(_CommonRequest, kw_only=True, forbid_unknown_fields=True):
    messages: Annotated[list[ChatMessageIn], Meta(min_length=1)]
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    tools: Annotated[list[ToolIn | CustomToolIn], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: (Literal["none", "auto", "required"] | NamedToolChoice | NamedCustomToolChoice | AllowedToolsChoice
                  | None) = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormatIn | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted and left out of the key: none of them changes what the model writes.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    # OpenAI's reference spells it "in-memory", its Python SDK "in_memory".
    prompt_cache_retention: Literal["in-memory", "in_memory", "24h"] | None = None
    safety_identifier: str | None = None
    modalities: Annotated[list[Literal["text", "audio"]] | None, _TEXT_ONLY] = None
    # Output controls, handed to the chat template as variables (an upstream gets them as sent): in the key.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    # Accepted only when unset: each changes the output in a way no engine here can honour.
    audio: Annotated[dict[str, Any] | None, refused_when_set("audio")] = None
    web_search_options: Annotated[dict[str, Any] | None, refused_when_set("web_search_options")] = None
    functions: Annotated[list[dict[str, Any]] | None, refused_when_set("functions")] = None
    function_call: Annotated[str | dict[str, Any] | None, refused_when_set("function_call")] = None
    # SGLang's chat extensions: refused when set (continue_final_message at false is what its router sends) ...
    continue_final_message: Annotated[bool | None, refused_when_set("continue_final_message", False)] = None
    return_prompt_token_ids: Annotated[bool | None, refused_when_set("return_prompt_token_ids", False)] = None
    return_meta_info: Annotated[bool | None, refused_when_set("return_meta_info", False)] = None
    input_ids: Annotated[list[int] | None, refused_when_set("input_ids")] = None
    # ... or accepted with either value (SGLANG_PASSED_OVER).
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None

    def generation(self, default_max_tokens: int, salt: str) -> GenerationRequest:
        self.refuse_unsupported(("audio", "web_search_options", "functions", "function_call", *SGLANG_REFUSED,
                                 "continue_final_message", "return_prompt_token_ids", "return_meta_info",
                                 "input_ids"))
        if self.modalities and "audio" in self.modalities:
            raise BadRequest("audio output needs an audio model; this server's model is text-only",
                             param="modalities")
        messages = tuple(m.to_message(i) for i, m in enumerate(self.messages))
        tools = tuple(t.spec() for t in self.tools or ())
        if len({t.name for t in tools}) != len(tools):
            raise BadRequest("two tools share a name", param="tools")
        tools, choice = self._tool_choice(tools)
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        fmt = self._output_format()
        if fmt is not None and tools and choice != "none":
            raise BadRequest("response_format together with tools is not supported: the answer would have to be "
                             "either a tool call or the format; send one of them", param="response_format")
        for name in ("reasoning_effort", "verbosity"):
            value = getattr(self, name)
            if value is not None and name in (self.chat_template_kwargs or {}) and \
                    self.chat_template_kwargs[name] != value:  # type: ignore[index]
                raise BadRequest(f"{name} and chat_template_kwargs.{name} disagree; send one of them", param=name)
        params = self.sampling(default_max_tokens, self.max_completion_tokens)
        return GenerationRequest(
            messages=messages, params=params, salt=salt,
            tools=tools, tool_choice=choice if tools else "auto",
            # Without tools it cannot matter; with them, true is OpenAI's default.
            parallel_tool_calls=self.parallel_tool_calls is not False or not tools,
            response_format=fmt, n=self.n,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            template_kwargs=_canonical(self.chat_template_kwargs) if self.chat_template_kwargs else "",
            reasoning_effort=self.reasoning_effort or "", verbosity=self.verbosity or "",
            **self.stopping(params.max_tokens),
        )

    def _tool_choice(self, tools: tuple[ToolSpec, ...]) -> tuple[tuple[ToolSpec, ...], str]:
        """The tools the model sees and the choice among them: ``auto``, ``none``, ``required`` or a name.
        ``allowed_tools`` becomes its mode over only the allowed tools (in their order in ``tools``), so it shares
        its key with a request that sends just those tools."""
        choice = self.tool_choice
        names = {t.name for t in tools}
        if isinstance(choice, (NamedToolChoice, NamedCustomToolChoice)):
            name = choice.function.name if isinstance(choice, NamedToolChoice) else choice.custom.name
            if name not in names:
                raise BadRequest(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
            return tools, name
        if isinstance(choice, AllowedToolsChoice):
            allowed = {t.function.name if isinstance(t, NamedToolChoice) else t.custom.name
                       for t in choice.allowed_tools.tools}
            if unknown := sorted(allowed - names):
                raise BadRequest(f"tool_choice.allowed_tools names {unknown[0]!r}, which is not among the tools",
                                 param="tool_choice.allowed_tools.tools")
            return tuple(t for t in tools if t.name in allowed), choice.allowed_tools.mode
        if choice == "required" and not tools:
            raise BadRequest("tool_choice 'required' needs tools", param="tool_choice")
        return tools, choice or "auto"

    def _output_format(self) -> OutputFormat | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return OutputFormat(kind="json_object")
        if fmt.json_schema is None:
            raise BadRequest("response_format json_schema needs its json_schema field", param="response_format")
        spec = fmt.json_schema
        return OutputFormat(kind="json_schema", schema=_canonical(spec.schema_ or {}), name=spec.name,
                            strict=bool(spec.strict))


class CompletionRequest(_CommonRequest, kw_only=True, forbid_unknown_fields=True):
    prompt: NonEmpty | Annotated[list[NonEmpty], Meta(min_length=1, max_length=1)]
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    echo: bool = False
    best_of: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] | None = None
    suffix: str | None = None
    # SGLang's completions extension, refused when set.
    json_schema: Annotated[str | None, refused_when_set("json_schema")] = None

    def generation(self, default_max_tokens: int, salt: str) -> GenerationRequest:
        self.refuse_unsupported((*SGLANG_REFUSED, "json_schema"))
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        if not prompt:
            raise BadRequest("the prompt is empty; send some text", param="prompt")
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest("best_of other than n is not supported: it would rank choices by a score this server "
                             "does not compute", param="best_of")
        if self.suffix:
            raise BadRequest("suffix (fill-in-the-middle) is not supported", param="suffix")
        params = self.sampling(default_max_tokens)
        return GenerationRequest(prompt=prompt, params=params, salt=salt, n=self.n, logprobs=self.logprobs,
                                 echo=self.echo, **self.stopping(params.max_tokens))


def decode_request(body: bytes, request_type: type[_CommonRequest]) -> _CommonRequest:
    """Strict decode; any problem becomes a 400 naming the field, never a traceback."""
    return decode_body(body, request_type)


#: The deepest a request body may nest (objects and arrays). Real bodies (a tool's JSON schema included) nest a few
#: levels; a body nested near Python's recursion limit would make a decoder, or any walk of its free-form fields
#: (schemas, template variables) later on, fail with RecursionError.
MAX_JSON_DEPTH = 128
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def json_depth(body: bytes) -> int:
    """How deep ``body``'s objects and arrays nest (strings skipped), counted without recursion."""
    marks = np.frombuffer(_JSON_STRING.sub(b'""', body), dtype=np.uint8)
    steps = np.isin(marks, (ord("{"), ord("["))).astype(np.int64) - np.isin(marks, (ord("}"), ord("]")))
    return int(np.cumsum(steps).max(initial=0))


def decode_body(body: bytes, request_type: type[T]) -> T:
    """Strict decode of any request struct; any problem becomes a 400 naming the field, never a traceback."""
    if not body:
        raise BadRequest("the request body is empty; send a JSON object")
    if body.count(b"{") + body.count(b"[") > MAX_JSON_DEPTH and json_depth(body) > MAX_JSON_DEPTH:
        raise BadRequest(f"the request body nests objects and arrays more than {MAX_JSON_DEPTH} levels deep")
    try:
        return msgspec.json.decode(body, type=request_type)
    except RecursionError as exc:  # the bound above keeps bodies far from it; a last guard all the same
        raise BadRequest("the request body nests objects and arrays too deeply") from exc
    except msgspec.ValidationError as exc:
        if _INTEGRAL_FLOAT in str(exc):
            return _decode_integral_floats(body, request_type, exc)
        raise BadRequest(f"invalid request: {exc}", param=_param_of(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc


_INTEGRAL_FLOAT = "got `float`"
_PATH_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")
# Each integer field of a request is at most one retry; no request struct has this many.
_MAX_INTEGRAL_FLOATS = 32


def _decode_integral_floats(body: bytes, request_type: type[T], first: msgspec.ValidationError) -> T:
    """The decode again, with each integer field that holds an integral float (``2.0``, ``2348117.0``) given that
    integer. JSON Schema counts such a number as an integer (the OpenAPI document says ``integer``, and a client
    that writes every number as a float is valid); msgspec's strict decode does not. Its non-strict mode would also
    take ``"5"`` for 5, which the schema forbids, so only the fields the strict decode names are changed, one at a
    time: only a body that was refused pays for this."""
    value = msgspec.json.decode(body)
    error = first
    for _ in range(_MAX_INTEGRAL_FLOATS):
        message = str(error)
        if _INTEGRAL_FLOAT not in message or "`int" not in message.split(", got", 1)[0]:
            break
        path = message.rsplit("at `$", 1)[-1].rstrip("`") if "at `$" in message else ""
        steps = [name or int(index) for name, index in _PATH_STEP.findall(path)]
        holder, at = None, value
        try:
            for step in steps:
                holder, at = at, at[step]
        except (KeyError, IndexError, TypeError):
            break
        if holder is None or not isinstance(at, float) or not at.is_integer():
            break
        holder[steps[-1]] = int(at)
        try:
            # Decoded from JSON again, not converted: a msgspec.Raw field (the Responses input items) takes only JSON.
            return msgspec.json.decode(msgspec.json.encode(value), type=request_type)
        except msgspec.ValidationError as again:
            error = again
    raise BadRequest(f"invalid request: {error}", param=_param_of(str(error))) from first


def _param_of(message: str) -> str | None:
    # msgspec ends its messages with "- at `$.messages[0].role`"; an unknown field is "Object contains unknown
    # field `tools`" (at the top level, with no path).
    marker = "at `$."
    if marker in message:
        return message.split(marker, 1)[1].rstrip("`")
    unknown = "unknown field `"
    if unknown in message:
        return message.split(unknown, 1)[1].split("`", 1)[0]
    return None


# --- what the engine must honour -----------------------------------------------------------------------------


def features_used(request: GenerationRequest) -> frozenset[str]:
    """The :data:`~edgecache.engines.base.FEATURES` this request uses (with a value other than "off")."""
    used = set()
    if request.tools:
        used.update(("tools", "tool_choice"))
        if any(t.kind == "custom" for t in request.tools):
            used.add("custom_tools")
    if request.response_format is not None:
        used.add("response_format")
    if request.n != 1:
        used.add("n")
    if request.logprobs is not None:
        used.add("logprobs")
        if request.logprobs:
            used.add("top_logprobs")
    if request.echo:
        used.add("echo")
    if request.template_kwargs:
        used.add("chat_template_kwargs")
    for name, on in (("min_tokens", request.min_tokens), ("ignore_eos", request.ignore_eos),
                     ("stop_token_ids", request.stop_token_ids),
                     ("skip_special_tokens", not request.skip_special_tokens)):
        if on:
            used.add(name)
    p = request.params
    for name, on in (("top_k", p.top_k), ("min_p", p.min_p), ("repetition_penalty", p.repetition_penalty != 1.0),
                     ("logit_bias", p.logit_bias)):
        if on:
            used.add(name)
    return frozenset(used)


#: How a feature that is not a request field of its own is named in a refusal: (words, the field it lives in).
_FEATURE_IN_FIELD = {"custom_tools": ('custom tools (tools[].type "custom")', "tools")}


def check_engine_supports(used: frozenset[str], engine: Engine) -> None:
    """A 400 naming the first field the engine cannot honour (in :data:`~edgecache.engines.base.FEATURES` order)."""
    if not used:  # the common case, and on the hit path: no set arithmetic
        return
    missing = used - engine.features
    if missing:
        feature = next(f for f in FEATURES if f in missing)
        words, field = _FEATURE_IN_FIELD.get(feature, (feature, feature))
        raise BadRequest(f"{words} {'are' if words != feature else 'is'} not supported by the {engine.kind} engine "
                         "this server runs", param=field)
