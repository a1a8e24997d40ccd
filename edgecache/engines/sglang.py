"""The ``sglang`` engine: an ``sglang.Engine`` in this process, with its radix prefix cache (GPU profiles).

SGLang is an optional extra (``pip install "edgecache[gpu]"``) and is imported only when :meth:`SGLangEngine.start`
runs, so the package imports, and every other engine works, on a machine without it.

What this adapter relies on in SGLang (``python/sglang/srt/entrypoints/engine.py`` and
``python/sglang/srt/managers/tokenizer_manager.py``):

- ``sglang.Engine(**server_args)``: the keyword arguments are ``ServerArgs`` fields.
- ``await engine.async_generate(prompt=... | input_ids=..., sampling_params={...}, stream=True, rid=...,
  cache_salt=...)`` returns an async generator of dicts ``{"text", "output_ids", "meta_info"}``. ``text`` is the
  whole output so far, unless the engine runs with ``incremental_streaming_output``, when it is the new piece.
  ``meta_info`` carries ``prompt_tokens``, ``completion_tokens``, ``cached_tokens`` and ``finish_reason``: ``None``
  while running, then ``{"type": "stop" | "length" | "abort", ...}`` (an abort also has ``message``).
- ``engine.flush_cache()`` and ``engine.get_server_info()`` call ``loop.run_until_complete`` and therefore fail
  inside a running event loop; their bodies await ``engine.tokenizer_manager.flush_cache()`` and
  ``engine.tokenizer_manager.get_internal_state()``, which is what this adapter awaits instead.
- ``engine.tokenizer_manager.abort_request(rid)`` stops a request; closing the output generator alone does not
  tell the scheduler, so the adapter calls it when a consumer stops reading early.
- ``engine.shutdown()`` kills the engine's child processes (scheduler, detokenizer).
- Launching replaces the root logging handlers and the tokenizer manager's first use adds a SIGTERM handler to the
  running loop; the adapter puts both back (:func:`_logging_kept`, :func:`_keep_sigterm`), so EdgeCache's logs keep
  going and a SIGTERM is EdgeCache's graceful stop.
- ``tokenizer_manager.tokenizer`` is an HF tokenizer, SGLang's ``TiktokenTokenizer`` or a mistral-common one
  (:func:`sglang_chat_prompt_encoder`).
- Structured output: ``sampling_params["json_schema"]`` (a JSON schema as text) constrains decoding
  (``python/sglang/srt/sampling/sampling_params.py``); SGLang's own OpenAI route uses the same parameter to force a
  tool call when ``tool_choice`` is ``required`` or names a function (``get_json_schema_constraint`` in
  ``python/sglang/srt/function_call/utils.py``, called from ``FunctionCallParser.get_structure_constraint`` in
  ``python/sglang/srt/function_call/function_call_parser.py``). ``top_k``, ``min_p`` and ``repetition_penalty`` are
  sampling parameters of the same names.

The hierarchical cache (HiCache, ``mem_cache/``): ``enable_hierarchical_cache`` adds a host-memory tier under the
GPU's radix cache, sized by ``hicache_size`` (GB of 10**9 bytes); ``hicache_storage_backend="file"`` adds a storage
tier whose directory is ``hicache_storage_backend_extra_config``'s ``file_storage_path`` (JSON), unless the variable
``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR`` is set, which wins (``HiCacheFile.__init__`` in ``hicache_storage.py``), and
whose byte cap is its ``max_size`` (``storage/file/lru_file_evictor.py``). The file names carry the page's hash, the
served model's name and the TP rank, never the weights, the KV dtype or the host layout
(``hicache_mem_layout``), so this adapter gives each (model fingerprint, KV dtype, layout) its own directory. A page's
hash chain starts from ``storage_namespace_seed(extra_key, cache_salt)`` (``mem_cache/utils.py``), so one tenant's
pages never answer another's lookup; a release without that seed would, and an L3 tier is refused on it
(:func:`storage_salt_problem`, read from SGLang's source before it launches).

Every name, keyword and key listed here is checked against the source of the pinned release
(:data:`SGLANG_REQUIREMENT`) by tests/test_sglang_contract.py, in CI, without CUDA.

Tools are rendered by the model's chat template (``apply_chat_template(..., tools=...)``, as HF templates do) when
it mentions tools, else described in the system prompt (as on the llama.cpp engine); a
forced call is constrained by the JSON schema of ``{"name", "arguments"}`` (:mod:`edgecache.engines.structured_output`)
and the output parsed as such an object (optionally in ``<tool_call>`` tags: the hermes/qwen25 format). SGLang's
per-model ``FunctionCallParser`` detectors (other native tool-call formats) are not wired in. ``n``, logprobs,
``echo`` and ``logit_bias`` are refused with a 400 naming the field and this engine.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import os
import re
import signal
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec

from edgecache.engines.base import (
    Choice,
    Chunk,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    ToolCall,
    matched_stop,
)
from edgecache.engines.chat_prompt import ChatPromptEncoder
from edgecache.engines.structured_output import (
    chat_for_template,
    output_schema,
    parse_tool_calls,
    template_controls,
    template_message,
    tool_call_id,
)
from edgecache.errors import BadRequest, EngineError, NotReady, PromptTooLong

SGLANG_REQUIREMENT = "sglang>=0.5.23,<0.5.24"
"""The SGLang releases this adapter is checked against (tests/test_sglang_contract.py reads their source in CI);
pyproject's ``gpu`` extra pins the same range."""
INSTALL_HINT = f'pip install "edgecache[gpu]" ({SGLANG_REQUIREMENT} + onnxruntime-gpu), on a machine with a CUDA GPU'

STATE_FIGURES = ("last_gen_throughput", "effective_max_running_requests_per_dp", "avg_spec_accept_length")
"""The figures of ``get_internal_state()`` (``managers/scheduler_components/internal_state.py``) that /stats
reports as ``sglang_<key>``, beside every number in its ``memory_usage`` as ``sglang_memory_<key>``. The rest of the
state repeats the server arguments."""

# SGLang's sampling parameter names -> the request field a client set (for the 400 naming it).
_REQUEST_FIELD = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed",
                  "json_schema": "response_format"}
_REFUSED_FIELD = re.compile(r"^(\w+) must ")

# Files whose change changes what the model writes: the weights, the architecture, the tokenizer and its chat
# template. Their names, sizes and modification times (not their bytes: weights are gigabytes) feed the version.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json")


class SGLangOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How to build the in-process SGLang engine. The hardware profile fills these in.

    ``None`` leaves the choice to SGLang, which sizes it from the GPU it finds.
    """

    model_path: str
    """A local model directory or a Hugging Face model id."""
    served_model_name: str | None = None
    """The name clients use; defaults to the last part of ``model_path``."""
    mem_fraction_static: float | None = None
    """Share of GPU memory for weights plus the KV pool."""
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    context_length: int | None = None
    radix_eviction_policy: Literal["lru", "lfu"] = "lru"
    enable_hierarchical_cache: bool = False
    """Spill evicted KV prefixes to host memory instead of dropping them."""
    hicache_size_gb: int | None = None
    """The host tier's size in GB (10**9 bytes, SGLang's ``hicache_size``); ``None`` lets SGLang size it."""
    hicache_storage_root: str | None = None
    """Where the ``file`` storage tier keeps its directories (one per model fingerprint, KV dtype and layout, made
    by :meth:`SGLangEngine.start`); ``None``: no storage tier."""
    hicache_storage_bytes: int = 0
    """The storage tier's byte cap per directory (SGLang's file evictor ``max_size``); 0: no cap."""
    hicache_mem_layout: Literal["layer_first", "page_first"] = "page_first"
    """The host tier's memory layout, which the stored pages share (passed with a storage tier, so the directory's
    name and SGLang's layout cannot disagree)."""
    incremental_streaming_output: bool = False
    """Ask SGLang for text deltas instead of cumulative text (saves O(n^2) copying on long outputs)."""
    chat_template: str | None = None
    """A Jinja chat template that replaces the tokenizer's own."""
    log_level: str = "error"

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("sglang: model_path is empty")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"sglang: mem_fraction_static must be between 0 and 1, got {self.mem_fraction_static}")
        for name in ("max_running_requests", "chunked_prefill_size", "context_length"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"sglang: {name} must be positive, got {value}")
        if self.hicache_size_gb is not None and self.hicache_size_gb < 1:
            raise ValueError(f"sglang: hicache_size_gb must be at least 1, got {self.hicache_size_gb}")
        if self.hicache_storage_bytes < 0:
            raise ValueError(f"sglang: hicache_storage_bytes cannot be negative, got {self.hicache_storage_bytes}")
        if not self.enable_hierarchical_cache and (self.hicache_size_gb is not None
                                                   or self.hicache_storage_root is not None):
            raise ValueError("sglang: a host or storage KV tier needs the hierarchical cache "
                             "(engine.hierarchical_cache = true)")

    def model_id(self) -> str:
        return self.served_model_name or Path(self.model_path.rstrip("/")).name

    def server_args(self, *, storage_dir: Path | None = None) -> dict[str, object]:
        """The keyword arguments for ``sglang.Engine``; ``storage_dir`` is the file tier's directory for this model
        (:func:`hicache_storage_dir`), given only with :attr:`hicache_storage_root`.

        Optional settings and settings left at SGLang's own default are omitted rather than passed: older SGLang
        releases reject unknown arguments (``radix_eviction_policy`` and ``incremental_streaming_output`` are
        recent), and leaving a default out means the same thing on every release.
        """
        if (storage_dir is None) != (self.hicache_storage_root is None):
            raise ValueError("sglang: a storage directory goes with hicache_storage_root, and only with it")
        args: dict[str, object] = {"model_path": self.model_path, "log_level": self.log_level}
        if self.served_model_name is not None:
            args["served_model_name"] = self.served_model_name
        optional = {
            "mem_fraction_static": self.mem_fraction_static,
            "max_running_requests": self.max_running_requests,
            "chunked_prefill_size": self.chunked_prefill_size,
            "context_length": self.context_length,
        }
        args.update({name: value for name, value in optional.items() if value is not None})
        if self.radix_eviction_policy != "lru":
            args["radix_eviction_policy"] = self.radix_eviction_policy
        if self.enable_hierarchical_cache:
            args["enable_hierarchical_cache"] = True
        if self.hicache_size_gb is not None:
            args["hicache_size"] = self.hicache_size_gb
        if storage_dir is not None:
            extra: dict[str, object] = {"file_storage_path": str(storage_dir)}
            if self.hicache_storage_bytes:
                extra["max_size"] = self.hicache_storage_bytes
            args["hicache_storage_backend"] = "file"
            args["hicache_mem_layout"] = self.hicache_mem_layout
            args["hicache_storage_backend_extra_config"] = json.dumps(extra)
        if self.incremental_streaming_output:
            args["incremental_streaming_output"] = True
        return args


STORAGE_DIR_VARIABLE = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
"""SGLang's variable for the file tier's directory; it wins over the directory this adapter passes."""
STORAGE_SALT_SOURCE = "srt/mem_cache/utils.py"
"""Where SGLang seeds its storage hash chains, relative to the sglang package."""


def read_sglang_source(relative: str) -> str | None:
    """The text of one of the installed SGLang's source files (``srt/mem_cache/utils.py``), found without importing
    more than the ``sglang`` package itself; ``None`` when SGLang or the file is not there."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / relative
        if path.is_file():
            return path.read_text(encoding="utf-8")
    return None


def storage_salt_problem(source: str | None) -> str | None:
    """Why a storage tier on the SGLang whose ``mem_cache/utils.py`` reads ``source`` would not be salted per tenant,
    or ``None`` when it is: ``storage_namespace_seed(extra_key, cache_salt)`` must hash the salt, and
    ``get_storage_hash_str`` must start a page's hash chain from it, with the key's ``cache_salt``."""
    if source is None:
        return f"SGLang's {STORAGE_SALT_SOURCE} cannot be read, so whether its storage tier is salted is unknown"
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return f"SGLang's {STORAGE_SALT_SOURCE} does not parse ({exc})"
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    seed = functions.get("storage_namespace_seed")
    if seed is None:
        return "this SGLang has no storage_namespace_seed: its storage hash chains are not namespaced by cache_salt"
    if [a.arg for a in seed.args.args][:2] != ["extra_key", "cache_salt"]:
        return "this SGLang's storage_namespace_seed does not take (extra_key, cache_salt)"
    if "cache_salt" not in {n.id for n in ast.walk(seed) if isinstance(n, ast.Name)}:
        return "this SGLang's storage_namespace_seed does not hash cache_salt"
    chain = functions.get("get_storage_hash_str")
    seeded = chain is not None and any(
        isinstance(call, ast.Call) and ast.unparse(call.func) == "storage_namespace_seed"
        and "cache_salt" in ast.unparse(call) for call in ast.walk(chain))
    if not seeded:
        return "this SGLang's get_storage_hash_str does not start its hash chains from the key's cache_salt"
    return None


def hicache_storage_dir(root: Path, model_id: str, fingerprint: str, kv_dtype: str, layout: str) -> Path:
    """The file tier's directory for one model (by its weights' fingerprint), KV dtype and host layout: SGLang's file
    names include none of these, so pages of different ones must never share a directory."""
    def part(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "x"

    return root / f"{part(model_id)}-{part(fingerprint)}" / f"kv-{part(kv_dtype)}" / part(layout)


def model_kv_dtype(model_dir: Path) -> str:
    """The KV dtype SGLang's ``kv_cache_dtype = "auto"`` gives this model: the model's own dtype, as its config.json
    states it (``torch_dtype``, or ``dtype`` in newer configs); ``auto`` when it states none."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "auto"
    dtype = config.get("torch_dtype") or config.get("dtype") if isinstance(config, dict) else None
    return f"auto-{dtype}" if isinstance(dtype, str) and dtype else "auto"


class SGLangRuntime(Protocol):
    """The part of ``sglang.Engine`` this adapter uses (the test double implements the same)."""

    tokenizer_manager: Any

    async def async_generate(self, *args: Any, **kwargs: Any) -> Any: ...

    def shutdown(self) -> None: ...


EngineFactory = Callable[..., SGLangRuntime]
"""Builds the runtime from ``SGLangOptions.server_args()``; the default imports sglang."""


def load_sglang_engine(**server_args: object) -> SGLangRuntime:
    """The default factory: ``sglang.Engine(**server_args)``, importing sglang only now.

    ``import sglang`` imports nothing heavy (``sglang.Engine`` is a lazy import), so the engine's module is imported
    here by name: a missing torch or CUDA library then shows as a broken install, not as a failed start.
    """
    try:
        import sglang
    except ImportError as exc:
        if exc.name is not None and exc.name != "sglang" and not exc.name.startswith("sglang."):
            raise EngineError(
                f"sglang is installed but failed to import ({exc}); reinstall with {INSTALL_HINT}"
            ) from exc
        raise EngineError(f"the sglang engine needs SGLang, which is not installed: {INSTALL_HINT}") from exc
    version = getattr(sglang, "__version__", "") or importlib.metadata.version("sglang")
    if not sglang_version_supported(version):
        raise EngineError(f"sglang {version} is installed, but this EdgeCache is checked against "
                          f"{SGLANG_REQUIREMENT} only: pip install '{SGLANG_REQUIREMENT}'")
    try:
        from sglang.srt.entrypoints.engine import Engine
    except ImportError as exc:
        # sglang is there but one of its own dependencies (torch, CUDA libraries, ...) is not.
        raise EngineError(f"sglang is installed but failed to import ({exc}); reinstall with {INSTALL_HINT}") from exc
    engine: SGLangRuntime = Engine(**server_args)
    return engine


def sglang_version_supported(version: str) -> bool:
    """Whether an SGLang release (``0.5.23``, ``0.5.23.post1``) lies in :data:`SGLANG_REQUIREMENT`."""
    def release(text: str) -> tuple[int, ...]:
        match = re.match(r"\d+(?:\.\d+)*", text)
        return tuple(int(part) for part in match.group().split(".")) if match else ()

    bounds = dict(re.findall(r"(>=|<)([\d.]+)", SGLANG_REQUIREMENT))
    return release(bounds[">="]) <= release(version) < release(bounds["<"])


def sglang_chat_prompt_encoder(tokenizer: Any) -> ChatPromptEncoder | None:
    """How chats become ids on the tokenizer SGLang loaded (``get_tokenizer`` in
    ``python/sglang/srt/utils/hf_transformers/tokenizer.py``); None for mistral-common, which encodes chats to
    ids itself.

    - an HF tokenizer: ``encode(..., split_special_tokens=True)`` keeps control spellings as text;
    - SGLang's ``TiktokenTokenizer``: its ``encode`` always parses the special tokens and takes no such keyword,
      so text goes through tiktoken's own ``encode_ordinary``;
    - ``MistralCommonTokenizer`` / ``MistralCommonBackend``: refuses ``split_special_tokens``, and rendering to
      text and encoding again loses its control tokens, so the chat is encoded straight to ids.
    """
    if tokenizer is None or type(tokenizer).__name__.startswith("MistralCommon"):
        return None
    tiktoken = getattr(tokenizer, "tokenizer", None)
    if tiktoken is not None and hasattr(tiktoken, "encode_ordinary"):
        return ChatPromptEncoder(encode_prompt=tokenizer.encode, encode_text=tiktoken.encode_ordinary,
                                 control_spellings=tiktoken.special_tokens_set)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return ChatPromptEncoder(
        encode_prompt=lambda text: list(tokenizer.encode(text, add_special_tokens=False)),
        encode_text=lambda text: list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)),
        control_spellings=[*getattr(tokenizer, "all_special_tokens", ()),
                           *(t.content for t in added.values() if getattr(t, "special", False))])


def model_fingerprint(model_dir: Path, *, extra: str = "") -> str:
    """A short hash of a model directory: config and tokenizer files by content, weight files by name, size and
    modification time. ``extra`` folds in anything else that changes outputs (e.g. a chat template override)."""
    digest = hashlib.sha256(extra.encode())
    for name in _CONFIG_FILES:
        path = model_dir / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    for path in sorted(p for p in model_dir.rglob("*") if p.suffix in _WEIGHT_SUFFIXES):
        stat = path.stat()  # follows the symlinks of a Hugging Face snapshot to the blobs
        digest.update(f"{path.relative_to(model_dir)}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:16]


def _local_model_dir(model_path: str) -> Path | None:
    """The directory holding the model: the path itself, or the local snapshot of a hub id (SGLang has just
    downloaded it, so no network is needed)."""
    path = Path(model_path).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download  # a dependency of sglang
    except ImportError:
        return None
    try:
        return Path(snapshot_download(model_path, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means "no local snapshot"; the caller falls back to the id
        return None


def _sampling_params(params: SamplingParams) -> dict[str, object]:
    """Our sampling parameters in SGLang's names (``python/sglang/srt/sampling/sampling_params.py``)."""
    out: dict[str, object] = {
        "max_new_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
    }
    if params.stop:
        out["stop"] = list(params.stop)
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    for name, value, off in (("top_k", params.top_k, 0), ("min_p", params.min_p, 0.0),
                             ("repetition_penalty", params.repetition_penalty, 1.0)):
        if value != off:
            out[name] = value
    return out


def _stopping(request: GenerationRequest) -> dict[str, object]:
    """vLLM's stopping controls in SGLang's names (each only when asked for). SGLang trims a stop token's text
    (``no_stop_trim`` off), as the other engines do."""
    out: dict[str, object] = {}
    if request.min_tokens:
        out["min_new_tokens"] = request.min_tokens
    if request.ignore_eos:
        out["ignore_eos"] = True
    if request.stop_token_ids:
        out["stop_token_ids"] = list(request.stop_token_ids)
    if not request.skip_special_tokens:
        out["skip_special_tokens"] = False
    return out


def _constraint(request: GenerationRequest) -> dict[str, object]:
    """The structured-output sampling parameter for this request, if any (SGLang's ``json_schema``)."""
    schema = output_schema(request)
    if schema is None and request.response_format is not None:
        schema = {"type": "object"}  # json_object: any JSON object
    return {"json_schema": json.dumps(schema)} if schema is not None else {}


def _stop_sequence(meta_info: Mapping[str, Any], request: GenerationRequest) -> str | None:
    """The stop string a ``stop`` finish matched (``{"type": "stop", "matched": ...}``: the string, or a token id)."""
    reason = meta_info.get("finish_reason")
    return matched_stop(reason.get("matched") if isinstance(reason, Mapping) else None, request.params.stop)


def _finish_reason(meta_info: Mapping[str, Any], request: GenerationRequest) -> FinishReason | None:
    """Map SGLang's finish reason; an abort (or anything we do not know) is an error, never a quiet end. An abort
    with status 400 is SGLang refusing the request (e.g. a JSON schema its grammar backend cannot compile)."""
    reason = meta_info.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, Mapping) else reason
    if kind == "stop":
        return "stop"
    if kind == "length":
        return "length"
    if kind == "abort":
        message = reason.get("message") if isinstance(reason, Mapping) else None
        if isinstance(reason, Mapping) and reason.get("status_code") == 400:
            raise refusal(str(message or "no reason given"), request)
        raise EngineError(f"SGLang aborted the generation: {message or 'no reason given'}")
    raise EngineError(f"SGLang finished with an unknown reason: {reason!r}")


#: SGLang's words for a prompt its context cannot hold (``TokenizerManager._validate_one_request``).
_TOO_LONG = re.compile(r"The input \((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)")


def refusal(message: str, request: GenerationRequest) -> BadRequest:
    """SGLang's refusal of a request (a ``ValueError`` before any output, as its own HTTP server turns into a 400,
    or an abort with status 400) as the 400 naming the request field it is about."""
    text = f"SGLang refused the request: {message}"
    if "context length" in message:
        field = "max_tokens" if message.startswith("Requested token count") else (
            "messages" if request.messages is not None else "prompt")
        counts = _TOO_LONG.match(message)
        if counts is not None:
            return PromptTooLong(text, param=field, tokens=int(counts[1]), context=int(counts[2]))
        return BadRequest(text, param=field, code="context_length_exceeded")
    if message.startswith("Failed to compile"):  # the grammar of json_schema (a forced tool call or a schema)
        return BadRequest(text, param="tools" if output_schema(request) is not None and request.tools
                          else "response_format")
    named = _REFUSED_FIELD.match(message)
    return BadRequest(text, param=_REQUEST_FIELD.get(named.group(1), named.group(1)) if named else None)


class _TextDeltas:
    """Turns SGLang's output texts into deltas, whichever way the engine streams them."""

    def __init__(self, *, incremental: bool) -> None:
        self._incremental = incremental
        self._sent = ""

    def delta(self, text: str | None, *, final: bool) -> str:
        text = text or ""
        if self._incremental:
            return text
        # Hold back a trailing U+FFFD until the final chunk: it stands for a multi-byte character whose remaining
        # bytes have not been decoded yet, and the next cumulative text replaces it with the real character.
        stable = text if final else text.rstrip("\ufffd")
        if not stable.startswith(self._sent):
            raise EngineError("SGLang rewrote text it had already streamed")
        piece = stable[len(self._sent) :]
        self._sent = stable
        return piece


@contextlib.contextmanager
def _logging_kept() -> Iterator[None]:
    """Puts the process's logging back as it was once SGLang has launched: its launch runs
    ``logging.basicConfig(force=True, level=<log_level>)`` (``configure_logger`` in ``utils/common.py``), which
    removes the root handlers ``edgecache serve`` set (access and error logs would go quiet), or
    ``logging.config.dictConfig`` with ``SGLANG_LOGGING_CONFIG_PATH``, which disables the loggers that exist."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    enabled = [logger for logger in logging.root.manager.loggerDict.values()
               if isinstance(logger, logging.Logger) and not logger.disabled]
    try:
        yield
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)
        for logger in enabled:
            logger.disabled = False


def _keep_sigterm(engine: SGLangRuntime, on_sigterm: Any) -> None:
    """Keep SIGTERM EdgeCache's.

    On its first request, flush or state call SGLang's tokenizer manager (``auto_create_handle_loop`` in
    ``managers/tokenizer_manager.py``) adds a SIGTERM handler to the running loop that drains SGLang's requests, kills
    this process's children and calls ``sys.exit(0)``: the server's graceful stop and the lifespan (store flush,
    index save, engine close) would never run. So the adapter makes that first call itself, now, and puts back the
    handler that was there (uvicorn's graceful stop). SGLang's SIGQUIT handler (a child process died) stays.
    SGLang adds handlers only on the main thread; elsewhere there is nothing to take back.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    engine.tokenizer_manager.auto_create_handle_loop()
    asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
    signal.signal(signal.SIGTERM, on_sigterm if on_sigterm is not None else signal.SIG_DFL)


class SGLangEngine:
    """The :class:`~edgecache.engines.base.Engine` backed by an in-process ``sglang.Engine``."""

    kind = "sglang"
    features = frozenset({"tools", "tool_choice", "response_format", "top_k", "min_p", "repetition_penalty",
                          "chat_template_kwargs", "min_tokens", "ignore_eos", "stop_token_ids",
                          "skip_special_tokens"})

    def __init__(self, options: SGLangOptions, *, engine_factory: EngineFactory = load_sglang_engine,
                 source_reader: Callable[[str], str | None] = read_sglang_source,
                 environ: Mapping[str, str] | None = None) -> None:
        self.options = options
        self._read_source = source_reader
        self._environ = os.environ if environ is None else environ
        self.storage_dir: Path | None = None
        """The file tier's directory, once start() has made it (None without a storage tier)."""
        self.model_id = options.model_id()
        self.version = ""  # known once start() has found the weights
        self._factory = engine_factory
        self._engine: SGLangRuntime | None = None
        self._chat_prompt: ChatPromptEncoder | None = None
        self._template_knows_tools = True
        self._closed = False
        self._requests = 0
        self._running_requests = 0
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._completion_tokens = 0

    async def start(self) -> None:
        """Load the model into the GPU (minutes), then fingerprint it.

        ``sglang.Engine`` is built on the event loop's thread on purpose: SGLang installs signal handlers at launch
        (possible only in the main thread) and binds to the running loop it finds. The lifespan runs this before
        the server takes traffic, so the blocked loop serves nobody meanwhile.
        """
        if self._engine is not None:
            return
        if self._closed:
            raise EngineError("the sglang engine was closed and cannot be started again")
        fingerprint = None
        if self.options.hicache_storage_root is not None:
            self.storage_dir, fingerprint = await asyncio.to_thread(self._prepare_storage)
        on_sigterm = signal.getsignal(signal.SIGTERM)
        try:
            with _logging_kept():
                engine = self._factory(**self.options.server_args(storage_dir=self.storage_dir))
        except EngineError:
            raise
        except Exception as exc:  # the boundary: SGLang's launch errors become one clean error
            raise EngineError(f"SGLang failed to start {self.options.model_path!r}: {exc}") from exc
        if "cache_salt" not in inspect.signature(engine.async_generate).parameters:
            # Without a per-request salt, tenants would share KV prefixes; refuse rather than leak.
            await asyncio.to_thread(engine.shutdown)
            raise EngineError(
                f"this SGLang has no per-request cache_salt, which tenant isolation needs: {INSTALL_HINT}"
            )
        _keep_sigterm(engine, on_sigterm)
        self._engine = engine
        tokenizer = engine.tokenizer_manager.tokenizer
        self._chat_prompt = sglang_chat_prompt_encoder(tokenizer)
        # A template that mentions tools renders them itself; otherwise they go into the system prompt (mistral-
        # common renders tools natively).
        template = self.options.chat_template or getattr(tokenizer, "chat_template", None) or ""
        self._template_knows_tools = self._chat_prompt is None or "tools" in str(template)
        self.version = (f"{self.model_id}@{fingerprint}" if fingerprint is not None
                        else await asyncio.to_thread(self._compute_version))

    def _prepare_storage(self) -> tuple[Path, str]:
        """Before SGLang launches: refuse a storage tier it would not salt per tenant, or whose directory SGLang's
        own variable would override; then make this model's directory. Returns it and the weights' fingerprint (the
        model version, so the directory and the cache keys name the same weights)."""
        problem = storage_salt_problem(self._read_source(STORAGE_SALT_SOURCE))
        if problem is not None:
            raise EngineError(f"engine.hicache_storage = file is refused: {problem}, so one tenant's KV pages could "
                              f"be read back for another. Use {SGLANG_REQUIREMENT}, or set engine.hicache_storage "
                              "= none")
        override = self._environ.get(STORAGE_DIR_VARIABLE)
        if override:
            raise EngineError(f"{STORAGE_DIR_VARIABLE}={override} is set and would put every model's KV pages in one "
                              "directory, over the one EdgeCache gives each model, KV dtype and layout: unset it")
        model_dir = _local_model_dir(self.options.model_path)
        if model_dir is None:
            raise EngineError(
                f"engine.hicache_storage = file keys its directory by the weights' fingerprint, so the model must be "
                f"on local disk before start: download it first (hf download {self.options.model_path}) or set "
                "engine.model to a local directory")
        fingerprint = model_fingerprint(model_dir, extra=self.options.chat_template or "")
        assert self.options.hicache_storage_root is not None
        directory = hicache_storage_dir(Path(self.options.hicache_storage_root), self.model_id, fingerprint,
                                        model_kv_dtype(model_dir), self.options.hicache_mem_layout)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EngineError(f"cannot make the KV storage directory {directory}: {exc}") from exc
        return directory, fingerprint

    def _compute_version(self) -> str:
        extra = self.options.chat_template or ""
        model_dir = _local_model_dir(self.options.model_path)
        if model_dir is None:
            fingerprint = hashlib.sha256(f"{self.options.model_path}\0{extra}".encode()).hexdigest()[:16]
        else:
            fingerprint = model_fingerprint(model_dir, extra=extra)
        return f"{self.model_id}@{fingerprint}"

    def _running(self) -> SGLangRuntime:
        if self._engine is None:
            raise NotReady("the sglang engine is not started" if not self._closed else "the sglang engine is closed")
        return self._engine

    def _chat_input_ids(self, engine: SGLangRuntime, request: GenerationRequest) -> list[int]:
        """Render the chat with the model's template and tokenize it, as SGLang's own chat route does, with the
        callers' text kept apart from control tokens (:mod:`edgecache.engines.chat_prompt`).

        Token ids rather than rendered text: the template already writes the special tokens, and tokenizing its
        text again would add a second BOS. Rendering stays on the loop thread because HF fast tokenizers are not
        safe to share across threads, and a prompt takes well under a millisecond.
        """
        tokenizer = engine.tokenizer_manager.tokenizer
        if tokenizer is None:
            raise EngineError("the SGLang engine has no tokenizer, so it cannot apply a chat template")
        messages, tools = chat_for_template(request, template_knows_tools=self._template_knows_tools)
        extra: dict[str, Any] = json.loads(request.template_kwargs) if request.template_kwargs else {}
        extra.update(template_controls(request))
        if tools is not None:
            extra["tools"] = tools
        if self.options.chat_template is not None:
            extra["chat_template"] = self.options.chat_template

        def apply(texts: list[str], *, tokenize: bool) -> Any:
            conversation = [template_message(m, text) for m, text in zip(messages, texts, strict=True)]
            try:
                return tokenizer.apply_chat_template(conversation, tokenize=tokenize, add_generation_prompt=True,
                                                     return_dict=False, **extra)
            except Exception as exc:  # jinja2's errors, the template's raise_exception: the request's fault
                raise BadRequest(f"the chat template refused these messages: {exc}", param="messages") from exc

        texts = [m.content for m in messages]
        try:
            if self._chat_prompt is None:
                # mistral-common encodes each message's text as text itself, and its control tokens have no text
                # form to render and encode again (SGLang's own chat route encodes straight to ids for this reason).
                return list(apply(texts, tokenize=True))
            return self._chat_prompt.ids(lambda marked: str(apply(marked, tokenize=False)), texts)
        except BadRequest:
            raise
        except Exception as exc:  # the boundary: the tokenizer's own failures
            raise EngineError(f"the tokenizer failed on this chat: {exc}") from exc

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        """Stream one generation as deltas; the last chunk carries counts and the finish reason."""
        engine = self._running()
        rid = f"edgecache-{uuid.uuid4().hex}"
        inputs: dict[str, object]
        if request.messages is not None:
            inputs = {"input_ids": self._chat_input_ids(engine, request)}
        else:
            inputs = {"prompt": request.prompt or ""}
        deltas = _TextDeltas(incremental=self.options.incremental_streaming_output)
        calls_tools = bool(request.tools) and request.tool_choice != "none"
        whole: list[str] = []  # a tool-using answer is parsed once complete, so it is collected, not streamed
        finished = started = False
        stream: Any = None
        self._running_requests += 1
        try:
            try:
                stream = await engine.async_generate(
                    **inputs,
                    sampling_params={**_sampling_params(request.params), **_stopping(request),
                                     **_constraint(request)},
                    stream=True,
                    rid=rid,
                    cache_salt=request.salt or None,
                )
                async for out in stream:
                    meta = out.get("meta_info") or {}
                    reason = _finish_reason(meta, request)
                    started = True
                    piece = deltas.delta(out.get("text"), final=reason is not None)
                    if reason is None:
                        if piece and calls_tools:
                            whole.append(piece)
                        elif piece:
                            yield Chunk(text=piece)
                        continue
                    finished = True
                    chunk = Chunk(
                        text=piece,
                        finish_reason=reason,
                        prompt_tokens=int(meta.get("prompt_tokens") or 0),
                        completion_tokens=int(meta.get("completion_tokens") or 0),
                        cached_tokens=int(meta.get("cached_tokens") or 0),
                        stop_sequence=_stop_sequence(meta, request) if reason == "stop" else None,
                    )
                    if calls_tools:
                        chunk = self._tool_answer(request, "".join(whole) + piece, chunk)
                    self._count(chunk)
                    yield chunk
                    return
            except (EngineError, BadRequest):
                raise
            except ValueError as exc:
                if started:
                    raise EngineError(f"SGLang failed during generation: {exc}") from exc
                raise refusal(str(exc), request) from exc  # its validation of the request, before any output
            except Exception as exc:  # the boundary: whatever SGLang raises mid-request becomes an EngineError
                raise EngineError(f"SGLang failed during generation: {exc}") from exc
            raise EngineError("SGLang ended the stream without a finish reason")
        finally:
            self._running_requests -= 1
            if not finished:
                # The consumer stopped early, or the request failed: free the scheduler slot and KV now instead of
                # letting the request decode to max_tokens for nobody. Abort before closing the stream: closing it
                # drops the request's state in the tokenizer manager, after which abort_request ignores the rid.
                engine.tokenizer_manager.abort_request(rid)
            if stream is not None:
                await stream.aclose()

    def _tool_answer(self, request: GenerationRequest, text: str, final: Chunk) -> Chunk:
        """The whole answer of a request with tools: a call when the text is one, else the text."""
        calls = parse_tool_calls(text, request, forced=request.tool_choice != "auto")
        assert final.finish_reason is not None
        choice = Choice(index=0, text=text, finish_reason=final.finish_reason, stop_sequence=final.stop_sequence)
        if calls:
            choice = Choice(index=0, text="", finish_reason="tool_calls", tool_calls=tuple(
                ToolCall(id=tool_call_id(request, 0, j), name=name, arguments=arguments)
                for j, (name, arguments) in enumerate(calls)))
        final.text = ""
        final.choices = (choice,)
        return final

    def _count(self, chunk: Chunk) -> None:
        self._requests += 1
        self._prompt_tokens += chunk.prompt_tokens
        self._cached_tokens += chunk.cached_tokens
        self._completion_tokens += chunk.completion_tokens

    async def check_prompt(self, request: GenerationRequest) -> None:
        """Nothing before the call: SGLang tokenizes on its own workers and refuses an over-long prompt itself,
        without holding up other requests."""

    async def count_tokens(self, request: GenerationRequest) -> int:
        """The ids generate would send, counted (rendered on the loop thread, as generate renders them)."""
        engine = self._running()
        if request.messages is not None:
            return len(self._chat_input_ids(engine, request))
        tokenizer = engine.tokenizer_manager.tokenizer
        if tokenizer is None:
            raise EngineError("the SGLang engine has no tokenizer to count with")
        return len(tokenizer.encode(request.prompt or ""))

    async def flush(self) -> None:
        """Drop the radix prefix cache. SGLang refuses while requests are running; that refusal is an error."""
        engine = self._running()
        try:
            result = await engine.tokenizer_manager.flush_cache()
        except Exception as exc:  # the boundary
            raise EngineError(f"SGLang failed to flush its cache: {exc}") from exc
        if not getattr(result, "success", False):
            # SGLang's scheduler refuses unless idle and says why only in its own log (the message is empty).
            reason = getattr(result, "message", "") or "requests are running (it flushes only when idle; try again)"
            raise EngineError(f"SGLang did not flush its prefix cache: {reason}")

    async def stats(self) -> dict[str, float | int | str]:
        """Our own counts of what the prefix cache saved, plus SGLang's scheduler figures (first DP rank)."""
        engine = self._running()
        try:
            states = await engine.tokenizer_manager.get_internal_state()
        except Exception as exc:  # the boundary
            raise EngineError(f"SGLang failed to report its state: {exc}") from exc
        out: dict[str, float | int | str] = {
            "engine": "sglang",
            "model": self.model_id,
            "version": self.version,
            "requests": self._requests,
            "running_requests": self._running_requests,
            "prompt_tokens": self._prompt_tokens,
            "cached_tokens": self._cached_tokens,
            "completion_tokens": self._completion_tokens,
            "prefix_hit_ratio": self._cached_tokens / self._prompt_tokens if self._prompt_tokens else 0.0,
        }
        state: Mapping[str, Any] = states[0] if states else {}
        # internal_state also repeats every server argument; only these figures describe the running engine.
        for key in STATE_FIGURES:
            value = state.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[f"sglang_{key}"] = value
        memory = state.get("memory_usage")
        if isinstance(memory, Mapping):
            for key, value in memory.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    out[f"sglang_memory_{key}"] = value
        return out

    async def close(self) -> None:
        """Shut SGLang down once; later calls do nothing.

        ``shutdown()`` kills every child process of this process (SGLang's scheduler and detokenizer, and anything
        else this process started) and waits for them, so it runs in a thread to keep the loop responsive.
        """
        engine, self._engine = self._engine, None
        self._closed = True
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)
