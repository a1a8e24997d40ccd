"""The OpenAPI document served at ``/openapi.json``, generated from the msgspec structs that decode the requests and
encode the responses, so it cannot drift from what the server does: a field added to a request struct appears here,
and one the schema lists is one the server accepts.

litestar's own generator is off (``openapi_config=None``): the handlers take the raw body and decode it themselves
(the strict structs are the validation), so litestar cannot see their request bodies.
"""

from __future__ import annotations

from typing import Any

import msgspec

from edgecache.errors import ErrorBody
from edgecache.http import anthropic_api, responses_api
from edgecache.http.anthropic_api import (
    AnthropicError,
    ClientTool,
    CountTokensRequest,
    MessageOut,
    MessagesRequest,
    TokenCount,
)
from edgecache.http.embeddings import EmbeddingList, EmbeddingRequest
from edgecache.http.feedback import FeedbackReply, FeedbackRequest
from edgecache.http.openai_api import (
    ChatCompletion,
    ChatCompletionChunk,
    ModelCard,
    ModelInfo,
    ModelList,
    ServerInfo,
    TextCompletion,
)
from edgecache.http.request_surface import SCHEMA_RULES, ChatCompletionRequest, CompletionRequest
from edgecache.http.responses_api import (
    INPUT_ITEMS,
    AllowedToolChoice,
    DeletedResponse,
    FunctionTool,
    FunctionToolChoice,
    InputItemList,
    NamespaceTool,
    ResponseCreateRequest,
    ReasoningItem,
    ResponseObject,
)
from edgecache.http.warmup_lines import ONE_OF_MESSAGES_OR_PROMPT, WarmupBatch, WarmupLine
from edgecache.ledger import HISTORY_MINUTES

_REF = "#/components/schemas/{name}"


def _ref(struct: type) -> dict[str, str]:
    return {"$ref": _REF.format(name=struct.__name__)}


def _errors(*statuses: int, shape: type = ErrorBody, **described: str) -> dict[str, Any]:
    """Error responses in ``shape``; ``described`` (``e404="..."``) words one for this route."""
    reasons = {400: "Invalid request (the error's param names the field)", 401: "Missing or unknown API key",
               403: "Not allowed by the tenant's plan", 404: "Unknown model, or no such stored response",
               413: "Request too large",
               429: "Overloaded; see Retry-After", 503: "The model is loading or failed to load",
               504: "Cache-Control: only-if-cached (or that policy), and no cached answer; nothing was computed"}
    return {str(s): {"description": described.get(f"e{s}", reasons[s]),
                     "content": {"application/json": {"schema": _ref(shape)}}} for s in statuses}


def _json_body(struct: type) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": _ref(struct)}}}


def _generation(request: type, answer: type, summary: str, errors: type = ErrorBody) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": _json_body(request),
        "responses": {
            "200": {"description": "The answer; a text/event-stream of chunks when stream is true. X-EdgeCache "
                                   "says which layer served it (exact, shared, semantic, miss).",
                    "content": {"application/json": {"schema": _ref(answer)},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(400, 401, 403, 404, 413, 429, 503, 504, shape=errors)}}}


def _responses_items(components: dict[str, Any]) -> None:
    """The Responses request decodes ``input`` items and ``tools`` one by one, by their type (so an unsupported one
    is named); the schema lists the shapes that decoding accepts."""
    properties = components[ResponseCreateRequest.__name__]["properties"]
    for choice in properties["input"]["anyOf"]:
        if choice.get("type") == "array":
            choice["items"] = {"anyOf": [_ref(item) for item in INPUT_ITEMS]}
    for choice in properties["tools"]["anyOf"]:
        if choice.get("type") == "array":
            choice["items"] = {"anyOf": [_ref(FunctionTool), _ref(NamespaceTool)]}
    # What the handler checks in code: a conversation to answer, from input (a string, or at least one item that is
    # not reasoning: reasoning adds nothing this model reads) or from the stored response previous_response_id names.
    components[ResponseCreateRequest.__name__]["anyOf"] = [
        {"required": ["previous_response_id"], "properties": {"previous_response_id": {"type": "string"}}},
        {"required": ["input"], "properties": {"input": {"anyOf": [
            {"type": "string"},
            {"type": "array", "contains": {"anyOf": [_ref(item) for item in INPUT_ITEMS if item is not ReasoningItem]}},
        ]}}}]
    properties["tool_choice"]["anyOf"] = [
        alternative for choice in properties["tool_choice"]["anyOf"]
        for alternative in ([_ref(FunctionToolChoice), _ref(AllowedToolChoice)] if choice.get("type") == "object"
                            else [choice])]


def _response_id(summary: str, answer: type, *, query: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"summary": summary,
            "parameters": [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}},
                           *(query or [])],
            "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": _ref(answer)}}},
                          **_errors(*((400,) if query else ()), 401, 404,
                                    e400="A query parameter is not one the route takes")}}


def openapi_document(version: str) -> dict[str, Any]:
    structs = (ChatCompletionRequest, CompletionRequest, EmbeddingRequest, ChatCompletion, ChatCompletionChunk,
               TextCompletion, EmbeddingList, ModelList, ModelCard, ModelInfo, ServerInfo, ErrorBody, WarmupBatch,
               MessagesRequest, CountTokensRequest, ClientTool, MessageOut, TokenCount, AnthropicError, ResponseCreateRequest, *INPUT_ITEMS,
               FunctionTool, NamespaceTool, FunctionToolChoice, AllowedToolChoice, ResponseObject, DeletedResponse, InputItemList,
               FeedbackRequest, FeedbackReply)
    _, components = msgspec.json.schema_components(structs, ref_template=_REF)
    _responses_items(components)
    for name, rules in (*SCHEMA_RULES.items(), *anthropic_api.SCHEMA_RULES.items(), *responses_api.SCHEMA_RULES.items(),
                        (WarmupLine.__name__, ONE_OF_MESSAGES_OR_PROMPT)):
        component = components[name]
        for key, value in rules.items():
            if key == "properties":
                for field, schema in value.items():
                    component["properties"][field].update(schema)
            else:
                component[key] = value
    plain_json = {"200": {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "EdgeCache", "version": version,
                 "description": "An OpenAI- and Anthropic-compatible inference cache. See docs/api.md."},
        "paths": {
            "/v1/chat/completions": _generation(ChatCompletionRequest, ChatCompletion, "Chat completion"),
            "/v1/completions": _generation(CompletionRequest, TextCompletion, "Text completion"),
            "/v1/responses": _generation(ResponseCreateRequest, ResponseObject,
                                         "Create a response (OpenAI Responses API)"),
            "/v1/responses/{response_id}": {
                "get": _response_id("A stored response (another tenant's is a 404)", ResponseObject),
                "delete": _response_id("Delete a stored response", DeletedResponse)},
            "/v1/responses/{response_id}/input_items": {"get": _response_id(
                "A stored response's input items", InputItemList, query=[
                    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                    {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
                    {"name": "after", "in": "query", "schema": {"type": "string"}}])},
            "/v1/messages": _generation(MessagesRequest, MessageOut, "Anthropic Messages (errors in Anthropic's "
                                        "shape; the key may also come as x-api-key)", errors=AnthropicError),
            "/v1/messages/count_tokens": {"post": {
                "summary": "The prompt's tokens as the engine counts them (chat template and tools included)",
                "requestBody": _json_body(CountTokensRequest),
                "responses": {"200": {"description": "The count",
                                      "content": {"application/json": {"schema": _ref(TokenCount)}}},
                              **_errors(400, 401, 404, 413, 503, shape=AnthropicError)}}},
            "/v1/embeddings": {"post": {
                "summary": "Embeddings from the co-hosted sentence embedder",
                "requestBody": _json_body(EmbeddingRequest),
                "responses": {"200": {"description": "The vectors",
                                      "content": {"application/json": {"schema": _ref(EmbeddingList)}}},
                              **_errors(400, 401, 404, 413, 503)}}},
            "/v1/feedback": {"post": {
                "summary": "Mark a response this tenant received right or wrong (a wrong semantic answer is "
                           "demoted); see docs/api.md",
                "requestBody": _json_body(FeedbackRequest),
                "responses": {"200": {"description": "What the mark did",
                                      "content": {"application/json": {"schema": _ref(FeedbackReply)}}},
                              **_errors(400, 401, 404, 413, e404="No such response for this API key's tenant "
                                        "(never sent to it, or older than the last server.feedback_responses)")}}},
            "/v1/models": {"get": {"summary": "The chat model and the embedder", "responses": {
                "200": {"description": "OK", "content": {"application/json": {"schema": _ref(ModelList)}}}}}},
            "/v1/models/{model_id}": {"get": {
                "summary": "One model",
                "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "OK",
                                      "content": {"application/json": {"schema": _ref(ModelCard)}}},
                              **_errors(404)}}},
            **{path: {"get": {"summary": summary, "responses": {"200": {
                "description": "OK", "content": {"application/json": {"schema": _ref(shape)}}}}}}
               for path, summary, shape in (
                   ("/model_info", "The served model, as SGLang's router reads a worker's", ModelInfo),
                   ("/get_model_info", "The same as /model_info (SGLang's older name)", ModelInfo),
                   ("/server_info", "The server, as SGLang's router reads a worker's", ServerInfo),
                   ("/get_server_info", "The same as /server_info (SGLang's older name)", ServerInfo))},
            "/health": {"get": {"summary": "Ready, degraded (and why) or failed", "responses": {
                **plain_json, "503": {"description": "Not ready"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
                "200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/stats": {"get": {"summary": "Cache, engine and admission figures", "responses": {
                **plain_json, **_errors(401)}}},
            "/stats/history": {"get": {
                "summary": "The ledger minute by minute: what each minute saved and spent, and why misses missed",
                "parameters": [
                    {"name": "minutes", "in": "query", "required": False,
                     "schema": {"type": "integer", "minimum": 1, "maximum": HISTORY_MINUTES}},
                    {"name": "step", "in": "query", "required": False,
                     "schema": {"type": "integer", "minimum": 1, "maximum": HISTORY_MINUTES}},
                    {"name": "tenant", "in": "query", "required": False, "schema": {"type": "string"}}],
                "responses": {**plain_json, **_errors(400, 401)}}},
            "/dashboard": {"get": {"summary": "The operator's page (HTML; its figures come from /stats)", "responses": {
                "200": {"description": "OK", "content": {"text/html": {"schema": {"type": "string"}}}}}}},
            "/admin/flush": {"post": {
                "summary": "Drop cached entries: {tenant}, {scenario}, both, or {all: true}",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"tenant": {"type": ["string", "null"]}, "scenario": {"type": ["string", "null"]},
                                   "all": {"type": "boolean"}},
                    # The handler's rule: name something to flush (an empty body flushes nothing: a 400).
                    "anyOf": [{"required": ["tenant"], "properties": {"tenant": {"type": "string"}}},
                              {"required": ["scenario"], "properties": {"scenario": {"type": "string"}}},
                              {"required": ["all"], "properties": {"all": {"const": True}}}]}}}},
                "responses": {**plain_json, **_errors(400, 401, 404, 503)}}},
            "/admin/warmup": {"post": {
                "summary": "Warm the caches with prompts-file lines", "requestBody": _json_body(WarmupBatch),
                "responses": {**plain_json, **_errors(400, 401, 503)}}},
        },
        "components": {"schemas": components},
    }
