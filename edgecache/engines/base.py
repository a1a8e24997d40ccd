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

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

Role = Literal["system", "user", "assistant", "tool", "developer"]
FinishReason = Literal["stop", "length", "tool_calls"]


class ToolCall(msgspec.Struct, frozen=True, array_like=True):
    """A function call the model made (or one in the history): its id, the function's name and its arguments, a JSON
    object as text."""

    id: str
    name: str
    arguments: str


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=False, omit_defaults=True):
    """A chat message. ``content`` is the caller's text: engines render it as text, never as control tokens.
    ``tool_calls`` (assistant) and ``tool_call_id`` (tool) carry a tool-using conversation's history."""

    role: Role
    content: str
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


class ToolSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """A function the model may call. ``parameters`` is its JSON schema as canonical JSON text (sorted keys), so
    the same tool always hashes the same.

    ``kind`` ``custom`` is OpenAI's free-form tool: its input is text, shaped by ``format`` (canonical JSON text:
    plain text or a grammar) instead of ``parameters``. No engine here honours it yet (feature ``custom_tools``)."""

    name: str
    description: str = ""
    parameters: str = "{}"
    strict: bool = False
    kind: Literal["function", "custom"] = "function"
    format: str = ""


class OutputFormat(msgspec.Struct, frozen=True, omit_defaults=True):
    """A structured-output constraint: any JSON object (``json_object``) or one matching ``schema`` (canonical JSON
    text) for ``json_schema``."""

    kind: Literal["json_object", "json_schema"]
    schema: str = ""
    name: str = ""
    strict: bool = False


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Every parameter that changes what the model writes. All of it goes into the cache key."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # SGLang's and vLLM's extensions; the defaults turn each off.
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs sorted by token id.
    logit_bias: tuple[tuple[int, float], ...] = ()


class CacheBreakpoint(msgspec.Struct, frozen=True, array_like=True):
    """Where a client asked the prefix cache to keep the prompt (an Anthropic ``cache_control`` breakpoint): the end
    of ``messages[message]`` (the system prompt is a message), or, with ``end`` set, the end of the block that ends
    at that character of its content; kept at least ``ttl_s`` from its last read."""

    message: int
    end: int | None = None
    ttl_s: float = 300.0


class CacheHints(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a client asked of the engine's prefix cache. It changes what is kept, never an answer, so it is not part
    of any key (:func:`answer_fields`).

    ``breakpoints``: Anthropic's ``cache_control`` marks, in the prompt's order. ``retention_s``: keep the whole
    prompt's prefix at least this long (OpenAI's ``prompt_cache_retention: "24h"``). ``memory_only``: keep it in
    RAM only (``"in_memory"``). ``key``: OpenAI's ``prompt_cache_key``, handed to an upstream server."""

    breakpoints: tuple[CacheBreakpoint, ...] = ()
    retention_s: float = 0.0
    memory_only: bool = False
    key: str = ""


class GenerationRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One generation. Exactly one of ``messages`` (chat) and ``prompt`` (raw completion) is set.

    ``salt`` namespaces the engine's prefix cache: requests with different salts never share cached prefixes
    (the tenant id goes here; SGLang calls it ``cache_salt``).

    Every field here but ``cache`` can change what the model writes, and the whole struct less ``cache`` goes into
    the cache key (:func:`answer_fields`); a request field that cannot change the output never reaches it (see
    :mod:`edgecache.http.request_surface`). Defaults mean "not asked for", so a plain request encodes (and hashes)
    without the rest.

    ``cache``: what the client asked the engine's prefix cache to keep (:class:`CacheHints`), None for nothing.

    ``tool_choice``: ``auto``, ``none``, ``required`` or the name of the one function to call.
    ``logprobs``: None for none; k >= 0 for each token's logprob and its k most likely alternatives.
    ``template_kwargs``: extra chat-template variables (``chat_template_kwargs``) as canonical JSON text.
    ``reasoning_effort`` / ``verbosity``: OpenAI's output controls, handed to the chat template as variables of
    those names (an upstream gets them as sent). Empty: not asked for.
    ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``: vLLM's (and SGLang's) stopping
    controls. Before ``min_tokens`` tokens nothing ends the answer (neither the end-of-sequence token, a stop token
    id nor a stop string); with ``ignore_eos`` only ``max_tokens`` does; a stop token id ends it like the
    end-of-sequence token (its text is not part of the answer); ``skip_special_tokens: false`` writes the special
    tokens the model generates as their text.
    """

    messages: tuple[Message, ...] | None = None
    prompt: str | None = None
    params: SamplingParams = SamplingParams()
    salt: str = ""
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    response_format: OutputFormat | None = None
    n: int = 1
    logprobs: int | None = None
    echo: bool = False
    template_kwargs: str = ""
    reasoning_effort: str = ""
    verbosity: str = ""
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    cache: CacheHints | None = None


def answer_fields(request: GenerationRequest) -> GenerationRequest:
    """The request less its cache hints: what decides the answer, and so what keys and ids are made of."""
    return request if request.cache is None else msgspec.structs.replace(request, cache=None)


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    token: str
    logprob: float
    bytes: tuple[int, ...] | None = None


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One generated token: its text, its logprob, its UTF-8 bytes and the most likely alternatives."""

    token: str
    logprob: float
    bytes: tuple[int, ...] | None = None
    top: tuple[TopLogprob, ...] = ()


class Choice(msgspec.Struct, frozen=True, array_like=True):
    """One whole choice of an answer (what the cache stores and replays): its text, tool calls and logprobs, and
    the :attr:`Chunk.stop_sequence` that ended it (the last field, so choices stored before it decode)."""

    index: int
    text: str
    finish_reason: FinishReason
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
    refusal: str | None = None
    stop_sequence: str | None = None


class Chunk(msgspec.Struct, kw_only=True):
    """A piece of a generation. ``text`` is the delta since the previous chunk.

    Token counts are cumulative and only meaningful on the last chunk (the one with ``finish_reason`` set), except
    that an engine may report ``prompt_tokens`` and ``cached_tokens`` ahead on text chunks too (0: not reported).

    ``stop_sequence`` (last chunk): which of the request's stop strings ended the answer, when one did; its
    ``finish_reason`` is then ``stop``. None when the end-of-sequence token (or a stop token id) ended it, and when
    the engine cannot tell. Anthropic's Messages report it (``stop_reason: "stop_sequence"``); OpenAI's have no
    field for it.

    A plain answer (one choice, text only) streams as text deltas. An answer with more to it (tool calls, logprobs,
    several choices) comes whole: its last chunk carries every :class:`Choice` in ``choices`` and no text deltas
    precede it, because tool calls are only known once complete (they are parsed from constrained output).
    """

    text: str = ""
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    #: Last chunk: the prefix-cache tier ``cached_tokens`` came from (``ram``, ``disk``; an upstream's or SGLang's
    #: own words where they report one), "" when none or unknown.
    cache_tier: str = ""
    #: Last chunk: why more of the prompt could have been cached and was not (``kv_tiers.KV_MISS_REASONS``), or "".
    kv_miss: str = ""
    #: Last chunk: the prompt tokens this call wrote to the prefix cache at the client's breakpoints, as
    #: ``(ttl_s, tokens)`` pairs (Anthropic's ``cache_creation_input_tokens`` and its split by ttl).
    cache_writes: tuple[tuple[float, int], ...] = ()
    choices: tuple[Choice, ...] | None = None
    stop_sequence: str | None = None
    #: Last chunk of a one-choice text answer: where each completion token ends in the answer's text, as a count of
    #: the text's UTF-8 bytes (the bytes a token leaves of a character it does not complete are counted: the text's
    #: bytes cut there, decoded with replacement, are what the engine writes when it stops after that token). None
    #: when the engine does not report them (then ``max_tokens`` stays in the request's key). A text chunk may carry
    #: the ends of the tokens decoded since the chunk before it (their text may follow in a later chunk, held back
    #: while it could still begin a stop string): an in-flight follower with a smaller ``max_tokens`` is cut there.
    token_ends: tuple[int, ...] | None = None


def cut_text(text: str, end: int) -> str:
    """``text`` cut after a token that ends at UTF-8 byte ``end`` (:attr:`Chunk.token_ends`): a character left
    incomplete becomes U+FFFD, as a decoder that is told the text ended there writes it."""
    return text.encode()[:end].decode("utf-8", "replace")


def matched_stop(reported: object, stops: tuple[str, ...]) -> str | None:
    """:attr:`Chunk.stop_sequence` from what a runtime reports it matched (vLLM's ``stop_reason``, SGLang's
    ``matched``/``matched_stop``: a stop string, or the id of a stop token): the string when it is one of the
    request's ``stops``, else None (a token id, or nothing reported)."""
    return reported if isinstance(reported, str) and reported in stops else None


#: A stream's reader takes at most one delivery per this many seconds; the tokens produced meanwhile come as one
#: chunk. Below what a reader notices, above the time a fast engine takes for a token, so the relay's work per
#: delivery (a wake-up, a frame, a write; a socket read from an upstream) is not paid per token. Used by a flight's
#: listeners (``Flight.follow``) and by the upstream engine's reads (``engines/http_transport``).
STREAM_BATCH_S = 0.005


#: The request fields, beyond messages/prompt and plain sampling, that an engine may or may not honour; each engine
#: lists those it does in :attr:`Engine.features`, and a request that uses another is refused naming the field (the
#: first missing one in this order: custom_tools leads, being the more precise word for a request with custom tools).
FEATURES = ("custom_tools", "tools", "tool_choice", "response_format", "n", "logprobs", "top_logprobs", "echo",
            "top_k", "min_p", "repetition_penalty", "logit_bias", "chat_template_kwargs", "min_tokens", "ignore_eos",
            "stop_token_ids", "skip_special_tokens")


@runtime_checkable
class Engine(Protocol):
    """A model runtime behind the cache.

    ``model_id`` is the name clients use; ``version`` identifies the weights and config (it goes into every cache
    key, so a different model never answers from an old entry).

    ``kind`` names the engine in errors; ``features`` lists the request fields beyond plain sampling that it
    honours (of :data:`FEATURES`): a request using another one is refused with a 400 that names the field and the
    engine, never silently ignored.

    An engine may also say ``prefix_stable`` (read with :func:`prefix_stable_of`; absent means ""): "" when it does
    not report :attr:`Chunk.token_ends`; ``greedy`` when it does and temperature 0 decodes the same tokens whatever
    ``max_tokens`` is; ``seeded`` when sampling with a seed does too (tested against the engine itself). Then
    ``max_tokens`` leaves such requests' keys (:func:`edgecache.keys.prefix_stable`).
    """

    model_id: str
    version: str
    kind: str
    features: frozenset[str]

    async def start(self) -> None:
        """Load the model. Called once by the app's lifespan before the server reports ready."""

    async def check_prompt(self, request: GenerationRequest) -> None:
        """Raise BadRequest (``context_length_exceeded``) for a prompt the context cannot hold. Called before the
        request queues for the engine or is embedded, so it must not wait behind a running generation."""

    async def count_tokens(self, request: GenerationRequest) -> int:
        """The prompt's tokens as the engine would feed them (the chat template and the tools included): what
        Anthropic's ``count_tokens`` answers. Raises BadRequest where :meth:`generate` would refuse the prompt."""
        ...

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


@runtime_checkable
class AnswerTokens(Protocol):
    """An engine that counts a given answer in its model's tokens (a prefix-stable one does: a warmup line's
    answer then serves every ``max_tokens``, cut where it is longer)."""

    async def answer_token_ends(self, texts: Sequence[str]) -> list[tuple[int, ...] | None]:
        """Each text as the model's tokens spell it: where each token ends in the text's UTF-8 bytes
        (:attr:`Chunk.token_ends`); None for a text the tokens do not spell back exactly."""
        ...


def prefix_stable_of(engine: object) -> str:
    """The engine's ``prefix_stable`` rule (see :class:`Engine`): "", ``greedy`` or ``seeded``."""
    rule = getattr(engine, "prefix_stable", "")
    return rule if rule in ("greedy", "seeded") else ""


@runtime_checkable
class TieredPrefixEngine(Protocol):
    """An engine whose prefix cache EdgeCache keeps itself, in tiers with per-tenant budgets (llama.cpp's): the
    runtime tells it each tenant's share and where to report storage faults, flushes one tenant's states, and shows
    what each tenant holds in each tier."""

    has_disk_tier: bool

    def attach(self, *, share_for: Callable[[str], float], faults: Any) -> None:
        """Before ``start``: a tenant's share of the budgets (0-1], and a :class:`edgecache.health.StorageFaults`."""

    async def flush_tenant(self, tenant: str | None) -> int:
        """Drop a tenant's (None: everyone's) prefix states from every tier; returns how many."""
        ...

    def prefix_cache_usage(self) -> dict[str, dict[str, int]]:
        """Each tenant's prefix-cache bytes by tier."""
        ...
