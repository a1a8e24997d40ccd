"""A stand-in for the parts of ``sglang.Engine`` that :mod:`edgecache.engines.sglang` uses.

SGLang needs a CUDA GPU, so the adapter's tests run against this double. It reproduces the shapes and behaviours
the adapter depends on, as read in SGLang's source (``python/sglang/srt/entrypoints/engine.py``,
``managers/tokenizer_manager.py``, ``managers/tokenizer_control_mixin.py``, ``managers/schedule_batch.py``):

- ``Engine(**kwargs)`` takes ``ServerArgs`` fields and rejects unknown ones (a dataclass ``TypeError``), and binds
  ``self.loop`` to the running loop, or makes a new one.
- ``await async_generate(..., stream=True, rid=..., cache_salt=...)`` returns an async generator of
  ``{"text", "output_ids", "meta_info"}``; ``text`` is cumulative unless ``incremental_streaming_output`` is set.
  ``meta_info`` has ``id``, ``prompt_tokens``, ``completion_tokens``, ``cached_tokens`` and ``finish_reason``:
  ``None`` until the end, then ``{"type": "stop", "matched": ...}``, ``{"type": "length", "length": n}`` or
  ``{"type": "abort", "message": ..., "status_code": ..., "err_type": ...}``.
- ``cached_tokens`` comes from a radix cache namespaced by ``cache_salt``: a prompt reuses the longest prefix of
  an earlier prompt with the same salt, never one of another salt, and at least its last token is recomputed.
- ``tokenizer_manager.abort_request(rid)`` is synchronous, ignores unknown rids and makes a running request end
  with an abort finish reason.
- ``flush_cache()`` / ``get_server_info()`` call ``self.loop.run_until_complete`` and so raise ``RuntimeError``
  inside a running loop; ``tokenizer_manager.flush_cache()`` (``success`` is false while requests run) and
  ``tokenizer_manager.get_internal_state()`` (one dict per DP rank) are their async bodies.

Tests script what the "model" writes with :class:`Script`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import jinja2

# The ServerArgs fields this double accepts (a subset of SGLang's, enough for the adapter).
SERVER_ARG_FIELDS = frozenset(
    {
        "model_path",
        "served_model_name",
        "log_level",
        "mem_fraction_static",
        "max_running_requests",
        "chunked_prefill_size",
        "context_length",
        "radix_eviction_policy",
        "enable_hierarchical_cache",
        "incremental_streaming_output",
    }
)
RADIX_EVICTION_POLICY_CHOICES = ("lru", "lfu", "slru", "priority")

BOS_ID = 1
EOS_ID = 2

_DEFAULT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclasses.dataclass
class Script:
    """What the next generation writes: one token per piece of text."""

    pieces: list[str] = dataclasses.field(default_factory=lambda: ["Hello", ",", " world"])
    abort_after: int | None = None
    """End with an abort finish reason after this many pieces."""
    abort_message: str = "Abort in waiting queue"
    raise_after: int | None = None
    """Raise ``error`` after this many pieces."""
    error: Exception = dataclasses.field(default_factory=lambda: ValueError("scheduler crashed"))
    hold: asyncio.Event | None = None
    """When set, each piece after the first waits for this event (lets a test stop reading mid-stream)."""


class FakeTokenizer:
    """A byte-level tokenizer with a ChatML template; ``encode`` adds a BOS unless told not to."""

    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        *,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        # Like transformers: tools and any extra keyword become template variables.
        template = jinja2.Template(chat_template or _DEFAULT_TEMPLATE)
        text = template.render(messages=conversation, add_generation_prompt=add_generation_prompt, tools=tools,
                               **template_kwargs)
        return self.encode(text) if tokenize else text

    # Like a HF tokenizer, the ChatML markers in text become one special id each, unless split_special_tokens.
    SPECIALS = {"<|im_start|>": 0, "<|im_end|>": 3}

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        rest = text
        while rest:
            hits = [(rest.find(m), m) for m in self.SPECIALS if not split_special_tokens and m in rest]
            if not hits:
                ids += [b + 4 for b in rest.encode()]
                break
            at, marker = min(hits)
            ids += [b + 4 for b in rest[:at].encode()]
            ids.append(self.SPECIALS[marker])
            rest = rest[at + len(marker):]
        return [BOS_ID, *ids] if add_special_tokens else ids


@dataclasses.dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


class FakeTokenizerManager:
    def __init__(self, server_args: dict[str, Any]) -> None:
        self.server_args = server_args
        self.tokenizer = FakeTokenizer()
        self.incremental_streaming_output = bool(server_args.get("incremental_streaming_output", False))
        self.rid_to_state: dict[str, dict[str, Any]] = {}
        self.script = Script()
        self.radix: dict[str | None, list[list[int]]] = {}
        self.aborted: list[str] = []
        self.closed_streams: list[str] = []
        self.flush_calls = 0

    async def generate_request(
        self, rid: str, input_ids: list[int], sampling_params: dict[str, Any], stream: bool, cache_salt: str | None
    ) -> AsyncIterator[dict[str, Any]]:
        script = self.script
        state: dict[str, Any] = {"aborted": False}
        self.rid_to_state[rid] = state
        cached = self._match_prefix(cache_salt, input_ids)
        max_new = int(sampling_params.get("max_new_tokens", 128))
        pieces = script.pieces[:max_new]
        text = ""
        try:
            for i, piece in enumerate(pieces):
                if i > 0 and script.hold is not None:
                    await script.hold.wait()
                await asyncio.sleep(0)
                if script.raise_after is not None and i == script.raise_after:
                    raise script.error
                finish: dict[str, Any] | None = None
                if state["aborted"] or (script.abort_after is not None and i == script.abort_after):
                    finish = {"type": "abort", "message": script.abort_message, "status_code": 500, "err_type": None}
                    piece = ""
                elif i == len(pieces) - 1:
                    if len(script.pieces) > max_new:
                        finish = {"type": "length", "length": max_new}
                    else:
                        finish = {"type": "stop", "matched": EOS_ID}
                text += piece
                meta = {
                    "id": rid,
                    "finish_reason": finish,
                    "prompt_tokens": len(input_ids),
                    "completion_tokens": i + (0 if finish and finish["type"] == "abort" else 1),
                    "cached_tokens": cached,
                }
                out_text = piece if (stream and self.incremental_streaming_output) else text
                if finish is not None or stream:
                    yield {"text": out_text, "output_ids": [], "meta_info": meta}
                if finish is not None:
                    self.rid_to_state.pop(rid, None)
                    return
        finally:
            if rid in self.rid_to_state:
                self.rid_to_state.pop(rid)
                self.closed_streams.append(rid)

    def _match_prefix(self, salt: str | None, ids: list[int]) -> int:
        """Longest cached prefix among earlier prompts with the same salt; the last token is always recomputed."""
        seen = self.radix.setdefault(salt, [])
        best = 0
        for earlier in seen:
            n = 0
            for a, b in zip(earlier, ids, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        seen.append(list(ids))
        return min(best, len(ids) - 1)

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        if rid not in self.rid_to_state:
            return
        self.aborted.append(rid)
        self.rid_to_state[rid]["aborted"] = True

    async def flush_cache(self, timeout_s: float | None = None) -> FlushCacheReqOutput:
        self.flush_calls += 1
        if self.rid_to_state:
            return FlushCacheReqOutput(success=False, message="Cache not flushed because there are pending requests.")
        self.radix.clear()
        return FlushCacheReqOutput(success=True)

    async def get_internal_state(self) -> list[dict[str, Any]]:
        return [
            {
                **self.server_args,
                "last_gen_throughput": 42.5,
                "memory_usage": {"kvcache": 1.25, "token_capacity": 4096},
                "waiting_queue_size": 0,
                "running_batch_size": len(self.rid_to_state),
                "engine_paused": False,
            }
        ]


class FakeSGLangEngine:
    """``sglang.Engine`` as far as the adapter sees it (single requests only; the real one also takes batches)."""

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - SERVER_ARG_FIELDS
        if unknown:
            raise TypeError(f"ServerArgs.__init__() got an unexpected keyword argument {min(unknown)!r}")
        if "model_path" not in kwargs:
            raise TypeError("ServerArgs.__init__() missing 1 required positional argument: 'model_path'")
        policy = kwargs.get("radix_eviction_policy", "lru")
        if policy not in RADIX_EVICTION_POLICY_CHOICES:
            raise ValueError(f"invalid radix_eviction_policy {policy!r}")
        self.server_args = kwargs
        self.tokenizer_manager = FakeTokenizerManager(kwargs)
        self.calls: list[dict[str, Any]] = []
        self.shutdown_calls = 0
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = asyncio.new_event_loop()

    async def async_generate(
        self,
        prompt: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | None = None,
        return_logprob: bool | None = False,
        stream: bool = False,
        rid: str | None = None,
        priority: int | None = None,
        *,
        cache_salt: str | None = None,
    ) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
        self.calls.append(
            {
                "prompt": prompt,
                "input_ids": input_ids,
                "sampling_params": sampling_params,
                "stream": stream,
                "rid": rid,
                "cache_salt": cache_salt,
            }
        )
        if prompt is not None and input_ids is not None:
            raise ValueError("Either text or input_ids should be provided.")
        ids = list(input_ids) if input_ids is not None else self.tokenizer_manager.tokenizer.encode(prompt or "")
        generator = self.tokenizer_manager.generate_request(
            str(rid),
            ids,
            dict(sampling_params or {}),
            stream,
            cache_salt,
        )
        if stream is True:
            return generator
        return await generator.__anext__()

    def flush_cache(self) -> FlushCacheReqOutput:
        coroutine = self.tokenizer_manager.flush_cache()
        try:
            result: FlushCacheReqOutput = self.loop.run_until_complete(coroutine)
        except RuntimeError:
            coroutine.close()  # the real one leaks an un-awaited coroutine here; the double stays quiet
            raise
        return result

    def get_server_info(self) -> dict[str, Any]:
        coroutine = self.tokenizer_manager.get_internal_state()
        try:
            states = self.loop.run_until_complete(coroutine)
        except RuntimeError:
            coroutine.close()
            raise
        return {**self.server_args, "internal_states": states}

    def shutdown(self) -> None:
        self.shutdown_calls += 1


class OldFakeSGLangEngine(FakeSGLangEngine):
    """An SGLang release whose ``async_generate`` has no ``cache_salt`` (tenant isolation impossible)."""

    async def async_generate(  # type: ignore[override]
        self,
        prompt: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | None = None,
        stream: bool = False,
        rid: str | None = None,
    ) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
        return await super().async_generate(
            prompt=prompt, sampling_params=sampling_params, input_ids=input_ids, stream=stream, rid=rid
        )
