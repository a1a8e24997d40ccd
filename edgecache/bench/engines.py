"""A scripted engine for the tests of the cache layers and the benchmarks that need no model: deterministic answers,
call counting, gates and faults."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from edgecache.engines.base import Chunk, GenerationRequest
from edgecache.errors import BadRequest, EngineError


class FakeEngine:
    """Answers ``"answer to: <last message or prompt>"`` in ``pieces`` chunks.

    ``gate``: when set, every generation waits for it before its first chunk (to line up concurrent requests).
    ``fail_after``: raise EngineError after that many text chunks (a failure mid-stream).
    ``marker``: prefixed to every answer (tests of isolation make leaks visible this way).
    ``cached_tokens``: the prompt tokens it reports its prefix cache served (at most the prompt's).
    """

    kind = "FakeEngine"
    features: frozenset[str] = frozenset()  # plain sampling only

    def __init__(self, *, model_id: str = "fake-model", version: str = "fake@1", pieces: int = 4,
                 delay_s: float = 0.0, fail_after: int | None = None, marker: str = "") -> None:
        self.model_id = model_id
        self.version = version
        self.pieces = pieces
        self.delay_s = delay_s
        self.fail_after = fail_after
        self.marker = marker
        self.gate: asyncio.Event | None = None
        self.calls = 0
        self.running = 0
        self.max_running = 0
        self.completed = 0
        self.aborted = 0
        self.requests: list[GenerationRequest] = []
        self.started = False
        self.closed = False
        self.flushed = 0
        self.context_chars: int | None = None
        self.cached_tokens = 0

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True

    async def check_prompt(self, request: GenerationRequest) -> None:
        """A prompt of more than ``context_chars`` characters is over the context (when set)."""
        if self.context_chars is not None:
            size = len(request.prompt or "") + sum(len(m.content) for m in request.messages or ())
            if size > self.context_chars:
                raise BadRequest(f"the prompt has {size} characters; this fake's context holds "
                                 f"{self.context_chars}", code="context_length_exceeded")

    async def count_tokens(self, request: GenerationRequest) -> int:
        """Words, as the prompt_tokens of an answer count them."""
        await self.check_prompt(request)
        return self.prompt_tokens(request)

    @staticmethod
    def prompt_tokens(request: GenerationRequest) -> int:
        return len((request.prompt or "").split()) + sum(len(m.content.split()) for m in request.messages or ())

    async def flush(self) -> None:
        self.flushed += 1

    async def stats(self) -> dict[str, float | int | str]:
        return {"engine": "fake", "calls": self.calls}

    def answer_for(self, request: GenerationRequest) -> str:
        source = request.messages[-1].content if request.messages else request.prompt
        return f"{self.marker}answer to: {source}"

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        self.calls += 1
        self.requests.append(request)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        finished = False
        try:
            if self.gate is not None:
                await self.gate.wait()
            text = self.answer_for(request)
            size = max(1, -(-len(text) // self.pieces))
            parts = [text[i:i + size] for i in range(0, len(text), size)]
            for n, part in enumerate(parts):
                if self.fail_after is not None and n >= self.fail_after:
                    raise EngineError("the fake engine failed mid-stream")
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                yield Chunk(text=part)
            prompt_tokens = self.prompt_tokens(request)
            finished = True
            self.completed += 1
            yield Chunk(finish_reason="stop", prompt_tokens=prompt_tokens, completion_tokens=len(parts),
                        cached_tokens=min(self.cached_tokens, prompt_tokens))
        finally:
            self.running -= 1
            if not finished:
                self.aborted += 1
