"""ENGINE_FACTORIES: each engine kind builds its class from Settings, and choosing sglang never imports sglang."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from importlib.abc import MetaPathFinder
from pathlib import Path
from typing import Any

import pytest

from edgecache.engines import ENGINE_FACTORIES, engine_from_settings
from edgecache.engines.llamacpp import LlamaCppEngine
from edgecache.engines.openai_upstream import OpenAIUpstreamEngine
from edgecache.engines.sglang import SGLangEngine
from edgecache.errors import EngineError
from edgecache.hardware import hicache_host_gb, host_ram_bytes
from edgecache.settings import ENGINE_KINDS, Settings, SettingsError, resolve_settings


def settings(tmp_path: Path, profile: str = "cpu", **overrides: Any) -> Settings:
    dotted = {k.replace("__", "."): v for k, v in overrides.items()}
    return resolve_settings(profile, {"data_dir": str(tmp_path), **dotted}, environ={})


class _RefuseSglang(MetaPathFinder):
    """Fails any import of sglang, as on a machine without it, and records the attempt."""

    def __init__(self) -> None:
        self.attempts: list[str] = []

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname == "sglang" or fullname.startswith("sglang."):
            self.attempts.append(fullname)
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)


@pytest.fixture
def no_sglang(monkeypatch: pytest.MonkeyPatch) -> Iterator[_RefuseSglang]:
    finder = _RefuseSglang()
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    sys.meta_path.insert(0, finder)
    try:
        yield finder
    finally:
        sys.meta_path.remove(finder)


def test_every_engine_kind_has_a_factory() -> None:
    kinds = set(ENGINE_KINDS)
    assert kinds == {"llamacpp", "sglang", "openai"}
    assert set(ENGINE_FACTORIES) == kinds
    for target in ENGINE_FACTORIES.values():
        module_name, _, attribute = target.partition(":")
        assert callable(getattr(importlib.import_module(module_name), attribute))


@pytest.mark.parametrize("kind", ["llamacpp", "openai", "tests.fakes:FakeEngine", "pkg.mod:make_engine"])
def test_engine_kind_takes_a_known_name_or_an_import_path(kind: str, tmp_path: Path) -> None:
    assert settings(tmp_path, engine__kind=kind).engine.kind == kind


@pytest.mark.parametrize("kind", ["llama", "vllm", "pkg.mod", ":factory", "pkg mod:f", "pkg.mod:f()"])
def test_engine_kind_refuses_anything_else(kind: str, tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="engine.kind"):
        settings(tmp_path, engine__kind=kind)


def test_an_engine_factory_that_does_not_import_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="cannot import the engine factory 'no_such_pkg.engines:make'"):
        engine_from_settings(settings(tmp_path, engine__kind="no_such_pkg.engines:make"))


def test_llamacpp_kind_builds_the_cpu_engine(tmp_path: Path) -> None:
    engine = engine_from_settings(settings(tmp_path))
    assert isinstance(engine, LlamaCppEngine)


@pytest.mark.parametrize("profile", ["t4", "a100", "h100"])
def test_gpu_profiles_build_sglang_without_importing_it(profile: str, tmp_path: Path,
                                                       no_sglang: _RefuseSglang) -> None:
    s = settings(tmp_path, profile)
    engine = engine_from_settings(s)
    assert isinstance(engine, SGLangEngine)
    assert no_sglang.attempts == []
    args = engine.options.server_args()
    e = s.engine
    assert args["model_path"] == e.model
    assert args["mem_fraction_static"] == e.mem_fraction_static
    assert args["max_running_requests"] == e.max_running_requests
    assert args["chunked_prefill_size"] == e.chunked_prefill_size
    assert args["context_length"] == e.context_tokens
    assert engine.model_id == e.model.rsplit("/", 1)[-1]


def test_sglang_options_follow_the_settings(tmp_path: Path, no_sglang: _RefuseSglang) -> None:
    engine = engine_from_settings(settings(
        tmp_path, "t4", engine__model="/models/qwen", engine__model_id="qwen", engine__radix_eviction_policy="lfu",
        engine__hierarchical_cache=True, engine__mem_fraction_static=0.5))
    assert isinstance(engine, SGLangEngine)
    assert engine.model_id == "qwen"
    args = engine.options.server_args()
    assert args["served_model_name"] == "qwen"
    assert args["radix_eviction_policy"] == "lfu"
    assert args["enable_hierarchical_cache"] is True
    assert args["mem_fraction_static"] == 0.5


async def test_missing_sglang_says_what_to_install(tmp_path: Path, no_sglang: _RefuseSglang) -> None:
    engine = engine_from_settings(settings(tmp_path, "t4"))
    with pytest.raises(EngineError, match=r'pip install "edgecache\[gpu\]"'):
        await engine.start()
    assert no_sglang.attempts and no_sglang.attempts[0] == "sglang"  # the import happened at start(), not before


def test_openai_kind_builds_the_upstream_engine(tmp_path: Path) -> None:
    engine = engine_from_settings(settings(tmp_path, engine__kind="openai",
                                           engine__upstream_url="http://10.0.0.5:30000/v1/",
                                           engine__upstream_key="sk-test", engine__model_id="served"))
    assert isinstance(engine, OpenAIUpstreamEngine)
    assert engine.base_url == "http://10.0.0.5:30000/v1"
    assert engine.model_id == "served"
    assert engine._api_key == "sk-test"


def test_openai_kind_without_a_url_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="upstream_url"):
        engine_from_settings(settings(tmp_path, engine__kind="openai"))


def test_gpu_profiles_size_the_host_tier_from_this_boxs_ram(tmp_path: Path, no_sglang: _RefuseSglang) -> None:
    for profile in ("a100", "h100"):
        s = settings(tmp_path, profile)
        assert s.engine.hierarchical_cache and s.engine.hicache_host_share is not None
        engine = engine_from_settings(s)
        assert isinstance(engine, SGLangEngine)
        share = s.engine.hicache_host_share
        assert engine.options.server_args()["hicache_size"] == hicache_host_gb(share, host_ram_bytes())
        assert engine.options.hicache_storage_root is None  # the file tier is opt-in
    t4 = engine_from_settings(settings(tmp_path, "t4"))
    assert isinstance(t4, SGLangEngine) and "hicache_size" not in t4.options.server_args()


def test_the_file_tier_goes_under_the_data_dir(tmp_path: Path, no_sglang: _RefuseSglang) -> None:
    engine = engine_from_settings(settings(tmp_path, "a100", engine__hicache_storage="file",
                                           engine__hicache_storage_bytes="50GB"))
    assert isinstance(engine, SGLangEngine)
    assert engine.options.hicache_storage_root == str(tmp_path / "sglang-hicache")
    assert engine.options.hicache_storage_bytes == 50 * 10**9
    args = engine.options.server_args(storage_dir=tmp_path / "sglang-hicache" / "m")
    assert args["hicache_storage_backend"] == "file"


@pytest.mark.parametrize("override", [{"engine__hicache_storage": "file"}, {"engine__hicache_host_share": 0.3}])
def test_a_tier_without_the_hierarchical_cache_is_a_settings_error(tmp_path: Path, override: dict[str, Any]) -> None:
    with pytest.raises(SettingsError, match="hierarchical_cache"):
        engine_from_settings(settings(tmp_path, "t4", **override))
