"""How a hardware profile splits the GPU: weights, KV pool, the embedder's share, and headroom; and how much of the
box's RAM the GPU engine's host KV tier takes.

This is arithmetic on the numbers a profile states, done before anything is rented or loaded, so that
``edgecache profiles show t4`` can tell a user what the split buys (KV tokens) and refuse a split that cannot work.

The model follows what SGLang does at start (``KVCacheConfigurator._profile_available_bytes`` in
``sglang/srt/mem_cache/kv_cache_configurator.py`` of the pinned release, which ``tests/test_sglang_contract.py``
checks): it measures the free memory after loading the weights and keeps
``free_after_load - free_before_load * (1 - mem_fraction_static)`` for the KV pool, ``free_before_load`` being the
card's total when nothing else holds memory on it. So the *static pool*
``mem_fraction_static * total`` holds the weights, the CUDA context of SGLang's scheduler process and the KV pool; the
rest, ``(1 - mem_fraction_static) * total``, is left for activations, CUDA graphs and every other process on the GPU,
here the ONNX embedder.

Units: every size is GiB (2**30 bytes), the unit nvidia-smi (MiB / 1024), torch and SGLang count in. The settings
call them "GB" (``hardware.gpu_memory_gb``, ``engine.weights_gb``); read those as GiB.

Errors versus warnings. An *error* is a split that cannot work: the weights leave no KV pool, the KV pool is too
small for the radix cache to keep anything (under 10 % of the static pool), it cannot hold one full-context request,
or the headroom left for activations is under 1 GiB. SGLang would refuse to start or fail under the first long
prompt, so ``profiles show`` exits 2 and :func:`validate_memory` raises. A *warning* is a split that works but leaves
the field guidance (weights 60-70 %, KV 30-40 % of the static pool), an embedder without a memory cap, or an
admission limit above what the engine runs at once: a deliberate choice may do that (a small model on a large card
wants more KV), so it is shown, not refused.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from edgecache.settings import SettingsError

if TYPE_CHECKING:
    from edgecache.settings import Settings

GIB = 2**30

# The CUDA context (driver state, kernels, cuBLAS workspace) of one process: SGLang's scheduler has one inside the
# static pool (it is part of what SGLang sees as used after loading), the embedder's process has another. Measured
# contexts are 0.3-0.6 GiB depending on the card and driver; 0.5 errs on the safe side.
CUDA_CONTEXT_GB = 0.5
# Activations of one prefill chunk plus CUDA graph buffers need well under this for the models shipped; below it
# the first long prompt can run out of memory.
MIN_HEADROOM_GB = 1.0
# Under this share the radix cache cannot keep a useful prefix: the case of an fp16 7B on a 16 GB card.
MIN_KV_SHARE = 0.10
# Field guidance for the static pool (docs/notes/profiles.md).
WEIGHTS_SHARE_GUIDANCE = (0.60, 0.70)
KV_SHARE_GUIDANCE = (0.30, 0.40)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of KV cache one token takes: a key and a value vector per KV head per layer."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


class MemorySplit(msgspec.Struct, frozen=True, kw_only=True):
    """The GPU memory split a profile implies, in GiB, with what it buys and what is wrong with it."""

    gpu_total_gb: float
    static_fraction: float
    static_gb: float
    """``static_fraction * gpu_total_gb``: weights + engine context + KV pool."""
    weights_gb: float
    engine_context_gb: float
    kv_pool_gb: float
    weights_share: float
    """Of the static pool."""
    kv_share: float
    """Of the static pool."""
    kv_bytes_per_token: int
    kv_tokens: int
    """Tokens the KV pool holds, shared by running requests and the radix prefix cache."""
    context_tokens: int
    full_contexts: float
    """How many requests of the full context length the KV pool holds at once."""
    max_running_requests: int | None
    kv_tokens_per_running_request: int | None
    embedder_gb: float
    """The ONNX embedder's cap (semantic.gpu_mem_limit) plus its process's CUDA context; 0 when it is not on cuda."""
    headroom_gb: float
    """What is left for activations and CUDA graphs: total - static pool - embedder."""
    errors: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.errors


class MemorySplitError(SettingsError):
    """The profile's memory split cannot work; the message lists why."""


def split_inputs_missing(settings: Settings) -> tuple[str, ...]:
    """The settings a GPU split needs and the profile leaves unset (empty when the split can be computed)."""
    engine = settings.engine
    needed = {
        "hardware.gpu_memory_gb": settings.hardware.gpu_memory_gb or None,
        "engine.mem_fraction_static": engine.mem_fraction_static,
        "engine.weights_gb": engine.weights_gb,
        "engine.layers": engine.layers,
        "engine.kv_heads": engine.kv_heads,
        "engine.head_dim": engine.head_dim,
    }
    return tuple(name for name, value in needed.items() if value is None)


def memory_split(settings: Settings) -> MemorySplit | None:
    """The split for an engine that runs on this GPU (sglang); ``None`` for the others (llamacpp runs on the CPU,
    openai elsewhere) and when the profile lacks a number (see :func:`split_inputs_missing`)."""
    if settings.engine.kind != "sglang" or split_inputs_missing(settings):
        return None
    engine, semantic = settings.engine, settings.semantic
    # split_inputs_missing() has checked these are set; the asserts tell the type checker.
    assert engine.mem_fraction_static is not None and engine.weights_gb is not None
    assert engine.layers is not None and engine.kv_heads is not None and engine.head_dim is not None

    total = settings.hardware.gpu_memory_gb
    static = engine.mem_fraction_static * total
    kv_pool = static - engine.weights_gb - CUDA_CONTEXT_GB
    per_token = kv_bytes_per_token(engine.layers, engine.kv_heads, engine.head_dim, engine.kv_dtype_bytes)
    kv_tokens = max(0, int(kv_pool * GIB) // per_token)
    embedder_on_gpu = semantic.enabled and semantic.device == "cuda"
    embedder = (semantic.gpu_mem_limit or 0) / GIB + CUDA_CONTEXT_GB if embedder_on_gpu else 0.0
    headroom = total - static - embedder
    running = engine.max_running_requests

    errors: list[str] = []
    warnings: list[str] = []
    weights_share, kv_share = engine.weights_gb / static, kv_pool / static
    if kv_pool <= 0:
        errors.append(
            f"the weights ({engine.weights_gb:.2f} GiB) and the engine's CUDA context ({CUDA_CONTEXT_GB} GiB) do not "
            f"fit in the static pool (engine.mem_fraction_static {engine.mem_fraction_static} x {total} GiB = "
            f"{static:.2f} GiB), leaving no KV pool: choose a smaller or quantised model, or raise "
            "mem_fraction_static if the headroom allows")
    elif kv_share < MIN_KV_SHARE:
        errors.append(
            f"the KV pool is {kv_pool:.2f} GiB, {kv_share:.0%} of the static pool (under {MIN_KV_SHARE:.0%}): "
            "the prefix cache could keep almost nothing; choose a smaller or quantised model")
    if 0 < kv_tokens < engine.context_tokens:
        errors.append(
            f"the KV pool holds {kv_tokens} tokens, fewer than one full context (engine.context_tokens "
            f"{engine.context_tokens}): lower context_tokens or give the KV pool more memory")
    if headroom < MIN_HEADROOM_GB:
        errors.append(
            f"{headroom:.2f} GiB is left for activations and CUDA graphs after the static pool ({static:.2f} GiB) "
            f"and the embedder ({embedder:.2f} GiB); at least {MIN_HEADROOM_GB} GiB is needed: lower "
            "engine.mem_fraction_static or semantic.gpu_mem_limit")
    if kv_pool > 0:
        low, high = WEIGHTS_SHARE_GUIDANCE
        if not low <= weights_share <= high:
            warnings.append(f"weights are {weights_share:.0%} of the static pool; the field guidance is "
                            f"{low:.0%}-{high:.0%}")
        low, high = KV_SHARE_GUIDANCE
        if not low <= kv_share <= high:
            warnings.append(f"the KV pool is {kv_share:.0%} of the static pool; the field guidance is "
                            f"{low:.0%}-{high:.0%}")
    if embedder_on_gpu and semantic.gpu_mem_limit is None:
        warnings.append("semantic.device is cuda without semantic.gpu_mem_limit: onnxruntime's arena may grow into "
                        "the engine's headroom")
    if running is not None and settings.admission.max_concurrent_misses > running:
        warnings.append(f"admission.max_concurrent_misses ({settings.admission.max_concurrent_misses}) is above "
                        f"engine.max_running_requests ({running}): the extra misses wait inside SGLang, where "
                        "admission control cannot see them")

    return MemorySplit(
        gpu_total_gb=total,
        static_fraction=engine.mem_fraction_static,
        static_gb=static,
        weights_gb=engine.weights_gb,
        engine_context_gb=CUDA_CONTEXT_GB,
        kv_pool_gb=kv_pool,
        weights_share=weights_share,
        kv_share=kv_share,
        kv_bytes_per_token=per_token,
        kv_tokens=kv_tokens,
        context_tokens=engine.context_tokens,
        full_contexts=kv_tokens / engine.context_tokens,
        max_running_requests=running,
        kv_tokens_per_running_request=kv_tokens // running if running else None,
        embedder_gb=embedder,
        headroom_gb=headroom,
        errors=tuple(errors),
        warnings=tuple(warnings),
    )


def validate_memory(settings: Settings) -> MemorySplit | None:
    """:func:`memory_split`, raising :class:`MemorySplitError` when the split cannot work (call it at start)."""
    split = memory_split(settings)
    if split is not None and split.errors:
        raise MemorySplitError(f"profile {settings.profile}: the GPU memory split cannot work: "
                               + "; ".join(split.errors))
    return split


def split_rows(split: MemorySplit) -> list[tuple[str, str, str]]:
    """(figure, value, how it is computed) rows for a table, in the order a reader checks them."""
    running = split.max_running_requests
    return [
        ("GPU memory", f"{split.gpu_total_gb:.2f} GiB", "hardware.gpu_memory_gb"),
        ("static pool", f"{split.static_gb:.2f} GiB", f"engine.mem_fraction_static {split.static_fraction} x GPU"),
        ("  weights", f"{split.weights_gb:.2f} GiB ({split.weights_share:.0%})", "engine.weights_gb"),
        ("  engine CUDA context", f"{split.engine_context_gb:.2f} GiB", "estimate"),
        ("  KV pool", f"{split.kv_pool_gb:.2f} GiB ({split.kv_share:.0%})", "static - weights - context"),
        ("KV bytes per token", f"{split.kv_bytes_per_token:,}", "2 x layers x kv_heads x head_dim x kv_dtype_bytes"),
        ("KV tokens", f"{split.kv_tokens:,}", "KV pool / bytes per token"),
        ("full contexts held", f"{split.full_contexts:.1f}", f"KV tokens / engine.context_tokens {split.context_tokens}"),
        ("KV tokens per running request",
         f"{split.kv_tokens_per_running_request:,}" if split.kv_tokens_per_running_request is not None else "-",
         f"KV tokens / engine.max_running_requests {running}" if running else "max_running_requests unset"),
        ("embedder", f"{split.embedder_gb:.2f} GiB", "semantic.gpu_mem_limit + its CUDA context"),
        ("headroom", f"{split.headroom_gb:.2f} GiB", "GPU - static pool - embedder: activations, CUDA graphs"),
    ]


# SGLang's hicache_size is in GB of 10**9 bytes (``int(host_size * 1e9 // size_per_token)`` in
# ``mem_cache/pool_host/base.py``), and a host pool larger than the free RAM less a 10 GiB reserve is refused at start.
HICACHE_GB = 10**9
SGLANG_HOST_RESERVE_BYTES = 10 * GIB

_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def host_ram_bytes(meminfo: Path = Path("/proc/meminfo"), cgroup_limits: tuple[Path, ...] = _CGROUP_LIMITS) -> int:
    """The box's RAM as this process may use it: ``MemTotal``, or the cgroup's memory limit (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``) when that is lower. Raises :class:`SettingsError` when ``MemTotal`` cannot be read."""
    total = None
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        total = None
    if total is None:
        raise SettingsError(f"cannot read the box's RAM (MemTotal in {meminfo}) to size the host KV tier: leave "
                            "engine.hicache_host_share unset to let SGLang size it")
    for path in cgroup_limits:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) means no limit; v1 writes a huge number instead, which min() ignores
            total = min(total, int(text))
    return total


def hicache_host_gb(share: float, ram_bytes: int) -> int:
    """The host KV tier for SGLang's ``hicache_size``: ``share`` of the box's RAM, in whole GB (10**9 bytes), rounded
    down. Raises :class:`SettingsError` under 1 GB, since SGLang reads ``hicache_size = 0`` as "size by ratio"."""
    size = math.floor(share * ram_bytes / HICACHE_GB)
    if size < 1:
        raise SettingsError(f"engine.hicache_host_share {share} of this box's {ram_bytes / GIB:.1f} GiB of RAM is "
                            "under 1 GB, too small for a host KV tier: raise the share, or turn "
                            "engine.hierarchical_cache off")
    return size


def hicache_host_bytes(settings: Settings, ram_bytes: int | None = None) -> int:
    """Bytes of RAM the profile's host KV tier takes on this box (0 when the sglang engine has none, or leaves its
    size to SGLang)."""
    engine = settings.engine
    if engine.kind != "sglang" or not engine.hierarchical_cache or engine.hicache_host_share is None:
        return 0
    ram = host_ram_bytes() if ram_bytes is None else ram_bytes
    return hicache_host_gb(engine.hicache_host_share, ram) * HICACHE_GB
