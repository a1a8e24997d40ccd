"""The engine protocol: what the request path needs from a model runtime, and nothing more.

An engine turns one :class:`GenerationRequest` into an async stream of :class:`Chunk`. Each chunk carries a text
delta (never cumulative text: adapters for runtimes that stream cumulative text convert it), and the last one carries
the token counts, the engine's prefix-cache hit (``cached_tokens``) and the finish reason. An engine that fails or is
aborted raises :class:`~edgecache.errors.EngineError` from the stream; it never ends the stream quietly, because the
request path caches every stream that ends without an exception.

Implementations (picked by name in :mod:`edgecache.engines`):

- ``llamacpp``: llama-cpp-python on the CPU, with a byte-bounded prefix (state) cache per salt.
- ``sglang``: ``sglang.Engine`` in this process (GPU profiles).
- ``openai``: an upstream OpenAI-compatible server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal, Protocol, runtime_checkable

import msgspec

Role = Literal["system", "user", "assistant", "tool", "developer"]
FinishReason = Literal["stop", "length"]


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    role: Role
    content: str


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Every parameter that changes what the model writes. All of it goes into the cache key."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class GenerationRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One generation. Exactly one of ``messages`` (chat) and ``prompt`` (raw completion) is set.

    ``salt`` namespaces the engine's prefix cache: requests with different salts never share cached prefixes
    (the tenant id goes here; SGLang calls it ``cache_salt``).
    """

    messages: tuple[Message, ...] | None = None
    prompt: str | None = None
    params: SamplingParams = SamplingParams()
    salt: str = ""


class Chunk(msgspec.Struct, kw_only=True):
    """A piece of a generation. ``text`` is the delta since the previous chunk.

    Token counts are cumulative and only meaningful on the last chunk (the one with ``finish_reason`` set).
    """

    text: str = ""
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@runtime_checkable
class Engine(Protocol):
    """A model runtime behind the cache.

    ``model_id`` is the name clients use; ``version`` identifies the weights and config (it goes into every cache
    key, so a different model never answers from an old entry).
    """

    model_id: str
    version: str

    async def start(self) -> None:
        """Load the model. Called once by the app's lifespan before the server reports ready."""

    async def check_prompt(self, request: GenerationRequest) -> None:
        """Raise BadRequest (``context_length_exceeded``) for a prompt the context cannot hold. Called before the
        request queues for the engine or is embedded, so it must not wait behind a running generation."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        """Stream one generation. Closing the iterator early aborts the generation."""
        ...

    async def flush(self) -> None:
        """Drop the engine's prefix cache."""

    async def stats(self) -> dict[str, float | int | str]:
        """Engine-side figures for /stats (prefix cache size, hit counts, ...)."""
        ...

    async def close(self) -> None:
        """Release the model. Safe to call twice."""
