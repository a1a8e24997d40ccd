"""A stand-in for the parts of ``sglang.Engine`` that :mod:`edgecache.engines.sglang` uses.

SGLang needs a CUDA GPU, so the adapter's tests run against this double. It reproduces the shapes and behaviours
the adapter depends on, as read in SGLang's source (``python/sglang/srt/entrypoints/engine.py``,
``managers/tokenizer_manager.py``, ``managers/tokenizer_control_mixin.py``, ``managers/schedule_batch.py``):

- ``Engine(**kwargs)`` takes ``ServerArgs`` fields and rejects unknown ones (a dataclass ``TypeError``), and binds
  ``self.loop`` to the running loop, or makes a new one.
- ``await async_generate(..., stream=True, rid=..., cache_salt=...)`` returns an async generator of
  ``{"text", "output_ids", "meta_info"}``; ``text`` is cumulative unless ``incremental_streaming_output`` is set.
  ``meta_info`` has ``id``, ``prompt_tokens``, ``completion_tokens``, ``cached_tokens`` and ``finish_reason``:
  ``None`` until the end, then ``{"type": "stop", "matched": ...}`` (the end-of-sequence token's id, or the stop
  string of ``sampling_params["stop"]`` that ended the text, trimmed from it), ``{"type": "length", "length": n}``
  or ``{"type": "abort", "message": ..., "status_code": ..., "err_type": ...}``.
- ``cached_tokens`` comes from a radix cache namespaced by ``cache_salt``: a prompt reuses the longest prefix of
  an earlier prompt with the same salt, never one of another salt, and at least its last token is recomputed.
- ``tokenizer_manager.abort_request(rid)`` is synchronous, ignores unknown rids and makes a running request end
  with an abort finish reason.
- ``flush_cache()`` / ``get_server_info()`` call ``self.loop.run_until_complete`` and so raise ``RuntimeError``
  inside a running loop; ``tokenizer_manager.flush_cache()`` (``success`` is false, with an empty message, while
  requests run) and ``tokenizer_manager.get_internal_state()`` (one dict per DP rank) are their async bodies.
- Launching runs ``logging.basicConfig(force=True, level=log_level)`` (``configure_logger``), replacing the root
  handlers. The tokenizer manager's first request, flush or state call (``auto_create_handle_loop``) adds SIGTERM
  and SIGQUIT handlers to the running loop when on the main thread; SGLang's SIGTERM handler drains, kills the
  process's children and exits, the double's records that it ran.
- A request SGLang refuses: sampling parameters out of range (``SamplingParams.verify``) and a prompt of
  ``context_length`` tokens or more raise ``ValueError`` from the stream before any output; a JSON schema the grammar
  backend cannot compile ends the stream with an abort of status 400.

The key sets below are SGLang's own; tests/test_sglang_contract.py checks each against the pinned wheel's source.

Tests script what the "model" writes with :class:`Script`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import threading
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
        "hicache_size",
        "hicache_mem_layout",
        "hicache_storage_backend",
        "hicache_storage_backend_extra_config",
        "incremental_streaming_output",
    }
)
# The host layouts the double's host tier takes (SGLang takes more; the adapter passes one of these).
HICACHE_MEM_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_first_kv_split", "page_head")

# ``mem_cache/utils.py`` as far as the storage salt goes: the pinned release's two functions, word for word
# (tests/test_sglang_contract.py compares them with the wheel's), and an older release's, whose hash chains start
# from the parent's hash alone, so two tenants' identical pages get one name (the file tier served tenant B the
# pages tenant A wrote).
SALTED_STORAGE_SOURCE = '''
import hashlib
from typing import Any, List, Optional


def storage_namespace_seed(
    extra_key: Optional[str], cache_salt: Optional[str]
) -> Optional[str]:
    """Seed storage chains; preserve unnamespaced keys and Rust byte parity."""
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    # Presence and UTF-8 byte length distinguish absent, empty and joined parts.
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()


def get_storage_hash_str(
    key: Any,
    prior_hash: Optional[str] = None,
    page_size: Optional[int] = None,
) -> str | List[str]:
    """Seed new storage chains with the request namespace."""
    if prior_hash is None:
        prior_hash = storage_namespace_seed(
            getattr(key, "extra_key", None), getattr(key, "cache_salt", None)
        )
    return get_hash_str(key, prior_hash, page_size=page_size)
'''
UNSALTED_STORAGE_SOURCE = '''
import hashlib
from typing import List, Optional


def get_hash_str(token_ids: List[int], prior_hash: Optional[str] = None) -> str:
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(prior_hash))
    for t in token_ids:
        hasher.update(t.to_bytes(4, byteorder="little", signed=False))
    return hasher.hexdigest()
'''


def storage_sources(utils_source: str | None) -> Any:
    """A source reader for ``SGLangEngine(source_reader=...)``: SGLang's ``srt/mem_cache/utils.py`` reads as
    ``utils_source`` (``None``: SGLang is not there)."""
    def read(relative: str) -> str | None:
        return utils_source if relative == "srt/mem_cache/utils.py" else None

    return read
RADIX_EVICTION_POLICY_CHOICES = ("lru", "lfu", "slru", "priority", "tlru")
# The keys of each finish reason's ``to_json()`` (``managers/schedule_batch.py``).
FINISH_REASON_KEYS = {
    "stop": frozenset({"type", "matched"}),
    "length": frozenset({"type", "length"}),
    "abort": frozenset({"type", "message", "status_code", "err_type"}),
}
# The ``meta_info`` keys of a generation's every output (``_handle_batch_output`` in ``tokenizer_manager.py``; with
# metrics, logprobs or multimodal input it adds more).
META_INFO_KEYS = frozenset({"id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
                            "reasoning_tokens", "completion_tokens", "cached_tokens"})
# ``get_internal_state()``: the figures beside the server arguments, and the keys of its ``memory_usage``.
INTERNAL_STATE_FIGURES = frozenset({"world_size", "startup_time", "effective_max_running_requests_per_dp",
                                    "last_gen_throughput", "memory_usage"})
MEMORY_USAGE_KEYS = frozenset({"weight", "kvcache", "startup_available", "token_capacity", "token_capacity_swa",
                               "graph"})
FLUSH_OUTPUT_FIELDS = frozenset({"success", "message"})
DEFAULT_CONTEXT_LENGTH = 4096

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

    chat_template = _DEFAULT_TEMPLATE

    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        *,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        return_dict: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        # Like transformers: tools and any extra keyword become template variables.
        template = jinja2.Template(chat_template or _DEFAULT_TEMPLATE)
        text = template.render(messages=conversation, add_generation_prompt=add_generation_prompt, tools=tools,
                               **template_kwargs)
        return self.encode(text) if tokenize else text

    # Like a HF tokenizer, the ChatML markers in text become one special id each, unless split_special_tokens.
    SPECIALS = {"<|im_start|>": 0, "<|im_end|>": 3}

    @property
    def all_special_tokens(self) -> list[str]:
        return list(self.SPECIALS)

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
        self.context_len = int(server_args.get("context_length") or DEFAULT_CONTEXT_LENGTH)
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self.sigterm_received = 0

    def auto_create_handle_loop(self) -> None:
        if self.event_loop is not None:
            return
        loop = asyncio.get_event_loop()
        self.event_loop = loop
        if threading.current_thread() is threading.main_thread():
            loop.add_signal_handler(signal.SIGTERM, self._sigterm_handler)
            loop.add_signal_handler(signal.SIGQUIT, lambda: None)

    def _sigterm_handler(self) -> None:
        self.sigterm_received += 1  # SGLang's drains its requests, kills this process's children and exits

    @staticmethod
    def verify(sampling_params: dict[str, Any]) -> None:
        """``SamplingParams.verify`` for the parameters the adapter sends (its defaults where absent)."""
        p = {"temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "top_k": -1, "frequency_penalty": 0.0,
             "presence_penalty": 0.0, "repetition_penalty": 1.0, "max_new_tokens": 128, **sampling_params}
        if p["temperature"] < 0.0:
            raise ValueError(f"temperature must be a non-negative finite number, got {p['temperature']}.")
        if not 0.0 < p["top_p"] <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p['top_p']}.")
        if not 0.0 <= p["min_p"] <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {p['min_p']}.")
        if p["top_k"] < 1 and p["top_k"] != -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {p['top_k']}.")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= p[name] <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {p[name]}.")
        if not 0.0 < p["repetition_penalty"] <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {p['repetition_penalty']}.")
        if p["max_new_tokens"] < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {p['max_new_tokens']}.")

    async def generate_request(
        self, rid: str, input_ids: list[int], sampling_params: dict[str, Any], stream: bool, cache_salt: str | None
    ) -> AsyncIterator[dict[str, Any]]:
        self.auto_create_handle_loop()
        self.verify(sampling_params)
        if len(input_ids) >= self.context_len:
            raise ValueError(f"The input ({len(input_ids)} tokens) is longer than the model's context length "
                             f"({self.context_len} tokens).")
        script = self.script
        state: dict[str, Any] = {"aborted": False}
        self.rid_to_state[rid] = state
        schema = sampling_params.get("json_schema")
        if schema is not None and '"format": "int32"' in json.dumps(json.loads(schema)):
            # xgrammar refuses formats it does not know; the scheduler aborts the request with status 400.
            self.rid_to_state.pop(rid)
            reason = {"type": "abort", "status_code": 400, "err_type": "BadRequestError",
                      "message": "Failed to compile json_schema grammar: unsupported format int32"}
            yield {"text": "", "output_ids": [], "meta_info": self._meta(rid, reason, len(input_ids), 0, 0)}
            return
        cached = self._match_prefix(cache_salt, input_ids)
        max_new = int(sampling_params.get("max_new_tokens", 128))
        pieces = script.pieces[:max_new]
        stops = [str(stop) for stop in sampling_params.get("stop") or ()]
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
                if finish is None or finish["type"] != "abort":
                    # A stop string ends the answer there, trimmed from it (SGLang's default: no_stop_trim off).
                    hits = sorted((at, len(stop), stop) for stop in stops if (at := (text + piece).find(stop)) >= 0)
                    if hits:
                        at, _, stop = hits[0]
                        piece = (text + piece)[len(text):at]
                        finish = {"type": "stop", "matched": stop}
                text += piece
                meta = self._meta(rid, finish, len(input_ids),
                                  i + (0 if finish and finish["type"] == "abort" else 1), cached)
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

    @staticmethod
    def _meta(rid: str, finish: dict[str, Any] | None, prompt: int, completion: int, cached: int) -> dict[str, Any]:
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": prompt, "weight_version": "default",
                "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": completion, "cached_tokens": cached}
        assert set(meta) == META_INFO_KEYS
        return meta

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
        self.auto_create_handle_loop()
        self.flush_calls += 1
        if self.rid_to_state:
            return FlushCacheReqOutput(success=False)  # the scheduler only logs why
        self.radix.clear()
        return FlushCacheReqOutput(success=True)

    async def get_internal_state(self) -> list[dict[str, Any]]:
        self.auto_create_handle_loop()
        return [
            {
                **self.server_args,
                "world_size": 1,
                "startup_time": 12.5,
                "effective_max_running_requests_per_dp": 48,
                "last_gen_throughput": 42.5,
                "memory_usage": {"weight": 0.3, "kvcache": 1.25, "startup_available": 20.0, "token_capacity": 4096,
                                 "token_capacity_swa": None, "graph": {"target": 0.1, "draft": None}},
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
        if kwargs.get("hicache_mem_layout", "page_first") not in HICACHE_MEM_LAYOUTS:
            raise ValueError(f"invalid hicache_mem_layout {kwargs['hicache_mem_layout']!r}")
        self.storage_dir: str | None = None
        if kwargs.get("hicache_storage_backend") is not None:
            if not kwargs.get("enable_hierarchical_cache"):
                raise ValueError("a HiCache storage backend needs --enable-hierarchical-cache")
            # The file backend makes its directory (HiCacheFile.__init__) from the JSON extra config.
            extra = json.loads(str(kwargs.get("hicache_storage_backend_extra_config") or "{}"))
            self.storage_dir = str(extra.get("file_storage_path") or "/tmp/hicache")
        logging.basicConfig(level=str(kwargs.get("log_level", "info")).upper(), format="[%(asctime)s] %(message)s",
                            force=True)
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


class TiktokenTokenizerDouble:
    """SGLang's ``TiktokenTokenizer`` (``python/sglang/srt/tokenizer/tiktoken_tokenizer.py``) over an in-memory
    ``tiktoken.Encoding`` (one token per byte, no file): ``encode(x, add_special_tokens=False)`` always parses the
    special tokens and takes no other keyword; ``tokenizer`` is the Encoding; the chat template ``strip()``s text."""

    SPECIALS = ("<|separator|>", "<|eos|>")

    def __init__(self) -> None:
        import tiktoken

        self.tokenizer = tiktoken.Encoding(
            name="double", pat_str=r"\S+|\s+", mergeable_ranks={bytes([b]): b for b in range(256)},
            special_tokens={s: 256 + i for i, s in enumerate(self.SPECIALS)})
        self.chat_template = (
            "{% for message in messages %}{% if message['role'] == 'user' %}{{ 'Human: ' + message['content'].strip()"
            " + '<|separator|>\n\n' }}{% elif message['role'] == 'system' %}{{ 'System: ' + "
            "message['content'].strip() + '<|separator|>\n\n' }}{% elif message['role'] == 'assistant' %}{{ "
            "'Assistant: '  + message['content'] + '<|separator|>\n\n' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
        self._template = jinja2.Template(self.chat_template)

    def encode(self, x: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer.encode(x, allowed_special="all"))

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool, add_generation_prompt: bool,
                            tools: Any = None, reasoning_effort: Any = None, **kwargs: Any) -> str | list[int]:
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text) if tokenize else text


class MistralCommonTokenizer:
    """transformers' mistral-common tokenizer as SGLang loads it for a bare tekken checkpoint: the chat goes
    straight to ids (control tokens have no text form), each message's text encoded as text, and ``encode`` refuses
    ``split_special_tokens``."""

    BOS, INST, END_INST, EOS = 1, 3, 4, 2

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        if split_special_tokens:
            raise ValueError("`MistralCommonBackend` does not support `return_offsets_mapping` and "
                             "`split_special_tokens`.")
        return [b + 10 for b in text.encode()]

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: Any = None,
                            add_generation_prompt: bool = False, tokenize: bool = True, return_dict: bool = True,
                            **kwargs: Any) -> list[int] | str:
        if not tokenize:
            # rendering to text loses the control tokens; the adapter must not take this road
            return "".join(f"[INST]{m['content']}[/INST]" for m in conversation)
        ids = [self.BOS]
        for m in conversation:
            if m["role"] == "user":
                ids += [self.INST, *self.encode(m["content"]), self.END_INST]
            elif m["role"] == "assistant":
                ids += [*self.encode(m["content"]), self.EOS]
        return ids
