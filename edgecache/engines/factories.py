"""Settings -> engine, one small function per engine kind (named in :data:`edgecache.engines.ENGINE_FACTORIES`).

Each function imports its engine module itself, so choosing one engine never imports another's runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgecache.engines.base import Engine
    from edgecache.settings import Settings


def llamacpp_from_settings(settings: Settings) -> Engine:
    from edgecache.engines.llamacpp import LlamaCppEngine

    e = settings.engine
    return LlamaCppEngine(model=e.model, model_id=e.model_id, context_tokens=e.context_tokens, threads=e.threads,
                          batch_tokens=e.batch_tokens, prefix_cache_bytes=e.prefix_cache_bytes,
                          prefix_cache_min_tokens=e.prefix_cache_min_tokens)
