"""Warmup: fill the caches before traffic arrives ("warm up before launch, always").

A prompts file is JSON lines, one request each::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}],
     "scenario": "support", "tenant": "acme", "ttl": 3600, "max_tokens": 64, "answer": "..."}

(``prompt`` instead of ``messages`` for a raw completion; every field but one of those two is optional.)

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
from edgecache.engines.base import GenerationRequest, Message, SamplingParams
from edgecache.errors import EdgeCacheError
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
    reply = await pipeline.serve(call)
    async with aclosing(reply.stream()) as chunks:
        async for _ in chunks:
            pass
    return reply.served


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


async def warm(pipeline: RequestPipeline, calls: list[tuple[int, Call, str | None]],
               prefilled: Prefilled | None = None) -> list[LineResult]:
    """Warm the caches with ``(line number, call, known answer or None)``; one result per line.

    Answered lines go in batches through :meth:`RequestPipeline.store_known_answers` (that is what makes
    onboarding a tenant's FAQ fast), while each distinct system prompt among them not in ``prefilled`` is
    prefilled into the engine. Lines without an answer are run through the request path one by one, like
    requests."""
    results: list[LineResult] = []
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
    return sorted(results, key=lambda r: r.line)
