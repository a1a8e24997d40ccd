"""The prompts file's lines, as ``edgecache warmup`` and ``POST /admin/warmup`` take them: OpenAI-shaped messages (or
a raw ``prompt``) plus the warmup's own fields, parsed and checked here and warmed by :mod:`edgecache.warmup`.

A line's ``messages`` are validated exactly as a chat request's are (the same :class:`ChatMessageIn`), so a line
that warms the cache is one a client could have sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Annotated

import msgspec
from msgspec import Meta

from edgecache.call import Call
from edgecache.engines.base import GenerationRequest, SamplingParams
from edgecache.http.request_surface import ChatMessageIn
from edgecache.pipeline import RequestPipeline
from edgecache.semantic.learner import TaughtState
from edgecache.settings import Settings
from edgecache.tenants import TenantDirectory
from edgecache.warmup import LineResult, Prefilled, check_groups, warm


class WarmupLine(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    messages: Annotated[list[ChatMessageIn], Meta(min_length=1)] | None = None
    prompt: str | None = None
    scenario: str = "default"
    tenant: str | None = None
    ttl: Annotated[float, Meta(gt=0)] | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 0.0
    seed: int | None = None
    answer: str | None = None
    group: Annotated[str, Meta(min_length=1)] | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of `messages` and `prompt`")


#: :meth:`WarmupLine.__post_init__`'s rule in the OpenAPI document (on WarmupLine's own schema, not beside a
#: reference to it, where a client's generator may not look): exactly one of ``messages`` and ``prompt``.
ONE_OF_MESSAGES_OR_PROMPT = {"oneOf": [
    {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
    {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}}]}


class WarmupReply(msgspec.Struct, kw_only=True):
    """The answer of ``POST /admin/warmup``: one result per line, and what the teaching of each tenant and scenario
    whose groups the batch taught allows now (:meth:`edgecache.semantic.learner.SemanticLearner.taught_state`)."""

    results: list[LineResult]
    taught: list[TaughtState] = msgspec.field(default_factory=list)


class NumberedLine(msgspec.Struct, kw_only=True):
    line: int
    request: WarmupLine


class WarmupBatch(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The body of ``POST /admin/warmup``."""

    tenant: str | None = None
    lines: list[NumberedLine]


_line_decoder = msgspec.json.Decoder(WarmupLine)


def read_lines(lines: Iterable[str]) -> Iterator[NumberedLine | LineResult]:
    """Parse a prompts file: a :class:`NumberedLine` per good line, a failed :class:`LineResult` per bad one."""
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            yield NumberedLine(line=number, request=_line_decoder.decode(text))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            yield LineResult(line=number, outcome="failed", detail=str(exc))


def to_call(line: WarmupLine, *, tenant: str, default_max_tokens: int, tenant_limit: int | None = None,
            engine_time_s: float | None = None) -> Call:
    params = SamplingParams(max_tokens=line.max_tokens or default_max_tokens, temperature=line.temperature,
                            seed=line.seed)
    messages = tuple(m.to_message(i) for i, m in enumerate(line.messages)) if line.messages is not None else None
    return Call(request=GenerationRequest(messages=messages, prompt=line.prompt, params=params, salt=tenant),
                tenant=tenant, scenario=line.scenario, ttl_s=line.ttl, tenant_limit=tenant_limit,
                engine_time_s=engine_time_s)


def check_line_groups(lines: list[NumberedLine], tenant: str | None = None) -> None:
    """:func:`check_groups` of a whole prompts file before any of it is sent (tenants as the lines name them)."""
    check_groups([(n.line, to_call(n.request, tenant=n.request.tenant or tenant or "default", default_max_tokens=1),
                   n.request.answer, n.request.group) for n in lines])


async def warm_lines(pipeline: RequestPipeline, lines: list[NumberedLine], *, tenants: TenantDirectory,
                     settings: Settings, tenant: str | None = None,
                     prefilled: Prefilled | None = None) -> WarmupReply:
    """Check every line's messages (one that a chat request could not send refuses the batch), then each line's
    tenant (the line's own, else ``tenant``, else ``default``) and scenario, then :func:`warm` the good ones. One
    result per line, in line order, and what the teaching of each tenant and scenario with grouped lines allows
    now."""
    for numbered in lines:  # a malformed line refuses the batch (a 400), whichever tenant and scenario it names
        for i, message in enumerate(numbered.request.messages or ()):
            message.to_message(i)
    calls, results, groups = [], [], {}
    for numbered in lines:
        line = numbered.request
        who = tenants.get(line.tenant or tenant or "default")
        if who is None:
            results.append(LineResult(line=numbered.line, outcome="failed",
                                      detail=f"unknown tenant {line.tenant or tenant!r}"))
        elif line.scenario not in settings.scenarios:
            results.append(LineResult(line=numbered.line, outcome="failed",
                                      detail=f"unknown scenario {line.scenario!r}"))
        else:
            call = to_call(line, tenant=who.id, tenant_limit=who.plan.max_concurrent_misses,
                           engine_time_s=who.plan.max_request_engine_s,
                           default_max_tokens=settings.engine.default_max_tokens)
            calls.append((numbered.line, call, line.answer))
            if line.group is not None:
                groups[numbered.line] = line.group
    results.extend(await warm(pipeline, calls, prefilled, groups))
    taught: list[TaughtState] = []
    if pipeline.semantic is not None:
        for tenant_id, scenario in dict.fromkeys((call.tenant, call.scenario) for number, call, _ in calls
                                                 if number in groups):
            state = pipeline.semantic.taught_state(tenant_id, scenario)
            if state is not None:
                taught.append(state)
    return WarmupReply(results=sorted(results, key=lambda r: r.line), taught=taught)
