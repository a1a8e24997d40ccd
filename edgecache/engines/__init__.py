"""Engines by name. Each is imported only when chosen, so a CPU box never imports sglang and the other way round."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from edgecache.engines.base import (
    Chunk,
    Engine,
    GenerationRequest,
    Message,
    SamplingParams,
)
from edgecache.errors import EngineError

if TYPE_CHECKING:
    from edgecache.settings import Settings

# name -> "module:attribute" of a function that takes Settings and returns an Engine.
ENGINE_FACTORIES: dict[str, str] = {
    "llamacpp": "edgecache.engines.factories:llamacpp_from_settings",
    "sglang": "edgecache.engines.factories:sglang_from_settings",
    "openai": "edgecache.engines.factories:openai_from_settings",
}


def engine_from_settings(settings: Settings) -> Engine:
    kind = settings.engine.kind
    # "package.module:function": a factory of one's own (settings.py's engine.kind pattern admits it)
    target = ENGINE_FACTORIES.get(kind) or (kind if ":" in kind else None)
    if target is None:
        raise EngineError(f"engine {settings.engine.kind!r} is not available; known: {', '.join(ENGINE_FACTORIES)}")
    module_name, _, attribute = target.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise EngineError(f"cannot import the engine factory {target!r}: {exc}") from exc
    return factory(settings)


__all__ = ["Chunk", "Engine", "GenerationRequest", "Message", "SamplingParams", "engine_from_settings"]
