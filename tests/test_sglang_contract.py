"""The SGLang adapter's contract, checked against SGLang's real source: every name, signature, keyword, sampling
key, ``meta_info`` key, state key and finish-reason shape ``edgecache/engines/sglang.py`` relies on, and that the
double's key sets (``tests/sglang_double.py``) are the wheel's.

SGLang needs CUDA to run but not to be read: the test opens the pinned wheel (``pip download --no-deps``, which
``.ci/run`` puts in ``.sglang-wheel/``) as a zip and parses its Python files with ``ast``, importing nothing. A new
SGLang release that breaks the adapter fails here, in CI, instead of on a user's GPU box. Without the wheel the
tests skip (set ``SGLANG_CONTRACT_WHEEL_REQUIRED=1``, as CI does, to make that a failure).
"""

from __future__ import annotations

import ast
import functools
import os
import re
import tomllib
import typing
import zipfile
from pathlib import Path

import pytest

from edgecache.engines.base import GenerationRequest, Message, OutputFormat, SamplingParams
from edgecache.engines.sglang import (
    _REFUSED_FIELD,
    _REQUEST_FIELD,
    SGLANG_REQUIREMENT,
    STATE_FIGURES,
    STORAGE_DIR_VARIABLE,
    STORAGE_SALT_SOURCE,
    SGLangOptions,
    _constraint,
    _sampling_params,
    _stopping,
    sglang_version_supported,
    storage_salt_problem,
)
from edgecache.hardware import HICACHE_GB, SGLANG_HOST_RESERVE_BYTES
from tests import sglang_double

ROOT = Path(__file__).resolve().parents[1]
WHEEL_DIR = ROOT / ".sglang-wheel"
FETCH = f'pip download --no-deps --only-binary=:all: -d .sglang-wheel "{SGLANG_REQUIREMENT}"'

ENGINE = "sglang/srt/entrypoints/engine.py"
TOKENIZER_MANAGER = "sglang/srt/managers/tokenizer_manager.py"
CONTROL_MIXIN = "sglang/srt/managers/tokenizer_control_mixin.py"
SCHEDULE_BATCH = "sglang/srt/managers/schedule_batch.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
INTERNAL_STATE = "sglang/srt/managers/scheduler_components/internal_state.py"
MEMORY_USAGE = "sglang/srt/managers/scheduler_components/memory_usage.py"
SAMPLING_PARAMS = "sglang/srt/sampling/sampling_params.py"
GRAMMAR_MANAGER = "sglang/srt/constrained/grammar_manager.py"
TOKENIZER_LOADER = "sglang/srt/utils/hf_transformers/tokenizer.py"
TIKTOKEN = "sglang/srt/tokenizer/tiktoken_tokenizer.py"
COMMON_UTILS = "sglang/srt/utils/common.py"
FIELDS = "sglang/srt/arg_groups/fields/"
MEMORY_FIELDS = "sglang/srt/arg_groups/fields/memory.py"
MEM_CACHE_UTILS = "sglang/" + STORAGE_SALT_SOURCE
RADIX_CACHE = "sglang/srt/mem_cache/radix_cache.py"
HICACHE_STORAGE = "sglang/srt/mem_cache/hicache_storage.py"
FILE_EVICTOR = "sglang/srt/mem_cache/storage/file/lru_file_evictor.py"
HOST_POOL = "sglang/srt/mem_cache/pool_host/base.py"
CACHE_CONTROLLER = "sglang/srt/managers/cache_controller.py"
NATIVE_HASH = "sglang/srt/mem_cache/cpp_utils/native_hash.py"
HASH_BINDING = "sglang/srt/mem_cache/cpp_utils/hash_binding.cpp"
CHOICES = "sglang/srt/arg_groups/choices.py"
KV_CONFIGURATOR = "sglang/srt/mem_cache/kv_cache_configurator.py"


class Wheel:
    """The sources of one SGLang wheel, parsed on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.version = path.name.split("-")[1]
        self.zip = zipfile.ZipFile(path)

    @functools.cache
    def tree(self, name: str) -> ast.Module:
        return ast.parse(self.zip.read(name).decode("utf-8"), filename=name)

    def names(self, prefix: str) -> list[str]:
        return [n for n in self.zip.namelist() if n.startswith(prefix) and n.endswith(".py")]

    def cls(self, name: str, class_name: str) -> ast.ClassDef:
        for node in ast.walk(self.tree(name)):
            if isinstance(node, ast.ClassDef) and node.name == class_name:
                return node
        raise AssertionError(f"{name} defines no class {class_name}")

    def function(self, scope: ast.AST, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
        body = scope.body if isinstance(scope, ast.ClassDef | ast.Module) else []
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                return node
        raise AssertionError(f"{getattr(scope, 'name', 'the module')} has no {name}()")


def _find_wheel() -> Path | None:
    wheels = sorted(WHEEL_DIR.glob("sglang-*.whl")) if WHEEL_DIR.is_dir() else []
    wheels = [w for w in wheels if sglang_version_supported(w.name.split("-")[1])]
    return wheels[-1] if wheels else None


@pytest.fixture(scope="module")
def wheel() -> Wheel:
    path = _find_wheel()
    if path is None:
        reason = f"no sglang wheel in {SGLANG_REQUIREMENT} under .sglang-wheel/ (fetch it: {FETCH})"
        if os.environ.get("SGLANG_CONTRACT_WHEEL_REQUIRED"):
            pytest.fail(reason)
        pytest.skip(reason)
    return Wheel(path)


# --- reading the AST ---------------------------------------------------------------------------------------------

def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[list[str], list[str], bool]:
    """(positional-or-keyword names without self, keyword-only names, takes **kwargs)."""
    positional = [a.arg for a in fn.args.posonlyargs + fn.args.args if a.arg != "self"]
    return positional, [a.arg for a in fn.args.kwonlyargs], fn.args.kwarg is not None


def dict_keys(node: ast.Dict) -> set[str]:
    return {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}


def assigned_keys(scope: ast.AST, target: str) -> set[str]:
    """The string keys ``scope`` gives the dict ``target``: a dict literal assigned to it, ``target.update({...})``,
    ``target["key"] = ...``."""
    keys: set[str] = set()
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and any(
                isinstance(t, ast.Name) and t.id == target for t in node.targets):
            keys |= dict_keys(node.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == target and node.args \
                and isinstance(node.args[0], ast.Dict):
            keys |= dict_keys(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id == target \
                and isinstance(node.slice, ast.Constant):
            keys.add(node.slice.value)
    return keys


def raised_messages(scope: ast.AST, exception: str) -> list[str]:
    """The leading literal text of each ``raise <exception>(message)`` in ``scope`` (f-strings up to their first
    placeholder; a message built in a variable is skipped)."""
    out = []
    for node in ast.walk(scope):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name) \
                and node.exc.func.id == exception and node.exc.args:
            text = literal_prefix(node.exc.args[0])
            if text is not None:
                out.append(text)
    return out


def literal_prefix(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        text = ""
        for part in node.values:
            if not (isinstance(part, ast.Constant) and isinstance(part.value, str)):
                break
            text += part.value
        return text
    return None


def strings(scope: ast.AST) -> list[str]:
    """Every string literal in ``scope``, f-strings whole, with ``{}`` for each placeholder."""
    formatted = [n for n in ast.walk(scope) if isinstance(n, ast.JoinedStr)]
    parts = {id(p) for n in formatted for p in ast.walk(n)}
    return [n.value for n in ast.walk(scope) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in parts] + [
        "".join(p.value if isinstance(p, ast.Constant) else "{}" for p in n.values) for n in formatted]


def adapter_server_args() -> set[str]:
    """Every keyword SGLangOptions.server_args() can pass (each option set away from SGLang's default)."""
    options = SGLangOptions(model_path="m", served_model_name="s", mem_fraction_static=0.5, max_running_requests=2,
                            chunked_prefill_size=64, context_length=128, radix_eviction_policy="lfu",
                            enable_hierarchical_cache=True, hicache_size_gb=4, hicache_storage_root="/data/hicache",
                            hicache_storage_bytes=10**9, incremental_streaming_output=True, log_level="info")
    return set(options.server_args(storage_dir=Path("/data/hicache/m")))


def adapter_sampling_keys() -> set[str]:
    """Every SGLang sampling parameter the adapter can send."""
    params = SamplingParams(max_tokens=8, temperature=0.5, top_p=0.9, stop=("x",), seed=3, presence_penalty=0.1,
                            frequency_penalty=0.1, top_k=5, min_p=0.1, repetition_penalty=1.1)
    request = GenerationRequest(messages=(Message(role="user", content="x"),),
                                response_format=OutputFormat(kind="json_schema", schema='{"type":"object"}'))
    stopping = GenerationRequest(prompt="x", min_tokens=1, ignore_eos=True, stop_token_ids=(2,),
                                 skip_special_tokens=False)
    return set(_sampling_params(params)) | set(_constraint(request)) | set(_stopping(stopping))


# --- the contract ------------------------------------------------------------------------------------------------

def test_the_wheel_lies_in_the_pinned_range_and_the_gpu_extra_pins_that_range(wheel: Wheel) -> None:
    assert sglang_version_supported(wheel.version)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert SGLANG_REQUIREMENT in extras["gpu"]


def test_engine_its_keywords_and_what_the_adapter_calls_on_it(wheel: Wheel) -> None:
    engine = wheel.cls(ENGINE, "Engine")
    _, _, takes_kwargs = parameters(wheel.function(engine, "__init__"))
    assert takes_kwargs  # Engine(**server_args)
    generate = wheel.function(engine, "async_generate")
    assert isinstance(generate, ast.AsyncFunctionDef)
    positional, keyword_only, _ = parameters(generate)
    assert {"prompt", "sampling_params", "input_ids", "stream", "rid"} <= set(positional)
    assert "cache_salt" in keyword_only  # the version gate in SGLangEngine.start reads it from the signature
    assert parameters(wheel.function(engine, "shutdown")) == ([], [], False)
    assigned = {t.attr for n in ast.walk(engine) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Attribute)}
    assert "tokenizer_manager" in assigned
    # The double takes the same keywords the adapter passes, with cache_salt keyword-only there too.
    fake = typing.get_type_hints(sglang_double.FakeSGLangEngine.async_generate)
    assert {"prompt", "sampling_params", "input_ids", "stream", "rid", "cache_salt"} <= set(fake)


def test_every_server_argument_the_adapter_passes_is_a_field_and_the_double_takes_exactly_those(
        wheel: Wheel) -> None:
    fields: set[str] = set()
    for name in wheel.names(FIELDS):
        for node in ast.walk(wheel.tree(name)):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(s, ast.Assign | ast.AnnAssign) and "_NS_PATH" in ast.unparse(s) for s in node.body):
                fields |= {s.target.id for s in node.body
                           if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    ours = adapter_server_args()
    assert ours <= fields, ours - fields
    assert ours == set(sglang_double.SERVER_ARG_FIELDS)
    choices = next(n.value for n in ast.walk(wheel.tree(CHOICES)) if isinstance(n, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == "RADIX_EVICTION_POLICY_CHOICES" for t in n.targets))
    wheel_choices = tuple(ast.literal_eval(choices))
    assert wheel_choices == sglang_double.RADIX_EVICTION_POLICY_CHOICES
    assert set(typing.get_args(typing.get_type_hints(SGLangOptions)["radix_eviction_policy"])) <= set(wheel_choices)


def test_the_tokenizer_manager_methods_the_adapter_uses(wheel: Wheel) -> None:
    manager = wheel.cls(TOKENIZER_MANAGER, "TokenizerManager")
    assert "TokenizerControlMixin" in {ast.unparse(b) for b in manager.bases}
    mixin = wheel.cls(CONTROL_MIXIN, "TokenizerControlMixin")
    abort = wheel.function(manager, "abort_request")
    assert isinstance(abort, ast.FunctionDef) and parameters(abort)[0][0] == "rid"  # sync, abort_request(rid)
    for name in ("flush_cache", "get_internal_state"):
        assert isinstance(wheel.function(mixin, name), ast.AsyncFunctionDef), name
    assert "tokenizer" in {t.attr for n in ast.walk(manager) if isinstance(n, ast.Assign) for t in n.targets
                           if isinstance(t, ast.Attribute)}
    # The SIGTERM handler the adapter takes back is added here, on the running loop.
    handle_loop = wheel.function(manager, "auto_create_handle_loop")
    assert isinstance(handle_loop, ast.FunctionDef) and parameters(handle_loop) == ([], [], False)
    added = [ast.unparse(c.args[0]) for c in ast.walk(handle_loop) if isinstance(c, ast.Call)
             and isinstance(c.func, ast.Attribute) and c.func.attr == "add_signal_handler"]
    assert "signal.SIGTERM" in added
    # ... and the launch replaces the root logging handlers, which the adapter puts back.
    configure = wheel.function(wheel.tree(COMMON_UTILS), "configure_logger")
    assert any(isinstance(c, ast.Call) and ast.unparse(c.func) == "logging.basicConfig"
               and any(k.arg == "force" and ast.unparse(k.value) == "True" for k in c.keywords)
               for c in ast.walk(configure))


def test_every_sampling_key_the_adapter_sends_exists_and_refusals_name_their_field(wheel: Wheel) -> None:
    sampling = wheel.cls(SAMPLING_PARAMS, "SamplingParams")  # a msgspec Struct: SamplingParams(**sampling_params)
    accepted = {s.target.id for s in sampling.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                and not s.target.id.startswith("_")}
    ours = adapter_sampling_keys()
    assert ours <= accepted, ours - accepted
    assert set(_REQUEST_FIELD) <= accepted
    messages = raised_messages(wheel.function(sampling, "verify"), "ValueError")
    named = {m.group(1) for m in map(_REFUSED_FIELD.match, messages) if m}
    # Each parameter the adapter sends that verify() checks is refused with "<name> must ...".
    assert {"temperature", "top_p", "min_p", "top_k", "frequency_penalty", "presence_penalty",
            "repetition_penalty", "max_new_tokens"} <= named
    assert named <= accepted


def test_meta_info_keys_are_the_doubles_and_hold_what_the_adapter_reads(wheel: Wheel) -> None:
    manager = wheel.cls(TOKENIZER_MANAGER, "TokenizerManager")
    keys = assigned_keys(wheel.function(manager, "_handle_batch_output"), "meta_info")
    unconditional = {"id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
                     "reasoning_tokens", "completion_tokens", "cached_tokens"}
    assert unconditional <= keys
    assert sglang_double.META_INFO_KEYS == unconditional
    assert {"prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason"} <= sglang_double.META_INFO_KEYS


def test_finish_reason_shapes_are_the_doubles_and_the_adapter_knows_every_type(wheel: Wheel) -> None:
    shapes: dict[str, set[str]] = {}
    for node in ast.walk(wheel.tree(SCHEDULE_BATCH)):
        if isinstance(node, ast.ClassDef) and node.name.startswith("FINISH"):
            returned = [r.value for r in ast.walk(wheel.function(node, "to_json")) if isinstance(r, ast.Return)]
            (literal,) = returned
            assert isinstance(literal, ast.Dict)
            kind = next(v.value for k, v in zip(literal.keys, literal.values, strict=True)
                        if isinstance(k, ast.Constant) and k.value == "type")
            shapes.setdefault(kind, set()).update(dict_keys(literal))
    assert {k: frozenset(v) for k, v in shapes.items()} == sglang_double.FINISH_REASON_KEYS
    # A request SGLang refuses is aborted with status 400 unless told otherwise (the adapter makes that a 400).
    abort = wheel.function(wheel.cls(SCHEDULE_BATCH, "Req"), "set_finish_with_abort")
    defaults = dict(zip([a.arg for a in abort.args.args][-len(abort.args.defaults):], abort.args.defaults,
                        strict=True))
    assert ast.unparse(defaults["status_code"]) == "HTTPStatus.BAD_REQUEST"


def test_internal_state_and_memory_usage_keys_are_the_doubles_and_stats_read_keys_that_exist(wheel: Wheel) -> None:
    state = wheel.cls(INTERNAL_STATE, next(n.name for n in wheel.tree(INTERNAL_STATE).body
                                           if isinstance(n, ast.ClassDef)
                                           and any(getattr(f, "name", "") == "get_internal_state" for f in n.body)))
    always = assigned_keys(wheel.function(state, "_add_topology"), "state") | assigned_keys(
        wheel.function(state, "_add_memory_usage"), "state")
    assert always == sglang_double.INTERNAL_STATE_FIGURES
    anywhere = assigned_keys(state, "state")
    assert set(STATE_FIGURES) <= anywhere, set(STATE_FIGURES) - anywhere
    build = wheel.function(wheel.tree(MEMORY_USAGE), "build_memory_usage")
    (returned,) = [r.value for r in ast.walk(build) if isinstance(r, ast.Return)]
    assert isinstance(returned, ast.Dict) and dict_keys(returned) == sglang_double.MEMORY_USAGE_KEYS


def test_a_refused_flush_says_nothing_and_the_doubles_output_has_the_same_fields(wheel: Wheel) -> None:
    output = wheel.cls(IO_STRUCT, "FlushCacheReqOutput")
    fields = {s.target.id: s.value for s in output.body if isinstance(s, ast.AnnAssign)
              and isinstance(s.target, ast.Name)}
    assert set(fields) == sglang_double.FLUSH_OUTPUT_FIELDS
    assert fields["message"] is not None and ast.literal_eval(fields["message"]) == ""


def test_the_refusals_the_adapter_turns_into_400s_are_worded_as_it_reads_them(wheel: Wheel) -> None:
    manager = wheel.cls(TOKENIZER_MANAGER, "TokenizerManager")
    validate = wheel.function(manager, "_validate_one_request")
    texts = strings(validate)
    assert any(t.startswith("The input (") for t in texts)
    assert any(t.startswith("Requested token count exceeds the model's maximum context length") for t in texts)
    assert all("context length" in t for t in texts if t.startswith(("The input (", "Requested token count")))
    grammar = strings(wheel.tree(GRAMMAR_MANAGER))
    assert any(t.startswith("Failed to compile ") for t in grammar)


def test_the_tokenizers_sglang_loads_are_the_ones_the_adapter_handles(wheel: Wheel) -> None:
    loader = wheel.function(wheel.tree(TOKENIZER_LOADER), "get_tokenizer")
    names = {n.id for n in ast.walk(loader) if isinstance(n, ast.Name)} | {
        a.name for n in ast.walk(loader) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert {"TiktokenTokenizer", "MistralCommonTokenizer"} <= names
    tiktoken = wheel.cls(TIKTOKEN, "TiktokenTokenizer")
    assert parameters(wheel.function(tiktoken, "encode")) == (["x", "add_special_tokens"], [], False)
    assert "tokenizer" in {t.attr for n in ast.walk(tiktoken) if isinstance(n, ast.Assign) for t in n.targets
                           if isinstance(t, ast.Attribute)}
    # Its wrapped tiktoken.Encoding is what gives encode_ordinary (plain text, no special tokens).
    assert any(ast.unparse(n) == "tiktoken.Encoding(**kwargs)" for n in ast.walk(tiktoken) if isinstance(n, ast.Call))


def test_the_refused_field_pattern_reads_sglangs_wording() -> None:
    assert re.match(_REFUSED_FIELD, "top_p must be in (0, 1], got 0.0.").group(1) == "top_p"  # type: ignore[union-attr]


# --- the hierarchical cache (HiCache) ----------------------------------------------------------------------------

def test_the_host_and_storage_tier_fields_the_adapter_passes_mean_what_it_assumes(wheel: Wheel) -> None:
    memory = wheel.cls(MEMORY_FIELDS, "Memory")
    fields = {s.target.id: s for s in memory.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    # hicache_size: an int of GB that overrides the ratio; 0 (the default) means "size by hicache_ratio".
    size = fields["hicache_size"]
    assert ast.unparse(size.annotation).startswith("A[int,") and ast.literal_eval(size.value) == 0
    assert "Overrides --hicache-ratio" in ast.unparse(size.annotation)
    # ... in GB of 10**9 bytes, and a pool over the free RAM less a 10 GiB reserve is refused at start.
    host = strings(wheel.tree(HOST_POOL))
    assert "int(host_size * 1000000000.0 // self.size_per_token)" in {ast.unparse(n) for n in ast.walk(wheel.tree(HOST_POOL))
                                                             if isinstance(n, ast.Call)}
    assert HICACHE_GB == 10**9
    reserve = next(n.value for n in ast.walk(wheel.tree(HOST_POOL)) if isinstance(n, ast.AnnAssign)
                   and ast.unparse(n.target) == "HICACHE_HOST_MEMORY_RESERVE_BYTES")
    assert ast.unparse(reserve) == "10 * 1024 ** 3" and SGLANG_HOST_RESERVE_BYTES == 10 * 1024**3
    assert any(t.startswith("Not enough host memory available") for t in host)
    # The storage backend takes "file"; the layouts the adapter may pass are SGLang's.
    backend = ast.unparse(fields["hicache_storage_backend"].annotation)
    assert "'file'" in backend
    layouts = ast.unparse(fields["hicache_mem_layout"].annotation)
    assert all(f"'{layout}'" in layouts for layout in sglang_double.HICACHE_MEM_LAYOUTS)
    assert ast.literal_eval(fields["hicache_mem_layout"].value) == SGLangOptions(model_path="m").hicache_mem_layout
    assert set(typing.get_args(typing.get_type_hints(SGLangOptions)["hicache_mem_layout"])) <= set(
        sglang_double.HICACHE_MEM_LAYOUTS)
    assert ast.unparse(fields["hicache_storage_backend_extra_config"].annotation).startswith("A[Optional[str],")


def test_the_file_tier_takes_its_directory_from_the_extra_config_unless_sglangs_variable_is_set(wheel: Wheel) -> None:
    init = wheel.function(wheel.cls(HICACHE_STORAGE, "HiCacheFile"), "__init__")
    (assignment,) = [n for n in ast.walk(init) if isinstance(n, ast.Assign)
                     and any(ast.unparse(t) == "self.file_path" for t in n.targets)]
    chosen = assignment.value
    assert isinstance(chosen, ast.BoolOp) and isinstance(chosen.op, ast.Or)
    first, second, _ = (ast.unparse(v) for v in chosen.values)
    assert first == f"envs.{STORAGE_DIR_VARIABLE}.get()"  # the variable wins: the adapter refuses it when set
    assert second == "(storage_config.extra_config or {}).get('file_storage_path')"
    # The file names: the page's key, the model's name and the TP rank; no weights, KV dtype or layout.
    suffix = next(n for n in ast.walk(init) if isinstance(n, ast.Assign)
                  and any(ast.unparse(t) == "self.tp_config_suffix" for t in n.targets))
    assert {ast.unparse(v.value) for v in ast.walk(suffix.value) if isinstance(v, ast.FormattedValue)} == \
        {"model_name", "tp_rank", "tp_size", "shard_suffix"}
    # The byte cap is the extra config's max_size.
    load = wheel.function(wheel.cls(FILE_EVICTOR, "LRUFileEvictor"), "_load_config")
    assert "max_size" in strings(load)


def test_the_radix_tree_is_keyed_by_extra_key_and_cache_salt(wheel: Wheel) -> None:
    key = wheel.cls(RADIX_CACHE, "RadixKey")
    slots = next(n.value for n in key.body if isinstance(n, ast.Assign)
                 and any(ast.unparse(t) == "__slots__" for t in n.targets))
    assert {"extra_key", "cache_salt"} <= set(ast.literal_eval(slots))
    child = wheel.function(key, "child_key_at")
    returned = {ast.unparse(r.value) for r in ast.walk(child) if isinstance(r, ast.Return)}
    assert "((self.extra_key, self.cache_salt), plain)" in returned
    # Requests' keys carry the request's salt.
    made = [c for c in ast.walk(wheel.tree(RADIX_CACHE)) if isinstance(c, ast.Call)
            and ast.unparse(c.func) == "RadixKey"]
    assert made and all(any(k.arg == "cache_salt" and ast.unparse(k.value) == "req.cache_salt" for k in c.keywords)
                        for c in made if any(ast.unparse(a) == "req.extra_key" for a in c.args))


def test_the_storage_hash_chains_are_seeded_with_extra_key_and_cache_salt(wheel: Wheel) -> None:
    source = wheel.zip.read(MEM_CACHE_UTILS).decode("utf-8")
    assert storage_salt_problem(source) is None
    utils = wheel.tree(MEM_CACHE_UTILS)
    seed = wheel.function(utils, "storage_namespace_seed")
    assert parameters(seed) == (["extra_key", "cache_salt"], [], False)
    hashed = [ast.unparse(c.args[0]) for c in ast.walk(seed) if isinstance(c, ast.Call)
              and ast.unparse(c.func) == "digest.update"]
    assert any("encoded" in h for h in hashed)  # each present part, its length and bytes
    loop = next(n for n in ast.walk(seed) if isinstance(n, ast.For))
    assert ast.unparse(loop.iter) == "(extra_key, cache_salt)"
    # Every storage hash goes through get_storage_hash_str: the radix tree's node hashes and the L3 lookups.
    node_hashes = wheel.function(utils, "compute_node_hash_values")
    assert any(ast.unparse(c.func) == "get_storage_hash_str" for c in ast.walk(node_hashes) if isinstance(c, ast.Call))
    lookup = wheel.function(wheel.cls(CACHE_CONTROLLER, "HiCacheController"), "_storage_hit_query")
    assert {ast.unparse(c.func) for c in ast.walk(lookup) if isinstance(c, ast.Call)} >= {"get_storage_hash_str"}
    # The double's salted source is the wheel's, function for function; its unsalted one is refused.
    double = ast.parse(sglang_double.SALTED_STORAGE_SOURCE)
    for name in ("storage_namespace_seed", "get_storage_hash_str"):
        assert ast.dump(wheel.function(double, name)) == ast.dump(wheel.function(utils, name)), name
    assert storage_salt_problem(sglang_double.SALTED_STORAGE_SOURCE) is None
    assert storage_salt_problem(sglang_double.UNSALTED_STORAGE_SOURCE) is not None


def test_the_page_hash_is_a_cpp_extension_built_on_first_use_with_openssl(wheel: Wheel) -> None:
    loader = wheel.function(wheel.tree(NATIVE_HASH), "_load_native_hash_module")
    call = next(c for c in ast.walk(loader) if isinstance(c, ast.Call)
                and ast.unparse(c.func) == "load_extension_with_recovery")
    keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
    assert keywords["extra_ldflags"] == "['-lcrypto']"
    assert "hash_binding.cpp" in keywords["sources"]
    includes = re.findall(r"#include <([^>]+)>", wheel.zip.read(HASH_BINDING).decode("utf-8"))
    assert "openssl/sha.h" in includes  # what `edgecache doctor` compiles against


def test_the_kv_pool_is_what_free_memory_leaves_past_the_static_fraction(wheel: Wheel) -> None:
    """edgecache/hardware.py (and docs/gpu-profiles.md, "The memory model") size a GPU profile on SGLang's rule: the
    KV pool is the free memory after the weights less ``pre_model_load_memory * (1 - mem_fraction_static)``."""
    sizing = wheel.function(wheel.cls(KV_CONFIGURATOR, "KVCacheConfigurator"), "_profile_available_bytes")
    slack = [node for node in ast.walk(sizing) if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)
             and isinstance(node.left, ast.Name) and node.left.id == "pre_model_load_memory"
             and isinstance(node.right, ast.BinOp) and isinstance(node.right.op, ast.Sub)
             and isinstance(node.right.left, ast.Constant) and node.right.left.value == 1
             and isinstance(node.right.right, ast.Attribute) and node.right.right.attr == "mem_fraction_static"]
    assert slack, ast.unparse(sizing)
    assert "get_available_gpu_memory" in ast.unparse(sizing)
