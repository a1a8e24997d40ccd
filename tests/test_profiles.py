"""Hardware profiles: they load, their GPU memory splits follow the field guidance and buy KV tokens, `profiles show`
prints them, bad profiles fail cleanly, and no code branches on a profile's name."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from edgecache.cli.main import app
from typer.testing import CliRunner

from edgecache.hardware import (
    CUDA_CONTEXT_GB,
    GIB,
    KV_SHARE_GUIDANCE,
    MIN_HEADROOM_GB,
    WEIGHTS_SHARE_GUIDANCE,
    MemorySplitError,
    hicache_host_bytes,
    hicache_host_gb,
    host_ram_bytes,
    kv_bytes_per_token,
    memory_split,
    split_inputs_missing,
    validate_memory,
)
from edgecache.settings import (
    Settings,
    SettingsError,
    pick_profile,
    profile_names,
    read_profile,
    resolve_settings,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
GPU_PROFILES = ["t4", "a100", "h100"]
runner = CliRunner()


def load(profile: str, tmp_path: Path, **overrides: Any) -> Settings:
    dotted = {k.replace("__", "."): v for k, v in overrides.items()}
    return resolve_settings(profile, {"data_dir": str(tmp_path), **dotted}, environ={})


def write(tmp_path: Path, text: str, name: str = "custom.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --- the arithmetic ---------------------------------------------------------------------------------------------


def test_kv_bytes_per_token_of_known_models() -> None:
    assert kv_bytes_per_token(28, 4, 128, 2) == 57_344  # Qwen2.5-7B: 56 KiB
    assert kv_bytes_per_token(32, 8, 128, 2) == 131_072  # Llama-3.1-8B: 128 KiB
    assert kv_bytes_per_token(80, 8, 128, 2) == 327_680  # Qwen2.5-72B: 320 KiB
    assert kv_bytes_per_token(30, 3, 64, 2) == 23_040  # SmolLM2-135M (the cpu profile's 35 MB per 1.5k tokens)
    assert kv_bytes_per_token(28, 4, 128, 1) == 57_344 // 2  # fp8 KV halves it


def test_split_arithmetic(tmp_path: Path) -> None:
    s = load("t4", tmp_path, hardware__gpu_memory_gb=16, engine__mem_fraction_static=0.5, engine__weights_gb=4,
             engine__layers=28, engine__kv_heads=4, engine__head_dim=128, semantic__gpu_mem_limit="1GiB")
    split = memory_split(s)
    assert split is not None
    assert split.static_gb == 8.0
    assert split.kv_pool_gb == 8.0 - 4.0 - CUDA_CONTEXT_GB
    assert split.kv_tokens == int(split.kv_pool_gb * GIB) // 57_344
    assert split.weights_share == 0.5 and split.kv_share == split.kv_pool_gb / 8.0
    assert split.embedder_gb == 1.0 + CUDA_CONTEXT_GB
    assert split.headroom_gb == 16 - 8 - split.embedder_gb
    assert split.kv_tokens_per_running_request == split.kv_tokens // s.engine.max_running_requests


def test_embedder_on_the_cpu_takes_no_gpu_share(tmp_path: Path) -> None:
    on_gpu = memory_split(load("t4", tmp_path))
    on_cpu = memory_split(load("t4", tmp_path, semantic__device="cpu"))
    off = memory_split(load("t4", tmp_path, semantic__enabled=False))
    assert on_gpu is not None and on_cpu is not None and off is not None
    assert on_gpu.embedder_gb > 0
    assert on_cpu.embedder_gb == off.embedder_gb == 0
    assert on_cpu.headroom_gb == on_gpu.headroom_gb + on_gpu.embedder_gb


# --- shipped profiles -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("profile", profile_names())
def test_every_profile_loads_and_validates(profile: str, tmp_path: Path) -> None:
    s = load(profile, tmp_path)
    assert s.profile == profile and s.description
    validate_memory(s)  # raises when a GPU split cannot work


def test_the_gpu_profiles_ship() -> None:
    assert set(GPU_PROFILES) <= set(profile_names())


@pytest.mark.parametrize("profile", GPU_PROFILES)
def test_gpu_split_follows_the_field_guidance(profile: str, tmp_path: Path) -> None:
    s = load(profile, tmp_path)
    assert s.engine.kind == "sglang"
    assert split_inputs_missing(s) == ()
    split = memory_split(s)
    assert split is not None
    assert split.errors == () and split.warnings == ()
    assert WEIGHTS_SHARE_GUIDANCE[0] <= split.weights_share <= WEIGHTS_SHARE_GUIDANCE[1]
    assert KV_SHARE_GUIDANCE[0] <= split.kv_share <= KV_SHARE_GUIDANCE[1]
    assert split.kv_tokens > 0
    assert split.full_contexts >= 1  # at least one full-length request fits
    assert split.headroom_gb >= MIN_HEADROOM_GB
    assert split.static_gb + split.embedder_gb + split.headroom_gb == pytest.approx(split.gpu_total_gb)
    # The embedder shares the card, capped.
    assert s.semantic.device == "cuda" and s.semantic.gpu_mem_limit
    # Admission never lets more misses compute than the engine runs at once.
    assert s.engine.max_running_requests is not None
    assert s.admission.max_concurrent_misses <= s.engine.max_running_requests


@pytest.mark.parametrize(("reported_mib", "expected"), [
    (15109, "t4"),  # T4 with ECC on, as clouds ship it
    (15360, "t4"),
    (40536, "a100"),  # A100 40 GB PCIe
    (40960, "a100"),  # A100 40 GB SXM4
    (81559, "h100"),  # H100 80 GB
])
def test_the_card_nvidia_smi_reports_picks_its_profile(reported_mib: int, expected: str) -> None:
    # visible_gpu_memory_gb() divides nvidia-smi's MiB by 1024; a profile sized in marketing GB would never be picked.
    assert pick_profile(reported_mib / 1024) == expected


def test_fp16_7b_on_a_t4_is_refused(tmp_path: Path) -> None:
    s = load("t4", tmp_path, engine__model="Qwen/Qwen2.5-7B-Instruct", engine__weights_gb=14.2,
             engine__mem_fraction_static=0.85)
    split = memory_split(s)
    assert split is not None and split.kv_pool_gb <= 0
    assert any("do not fit" in e for e in split.errors)
    with pytest.raises(MemorySplitError, match="do not fit"):
        validate_memory(s)


def test_a_tiny_kv_pool_is_an_error(tmp_path: Path) -> None:
    split = memory_split(load("t4", tmp_path, engine__mem_fraction_static=0.65, engine__weights_gb=8.5))
    assert split is not None and 0 < split.kv_share < 0.10
    assert any("prefix cache could keep almost nothing" in e for e in split.errors)


def test_a_pool_smaller_than_one_context_is_an_error(tmp_path: Path) -> None:
    split = memory_split(load("t4", tmp_path, engine__context_tokens=131072))
    assert split is not None
    assert any("fewer than one full context" in e for e in split.errors)


def test_no_headroom_is_an_error(tmp_path: Path) -> None:
    split = memory_split(load("t4", tmp_path, engine__mem_fraction_static=0.95))
    assert split is not None
    assert any("left for activations" in e for e in split.errors)


def test_leaving_the_guidance_is_a_warning_not_an_error(tmp_path: Path) -> None:
    split = memory_split(load("a100", tmp_path, engine__mem_fraction_static=0.85))
    assert split is not None
    assert split.errors == ()
    assert any("field guidance" in w for w in split.warnings)
    validate_memory(load("a100", tmp_path, engine__mem_fraction_static=0.85))  # does not raise


def test_other_warnings(tmp_path: Path) -> None:
    split = memory_split(load("t4", tmp_path, admission__max_concurrent_misses=64))
    assert split is not None and any("max_running_requests" in w for w in split.warnings)


def test_engines_off_the_gpu_have_no_split(tmp_path: Path) -> None:
    assert memory_split(load("cpu", tmp_path)) is None
    assert memory_split(load("t4", tmp_path, engine__kind="openai", engine__upstream_url="http://x/v1")) is None


def test_missing_numbers_are_named(tmp_path: Path) -> None:
    path = write(tmp_path, '[engine]\nkind = "sglang"\nmodel = "m"\nmem_fraction_static = 0.8\n')
    s = resolve_settings(path, {"data_dir": str(tmp_path)}, environ={})
    assert memory_split(s) is None
    assert split_inputs_missing(s) == ("hardware.gpu_memory_gb", "engine.weights_gb", "engine.layers",
                                       "engine.kv_heads", "engine.head_dim")


# --- edgecache profiles show ------------------------------------------------------------------------------------


def show(*args: str) -> Any:
    return runner.invoke(app, ["profiles", "show", *args], env={"EDGECACHE_DATA_DIR": "/tmp/edgecache-test"})


@pytest.mark.parametrize("profile", GPU_PROFILES)
def test_profiles_show_prints_the_split(profile: str, tmp_path: Path) -> None:
    split = memory_split(load(profile, tmp_path))
    assert split is not None
    result = show(profile)
    assert result.exit_code == 0, result.output
    for text in ("KV tokens", f"{split.kv_tokens:,}", "headroom", f"{split.kv_bytes_per_token:,}",
                 "engine.mem_fraction_static"):
        assert text in result.output


def test_profiles_show_json(tmp_path: Path) -> None:
    result = show("h100", "--json")
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    expected = memory_split(load("h100", tmp_path))
    assert body["memory_split"] == json.loads(msgspec.json.encode(expected))
    assert body["settings"]["engine"]["model"] == "Qwen/Qwen2.5-72B-Instruct-AWQ"
    cpu = json.loads(show("cpu", "--json").stdout)
    assert cpu["memory_split"] is None and cpu["settings"]["engine"]["kind"] == "llamacpp"


def test_profiles_show_cpu_says_there_is_no_split() -> None:
    result = show("cpu")
    assert result.exit_code == 0
    assert "no GPU memory split" in result.output


@pytest.mark.parametrize(("text", "named"), [
    ('[engine]\nmem_fraction_static = 1.5\n', "engine.mem_fraction_static"),
    ('[engine]\nmem_fracton_static = 0.5\n', "mem_fracton_static"),
    ('[semantic]\ndevice = "tpu"\n', "semantic.device"),
    ('[admission]\nmax_concurrent_misses = 0\n', "admission.max_concurrent_misses"),
    ('[engine\nkind = "sglang"\n', "not valid TOML"),
])
def test_a_bad_profile_exits_2_naming_the_field(text: str, named: str, tmp_path: Path) -> None:
    result = show(write(tmp_path, text))
    assert result.exit_code == 2, result.output
    assert named in result.output.replace("$.", "").replace("` - at `", ".").replace("`", "")
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)


def test_a_split_that_cannot_work_exits_2(tmp_path: Path) -> None:
    profile = read_profile("t4")
    text = (REPO_ROOT / "profiles" / "t4.toml").read_text().replace(
        f"weights_gb = {profile['engine']['weights_gb']}", "weights_gb = 14.2")
    result = show(write(tmp_path, text))
    assert result.exit_code == 2
    assert "do not fit" in result.stderr
    assert "Traceback" not in result.output


def test_unknown_profile_exits_2() -> None:
    result = show("v100")
    assert result.exit_code == 2 and "unknown profile" in result.output


# --- the profile is data ----------------------------------------------------------------------------------------


def _profile_branches(source: str, names: set[str]) -> list[str]:
    """Comparisons against a profile name or the profile field, and any literal GPU profile name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            texts = [ast.unparse(o) for o in operands]
            if any(t.endswith(".profile") or t == "profile" for t in texts) or any(isinstance(o, ast.Constant) and o.value in names for o in operands) and not any(
                    "device" in t for t in texts):
                found.append(ast.unparse(node))
        elif isinstance(node, ast.Constant) and node.value in set(GPU_PROFILES):
            found.append(repr(node.value))
    return found


def test_the_detector_finds_a_branch() -> None:
    names = set(profile_names())
    assert _profile_branches('if settings.profile == "t4":\n    x = 1\n', names)
    assert _profile_branches('mode = "h100"\n', names)
    assert _profile_branches('if name == "cpu":\n    pass\n', names)
    assert not _profile_branches('if semantic.device == "cpu":\n    pass\n', names)


def test_no_code_branches_on_a_profile_name() -> None:
    names = set(profile_names())
    offenders = {}
    for folder in ("edgecache", "cli"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            found = _profile_branches(path.read_text(), names)
            if found:
                offenders[str(path.relative_to(REPO_ROOT))] = found
    assert offenders == {}


def test_profiles_show_prints_every_setting_name_whole() -> None:
    # Under a test runner, as in a pipe, rich lays the table out at 80 columns: the longest names must not be cut.
    result = show("cpu")
    assert result.exit_code == 0
    for scenario in ("default", "support", "knowledge", "code"):
        assert f"scenarios.{scenario}.target_false_hit_rate" in result.output
    assert "semantic.learner_explore_share" in result.output and "…" not in result.output


def test_the_box_ram_is_memtotal_or_the_cgroup_limit_when_lower(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       87654321 kB\nMemFree:        1000 kB\nMemAvailable:   5000 kB\n")
    total = 87654321 * 1024
    assert host_ram_bytes(meminfo, ()) == total
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    v2.write_text("max\n")  # no limit
    v1.write_text(f"{2**63 - 4096}\n")  # v1's "no limit"
    assert host_ram_bytes(meminfo, (v2, v1)) == total
    v2.write_text(f"{32 * GIB}\n")
    assert host_ram_bytes(meminfo, (v2, v1, tmp_path / "absent")) == 32 * GIB
    with pytest.raises(SettingsError, match="MemTotal"):
        host_ram_bytes(tmp_path / "absent", ())


def test_the_host_tier_is_a_share_of_the_ram_in_whole_gb_and_never_under_one() -> None:
    assert hicache_host_gb(0.35, 85 * 10**9) == 29  # 29.75 GB, rounded down
    assert hicache_host_gb(0.4, 200 * 10**9) == 80
    with pytest.raises(SettingsError, match="under 1 GB"):
        hicache_host_gb(0.05, 16 * 10**9)  # 0.8 GB: SGLang would read 0 as "size by ratio"


def test_only_a_sized_host_tier_of_the_sglang_engine_takes_ram(tmp_path: Path) -> None:
    ram = 100 * 10**9
    assert hicache_host_bytes(load("a100", tmp_path), ram) == 35 * 10**9
    assert hicache_host_bytes(load("t4", tmp_path), ram) == 0  # no hierarchical cache
    a100 = load("a100", tmp_path)
    unsized = msgspec.structs.replace(a100, engine=msgspec.structs.replace(a100.engine, hicache_host_share=None))
    assert hicache_host_bytes(unsized, ram) == 0  # SGLang sizes it
    assert hicache_host_bytes(load("cpu", tmp_path), ram) == 0
