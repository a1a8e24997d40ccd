"""Settings -> engine, one small function per engine kind (named in :data:`edgecache.engines.ENGINE_FACTORIES`).

Each function imports its engine module itself, so choosing one engine never imports another's runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgecache.settings import SettingsError

if TYPE_CHECKING:
    from edgecache.engines.base import Engine
    from edgecache.settings import Settings


HICACHE_STORAGE_DIR = "sglang-hicache"
"""The data dir's folder for the sglang engine's file storage tier."""


def llamacpp_from_settings(settings: Settings) -> Engine:
    from edgecache.engines.llamacpp import LlamaCppEngine

    e = settings.engine
    return LlamaCppEngine(model=e.model, model_id=e.model_id, context_tokens=e.context_tokens, threads=e.threads,
                          batch_tokens=e.batch_tokens, prefix_cache_bytes=e.prefix_cache_bytes,
                          prefix_cache_disk_bytes=e.prefix_cache_disk_bytes, data_dir=settings.data_path,
                          prefix_cache_min_tokens=e.prefix_cache_min_tokens,
                          extra_buffer_types=e.extra_buffer_types)


def sglang_from_settings(settings: Settings) -> Engine:
    """SGLang in this process. Builds the adapter only: sglang itself is imported by ``start()``, which says
    ``pip install "edgecache[gpu]"`` when it is missing.

    The host KV tier is sized here, from this box's RAM (``engine.hicache_host_share``); the file storage tier goes
    under the data dir, in :data:`HICACHE_STORAGE_DIR`, where ``start()`` gives each model, KV dtype and layout its
    own directory."""
    from edgecache.engines.sglang import SGLangEngine, SGLangOptions
    from edgecache.hardware import HICACHE_GB, hicache_host_bytes

    e = settings.engine
    host_bytes = hicache_host_bytes(settings)
    storage = e.hierarchical_cache and e.hicache_storage == "file"
    if not e.hierarchical_cache and (e.hicache_storage != "none" or e.hicache_host_share is not None):
        raise SettingsError("engine: hicache_host_share and hicache_storage size tiers of the hierarchical cache, "
                            "which is off: set engine.hierarchical_cache = true, or leave them unset")
    try:
        options = SGLangOptions(model_path=e.model, served_model_name=e.model_id,
                                mem_fraction_static=e.mem_fraction_static, max_running_requests=e.max_running_requests,
                                chunked_prefill_size=e.chunked_prefill_size, context_length=e.context_tokens,
                                radix_eviction_policy=e.radix_eviction_policy,
                                enable_hierarchical_cache=e.hierarchical_cache,
                                hicache_size_gb=host_bytes // HICACHE_GB if host_bytes else None,
                                hicache_storage_root=str(settings.data_path / HICACHE_STORAGE_DIR) if storage else None,
                                hicache_storage_bytes=e.hicache_storage_bytes)
    except ValueError as exc:
        raise SettingsError(f"engine: {exc}") from exc
    return SGLangEngine(options)


def openai_from_settings(settings: Settings) -> Engine:
    """An upstream OpenAI-compatible server (``serve --upstream URL``). ``engine.model_id`` names the upstream
    model; unset, the first one the upstream's ``/models`` lists is used."""
    from edgecache.engines.openai_upstream import OpenAIUpstreamEngine

    e = settings.engine
    if not e.upstream_url:
        raise SettingsError("engine.kind is openai but engine.upstream_url is unset: pass --upstream http://HOST:PORT/v1")
    return OpenAIUpstreamEngine(e.upstream_url, api_key=e.upstream_key, model=e.model_id, version=e.version)
