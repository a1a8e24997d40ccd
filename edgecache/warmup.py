"""Warmup: fill the caches before traffic arrives ("warm up before launch, always").

A prompts file is JSON lines, one request each::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}],
     "scenario": "support", "tenant": "acme", "ttl": 3600, "max_tokens": 64, "answer": "..."}

(``prompt`` instead of ``messages`` for a raw completion; every field but one of those two is optional.)

- A line may name a ``group``: the lines of one group (per tenant and scenario) mean the same thing and share one
  answer, given on one of its lines or, when none gives it, computed once from the group's first line. Every line of
  the group is then stored and indexed with that answer, and the groups teach the semantic learner which
  paraphrases one answer serves and which near questions it does not (:mod:`edgecache.semantic.teaching`), so a
  tenant's semantic hits start with its first request. One question in two groups, or one group with two answers,
  contradicts itself: :func:`check_groups` refuses it, naming the lines.

- A line with an ``answer`` is written straight to the result store and, for a first-turn chat prompt, to the
  semantic index: no engine call. Such lines go in batches (one store transaction, large embedding batches, one
  multi-threaded index insert per batch), so a tenant's FAQ of 100k lines loads in minutes.
- A line without one is run through the request path like a request (temperature 0 unless given), which fills the
  engine's KV prefix cache and the stores; a line already cached is skipped.
- Each distinct system prompt among the answered lines is prefilled into the engine's prefix cache once (a
  one-token generation that is not stored), so the first real request that shares it skips its prefill.

Bad lines are reported with their line number and skipped; a line is written whole or not at all (the answer is
validated before anything is written, and its store entry goes in before its vector, which points at it).
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Literal

import msgspec

from edgecache.call import Call
from edgecache.engines.base import GenerationRequest, Message, SamplingParams, answer_fields
from edgecache.errors import BadRequest, EdgeCacheError
from edgecache.pipeline import RequestPipeline

Outcome = Literal["written", "skipped", "failed"]


class LineResult(msgspec.Struct, kw_only=True):
    line: int
    outcome: Outcome
    detail: str = ""


def _system_prompt(call: Call) -> tuple[Message, ...]:
    messages = call.request.messages or ()
    return tuple(m for m in messages if m.role in ("system", "developer"))


async def _drain(pipeline: RequestPipeline, call: Call) -> str:
    return (await _answer(pipeline, call))[0]


async def _answer(pipeline: RequestPipeline, call: Call) -> tuple[str, str]:
    """(what served it, the answer's text) of ``call`` through the request path."""
    reply = await pipeline.serve(call)
    parts = []
    async with aclosing(reply.stream()) as chunks:
        async for chunk in chunks:
            parts.append(chunk.text)
    return reply.served, "".join(parts)


GroupKey = tuple[str, str, str]
"""(tenant, scenario, group name): a group is one tenant's, in one scenario."""

#: The most contradictions one refusal names.
CONTRADICTIONS_SHOWN = 20


def check_groups(lines: list[tuple[int, Call, str | None, str | None]]) -> None:
    """Refuse (:class:`BadRequest`, naming the lines) warmup lines ``(line number, call, answer, group)`` that
    contradict themselves: one question (the same request, tenant and scenario) in two groups, or one group given
    two different answers."""
    where: dict[tuple[str, str, bytes], tuple[int, str]] = {}
    answers: dict[GroupKey, tuple[int, str]] = {}
    problems: list[str] = []
    for number, call, answer, group in lines:
        if group is None:
            continue
        question = (call.tenant, call.scenario, msgspec.json.encode(answer_fields(call.request)))
        first = where.setdefault(question, (number, group))
        if first[1] != group:
            problems.append(f"lines {first[0]} and {number}: the same question is in group {first[1]!r} (line "
                            f"{first[0]}) and in group {group!r} (line {number})")
        if answer is not None:
            given = answers.setdefault((call.tenant, call.scenario, group), (number, answer))
            if given[1] != answer:
                problems.append(f"lines {given[0]} and {number}: group {group!r} is given two different answers")
    if problems:
        more = len(problems) - CONTRADICTIONS_SHOWN
        raise BadRequest("the warmup contradicts itself, nothing was written: " + "; ".join(
            problems[:CONTRADICTIONS_SHOWN]) + (f"; and {more} more" if more > 0 else ""), param="lines")


#: Answered lines stored per batch: large enough that a commit and an embedding call are shared by many lines.
ANSWERED_BATCH = 2048


Prefilled = set[tuple[str, tuple[Message, ...]]]
"""(tenant, system messages) already prefilled into the engine's prefix cache: a warmup sent in many batches
prefills each system prompt once, not once per batch (its owner clears it when the engine's cache is flushed)."""

#: Past this many remembered system prompts the memo starts over (a re-prefill costs one short engine call).
PREFILLED_MAX = 4096


async def _prefill(pipeline: RequestPipeline, calls: list[Call]) -> None:
    """One token with just each call's system prompt, kept nowhere: only the engine's prefix cache keeps it, so the
    first real request that shares it skips its prefill."""
    for call in calls:
        try:
            await _drain(pipeline, msgspec.structs.replace(
                call, policy="bypass", warmup=True, request=GenerationRequest(
                    messages=(*_system_prompt(call), Message("user", "")),
                    params=SamplingParams(max_tokens=1, temperature=0.0), salt=call.request.salt)))
        except EdgeCacheError:
            pass  # an optimisation only: the lines are stored either way


async def _store_answered(pipeline: RequestPipeline, answered: list[tuple[int, Call, str]]) -> list[LineResult]:
    results = []
    for start in range(0, len(answered), ANSWERED_BATCH):
        batch = answered[start:start + ANSWERED_BATCH]
        try:
            outcomes = await pipeline.store_known_answers([(call, answer) for _, call, answer in batch])
        except EdgeCacheError as exc:
            results.extend(LineResult(line=number, outcome="failed", detail=exc.message) for number, _, _ in batch)
            continue
        for (number, _, _), written in zip(batch, outcomes):
            if written is None:
                results.append(LineResult(line=number, outcome="failed",
                                          detail="not stored: the result store refused the write (see /health)"))
            else:
                results.append(LineResult(line=number, outcome="written" if written else "skipped"))
    return results


async def _group_answers(pipeline: RequestPipeline, calls: list[tuple[int, Call, str | None]],
                         groups: dict[int, str]) -> tuple[list[tuple[int, Call, str | None]], list[LineResult]]:
    """Every grouped line with its group's answer: the one a line gives, else the answer of the group's first line
    run through the request path (its own cache entries only: a semantic hit of another question is no answer
    for the group). A group whose answer could not be computed fails as a whole."""
    given: dict[GroupKey, str] = {}
    for number, call, answer in calls:
        if answer is not None and number in groups:
            given.setdefault((call.tenant, call.scenario, groups[number]), answer)
    results: list[LineResult] = []
    failed: dict[GroupKey, str] = {}
    for number, call, _ in calls:
        key = (call.tenant, call.scenario, groups.get(number, ""))
        if number not in groups or key in given or key in failed:
            continue
        try:
            served, text = await _answer(pipeline, msgspec.structs.replace(call, policy="exact-only"))
        except EdgeCacheError as exc:
            failed[key] = f"group {groups[number]!r}: its answer was not computed (line {number}): {exc.message}"
            continue
        given[key] = text
        results.append(LineResult(line=number, outcome="written" if served == "miss" else "skipped", detail=served))
    done = {r.line for r in results}
    out: list[tuple[int, Call, str | None]] = []
    for number, call, answer in calls:
        key = (call.tenant, call.scenario, groups.get(number, ""))
        if number in done:
            continue
        if number in groups and key in failed:
            results.append(LineResult(line=number, outcome="failed", detail=failed[key]))
        else:
            out.append((number, call, given[key] if number in groups else answer))
    return out, results


async def warm(pipeline: RequestPipeline, calls: list[tuple[int, Call, str | None]],
               prefilled: Prefilled | None = None, groups: dict[int, str] | None = None) -> list[LineResult]:
    """Warm the caches with ``(line number, call, known answer or None)``; one result per line. ``groups``: the
    group of each grouped line, by line number (checked by :func:`check_groups` first).

    Answered lines go in batches through :meth:`RequestPipeline.store_known_answers` (that is what makes
    onboarding a tenant's FAQ fast), while each distinct system prompt among them not in ``prefilled`` is
    prefilled into the engine. Lines without an answer are run through the request path one by one, like
    requests. Grouped lines take their group's answer, and then teach the semantic learner
    (:meth:`RequestPipeline.teach_groups`), unless every one of them was already answered (the same file warmed
    again teaches nothing twice)."""
    results: list[LineResult] = []
    groups = groups or {}
    every = calls
    if groups:
        check_groups([(number, call, answer, groups.get(number)) for number, call, answer in calls])
        calls, results = await _group_answers(pipeline, calls, groups)
    prefilled = set() if prefilled is None else prefilled
    if len(prefilled) > PREFILLED_MAX:
        prefilled.clear()
    answered = [(number, call, answer) for number, call, answer in calls if answer is not None]
    systems = []
    for _, call, _ in answered:
        system = _system_prompt(call)
        if system and (call.tenant, system) not in prefilled:
            prefilled.add((call.tenant, system))
            systems.append(call)
    # The prefills (engine calls) run beside the store writes and embeddings (store and embedder threads), not
    # before them: a warmup takes the longer of the two, not their sum.
    prefills = asyncio.create_task(_prefill(pipeline, systems))
    try:
        results.extend(await _store_answered(pipeline, answered))
    finally:
        await prefills
    for number, call, answer in calls:
        if answer is not None:
            continue
        try:
            served = await _drain(pipeline, msgspec.structs.replace(call, warmup=True))
            results.append(LineResult(line=number, outcome="written" if served == "miss" else "skipped",
                                      detail=served))
        except EdgeCacheError as exc:
            results.append(LineResult(line=number, outcome="failed", detail=exc.message))
    outcome = {r.line: r.outcome for r in results}
    grouped = [(call, groups[number]) for number, call, _ in every if number in groups
               and outcome.get(number) != "failed"]
    if any(outcome.get(number) == "written" for number in groups):
        await pipeline.teach_groups(grouped)
    return sorted(results, key=lambda r: r.line)
