"""Tools and structured output for engines that sample under a grammar (llama.cpp) or a JSON schema (SGLang).

- ``response_format``: ``json_object`` -> llama.cpp's JSON grammar; ``json_schema`` -> the grammar llama.cpp's own
  converter makes from the schema. Either way the answer parses (and, for a schema, validates) unless it ran out of
  ``max_tokens`` first (``finish_reason: "length"``, as OpenAI reports it).
- tools: a call is the JSON object ``{"name": ..., "arguments": {...}}``. With ``tool_choice`` ``required`` or a
  named function the output is constrained to such an object (one of the tools, arguments by its schema), so a call
  always comes back and its arguments validate. With ``auto`` the model writes freely and an answer that is such an
  object (optionally wrapped in ``<tool_call>`` tags or a code fence, as tool-tuned models write them) becomes a
  call. A forced call is one call: ``parallel_tool_calls`` allows more, never demands them.
- Tool-call ids are a hash of the request (and the choice and call index), not random: a replayed tool call keeps
  its id, so the client's next turn, which quotes the id in the assistant message and the tool result, is the same
  request every time and can be a cache hit too. Random ids would make every follow-up turn a miss.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from typing import Any

import msgspec

from edgecache.engines.base import GenerationRequest, Message, ToolSpec, answer_fields

_TAGS = re.compile(r"^\s*(?:<tool_call>|```(?:json)?)\s*|\s*(?:</tool_call>|```)\s*$")


def json_or_text(arguments: str) -> Any:
    """A call's arguments as JSON when they parse (a client may send anything in its history), else the text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def template_message(message: Message, content: str) -> dict[str, Any]:
    """``message`` as a chat template reads it (tool calls with their arguments as JSON), with ``content`` in place
    of its text: the engines pass a placeholder there, so user text is never parsed for control tokens."""
    entry: dict[str, Any] = {"role": message.role, "content": content}
    if message.name:
        entry["name"] = message.name
    if message.tool_calls:
        entry["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": json_or_text(c.arguments)}}
                               for c in message.tool_calls]
    if message.tool_call_id:
        entry["tool_call_id"] = message.tool_call_id
    return entry


def template_tools(tools: Iterable[ToolSpec]) -> list[dict[str, Any]]:
    """Tools as chat templates read them (OpenAI's ``{"type": "function", "function": {...}}``)."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": json.loads(t.parameters)}} for t in tools]


def chat_for_template(request: GenerationRequest, *,
                      template_knows_tools: bool) -> tuple[list[Message], list[dict[str, Any]] | None]:
    """The messages and the tools to render for ``request``. A template that knows tools renders them and a
    tool-using history itself; for one that does not, the tools' description joins the system prompt and the
    history is written out as text (:func:`with_tools_in_prompt`)."""
    messages = list(request.messages or ())
    if template_knows_tools:
        return messages, template_tools(request.tools) if request.tools else None
    if request.tools and request.tool_choice != "none":
        return with_tools_in_prompt(messages, tools_system_prompt(request.tools)), None
    if any(m.tool_calls for m in messages):
        return with_tools_in_prompt(messages, None), None
    return messages, None


def template_controls(request: GenerationRequest) -> dict[str, str]:
    """OpenAI's output controls the request sets, as chat-template variables of the same names (gpt-oss's template
    reads ``reasoning_effort``; a template that reads neither renders as without them)."""
    return {name: value for name, value in (("reasoning_effort", request.reasoning_effort),
                                            ("verbosity", request.verbosity)) if value}


def call_schema(tool: ToolSpec) -> dict[str, Any]:
    """The JSON schema of one call of ``tool``."""
    return {"type": "object", "properties": {"name": {"const": tool.name},
                                             "arguments": json.loads(tool.parameters)},
            "required": ["name", "arguments"], "additionalProperties": False}


def output_schema(request: GenerationRequest) -> dict[str, Any] | None:
    """The JSON schema the output must match, or None (free text, or any JSON object: see :func:`grammar_source`)."""
    if request.tools and request.tool_choice not in ("auto", "none"):
        tools = [t for t in request.tools if request.tool_choice in ("required", t.name)]
        schemas = [call_schema(t) for t in tools]
        return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    fmt = request.response_format
    if fmt is not None and fmt.kind == "json_schema":
        return json.loads(fmt.schema) if fmt.schema else {"type": "object"}
    return None


def grammar_source(request: GenerationRequest) -> str | None:
    """The llama.cpp grammar (GBNF) constraining this request's output, or None."""
    from llama_cpp import llama_grammar

    schema = output_schema(request)
    if schema is not None:
        try:
            return llama_grammar.json_schema_to_gbnf(json.dumps(schema))
        except Exception as exc:  # the converter raises bare errors on schemas it cannot express
            from edgecache.errors import BadRequest

            raise BadRequest(f"this JSON schema cannot be turned into a grammar: {exc}",
                             param="tools" if request.tools else "response_format") from exc
    if request.response_format is not None and request.response_format.kind == "json_object":
        return llama_grammar.JSON_GBNF
    return None


def parse_tool_calls(text: str, request: GenerationRequest, *, forced: bool) -> list[tuple[str, str]]:
    """(name, arguments as JSON text) of the calls in ``text``; empty when it is not a call of one of the tools."""
    body = _TAGS.sub("", text.strip())
    try:
        value = json.loads(body)
    except ValueError:
        return []
    names = {t.name for t in request.tools}
    calls = []
    for item in value if isinstance(value, list) else [value]:
        if not isinstance(item, dict) or item.get("name") not in names:
            return []
        arguments = item.get("arguments", item.get("parameters", {}))
        if not isinstance(arguments, dict):
            return []
        calls.append((str(item["name"]), json.dumps(arguments, ensure_ascii=False)))
    if not request.parallel_tool_calls:
        calls = calls[:1]
    return calls


def tool_call_id(request: GenerationRequest, choice: int, call: int) -> str:
    """A call's id, stable for a given request (see the module's docstring for why)."""
    digest = hashlib.blake2b(msgspec.json.encode((answer_fields(request), choice, call)), digest_size=12).hexdigest()
    return f"call_{digest}"


def tools_system_prompt(tools: Iterable[ToolSpec]) -> str:
    """How the tools are described to a model whose chat template does not render tools itself."""
    listed = "\n".join(json.dumps({"name": t.name, "description": t.description,
                                   "parameters": json.loads(t.parameters)}, ensure_ascii=False) for t in tools)
    return ("You can call these functions:\n" + listed + "\nTo call one, answer with only a JSON object: "
            '{"name": <function name>, "arguments": <an object of its arguments>}.')


def with_tools_in_prompt(messages: list[Message], prompt: str | None) -> list[Message]:
    """Messages for a template without tool support: the tools' description joins the system prompt, earlier calls
    are written out as the JSON the model would have answered, and tool results become user turns."""
    out: list[Message] = []
    for m in messages:
        if m.tool_calls:
            calls = [{"name": c.name, "arguments": json_or_text(c.arguments)} for c in m.tool_calls]
            written = json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
            out.append(Message(role="assistant", content=(m.content + "\n" if m.content else "") + written))
        elif m.role == "tool":
            out.append(Message(role="user", content=f"Result of call {m.tool_call_id}: {m.content}"))
        else:
            out.append(m)
    if prompt is None:
        return out
    if out and out[0].role in ("system", "developer"):
        return [Message(role=out[0].role, content=out[0].content + "\n\n" + prompt), *out[1:]]
    return [Message(role="system", content=prompt), *out]
