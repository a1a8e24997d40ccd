"""Schemathesis hooks for ``st run /openapi.json --checks all`` against this server (``SCHEMATHESIS_HOOKS=
tests.schemathesis_hooks``): generated bodies that break a rule JSON Schema cannot state are left out.

The one such rule: a tool is named once, and a tool choice names one of the tools (a value that must equal another
field's value). Every other rule the handlers check in code is in /openapi.json itself.
"""

from __future__ import annotations

from typing import Any

import schemathesis


def _tool_name(tool: Any) -> Any:
    if not isinstance(tool, dict):
        return None
    inner = tool.get("function") or tool.get("custom")  # OpenAI chat's nesting
    return inner.get("name") if isinstance(inner, dict) else tool.get("name")


def _chosen(choice: Any) -> list[Any]:
    """The tool names a tool_choice names (chat, Anthropic and Responses spellings)."""
    if not isinstance(choice, dict):
        return []
    allowed = choice.get("allowed_tools")
    listed = allowed.get("tools") if isinstance(allowed, dict) else choice.get("tools")
    if isinstance(listed, list):
        return [_tool_name(t) for t in listed]
    name = _tool_name(choice)
    return [] if name is None else [name]


def names_agree(body: Any) -> bool:
    """No two tools share a name, and every tool the choice names is among them."""
    if not isinstance(body, dict):
        return True
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    names = [_tool_name(t) for t in tools]
    offered = [n for n in names if isinstance(n, str)]
    chosen = [n for n in _chosen(body.get("tool_choice")) if isinstance(n, str)]
    return len(set(offered)) == len(offered) and all(n in offered for n in chosen)


@schemathesis.hook
def filter_case(ctx: Any, case: Any) -> bool:  # filter_case, not filter_body: the coverage phase runs it too
    return names_agree(case.body)
