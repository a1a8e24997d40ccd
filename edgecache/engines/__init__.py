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
    target = ENGINE_FACTORIES.get(settings.engine.kind)
    if target is None:
        raise EngineError(f"engine {settings.engine.kind!r} is not available; known: {', '.join(ENGINE_FACTORIES)}")
    module_name, _, attribute = target.partition(":")
    factory = getattr(importlib.import_module(module_name), attribute)
    return factory(settings)


__all__ = ["Chunk", "Engine", "GenerationRequest", "Message", "SamplingParams", "engine_from_settings"]
