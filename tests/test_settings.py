"""Settings: shipped profiles, environment and explicit overrides, byte sizes, errors, and the configuration page's coverage."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgecache.settings import (
    ByteSize,
    Settings,
    SettingsError,
    env_overrides,
    iter_fields,
    pick_profile,
    profile_names,
    resolve_settings,
    settings_to_dict,
)

REPO_ROOT = Path(__file__).resolve().parents[1]  # /work/main


def write_profile(tmp_path: Path, text: str, name: str = "custom.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --- shipped profiles ------------------------------------------------------------------------------------------


def test_cpu_is_shipped() -> None:
    assert "cpu" in profile_names()


@pytest.mark.parametrize("name", profile_names())
def test_every_shipped_profile_loads(name: str, tmp_path: Path) -> None:
    settings = resolve_settings(name, {"data_dir": str(tmp_path)}, environ={})
    assert isinstance(settings, Settings)
    assert settings.profile == name
    assert settings.description, f"profile {name} has no description"
    assert settings.store.disk_bytes > 0 and settings.store.memory_bytes > 0


def test_cpu_profile_values(tmp_path: Path) -> None:
    s = resolve_settings("cpu", {"data_dir": str(tmp_path)}, environ={})
    assert s.profile == "cpu"
    assert s.hardware.gpu_memory_gb == 0
    assert (s.server.host, s.server.port) == ("127.0.0.1", 8000)
    assert s.server.max_body_bytes == 1_000_000
    assert s.server.max_messages == 256
    assert s.engine.kind == "llamacpp" and s.engine.model == "smollm2"
    assert s.engine.context_tokens == 4096
    assert s.engine.batch_tokens == 512
    assert s.engine.prefix_cache_bytes == 512 * 2**20
    assert s.engine.prefix_cache_min_tokens == 64
    assert s.engine.default_max_tokens == 256
    assert s.store.disk_bytes == 2 * 10**9
    assert s.store.memory_bytes == 64 * 2**20
    assert s.ttl_tiers.static_s == 86400.0 and s.ttl_tiers.realtime_s == 30.0
    assert isinstance(s.store.disk_bytes, ByteSize)
    assert s.data_path == tmp_path


def test_pick_profile_without_a_gpu_is_cpu() -> None:
    assert pick_profile(0) == "cpu"
    assert pick_profile(0.0) == "cpu"


def test_pick_profile_prefers_the_largest_that_fits() -> None:
    # Whatever profiles ship, the pick must fit the GPU and be the largest that does.
    from edgecache.settings import read_profile
    sizes = {n: float(read_profile(n).get("hardware", {}).get("gpu_memory_gb", 0)) for n in profile_names()}
    for gpu in (0.0, 16.0, 40.0, 80.0, 1000.0):
        picked = pick_profile(gpu)
        assert sizes[picked] <= gpu
        assert sizes[picked] == max(v for v in sizes.values() if v <= gpu)


# --- environment and explicit overrides ------------------------------------------------------------------------


def test_env_overrides_map_to_dotted_paths() -> None:
    env = {"EDGECACHE_SERVER__PORT": "9100", "EDGECACHE_DATA_DIR": "/x", "EDGECACHE_PROFILE": "cpu",
           "OTHER": "1"}
    assert env_overrides(env) == {"server.port": "9100", "data_dir": "/x"}


def test_environment_overrides_the_profile(tmp_path: Path) -> None:
    env = {"EDGECACHE_SERVER__PORT": "9100", "EDGECACHE_DATA_DIR": str(tmp_path / "ec")}
    s = resolve_settings("cpu", environ=env)
    assert s.server.port == 9100 and isinstance(s.server.port, int)
    assert s.data_dir == str(tmp_path / "ec")


def test_environment_strings_become_byte_sizes_and_floats(tmp_path: Path) -> None:
    env = {"EDGECACHE_STORE__DISK_BYTES": "3GB", "EDGECACHE_TTL_TIERS__STATIC_S": "30",
           "EDGECACHE_DATA_DIR": str(tmp_path)}
    s = resolve_settings("cpu", environ=env)
    assert s.store.disk_bytes == 3 * 10**9
    assert s.ttl_tiers.static_s == 30.0


def test_environment_can_name_the_profile(tmp_path: Path) -> None:
    s = resolve_settings(None, environ={"EDGECACHE_PROFILE": "cpu", "EDGECACHE_DATA_DIR": str(tmp_path)})
    assert s.profile == "cpu"


def test_explicit_overrides_beat_the_environment(tmp_path: Path) -> None:
    env = {"EDGECACHE_SERVER__PORT": "9100", "EDGECACHE_DATA_DIR": str(tmp_path / "env")}
    s = resolve_settings("cpu", {"server.port": 9200, "data_dir": str(tmp_path / "flag")}, environ=env)
    assert s.server.port == 9200
    assert s.data_dir == str(tmp_path / "flag")


def test_none_overrides_are_ignored(tmp_path: Path) -> None:
    env = {"EDGECACHE_SERVER__PORT": "9100", "EDGECACHE_DATA_DIR": str(tmp_path)}
    s = resolve_settings("cpu", {"server.port": None, "server.host": None}, environ=env)
    assert s.server.port == 9100  # the flag was not given: the environment stands
    assert s.server.host == "127.0.0.1"  # neither given: the profile stands


def test_the_default_data_dir_follows_xdg(tmp_path: Path) -> None:
    s = resolve_settings("cpu", environ={"XDG_DATA_HOME": str(tmp_path)})
    assert s.data_path == tmp_path / "edgecache"


def test_settings_round_trip_to_builtins(tmp_path: Path) -> None:
    # BUG: edgecache/settings.py _enc_hook (line ~58) / settings_to_dict (line ~236): msgspec.to_builtins hands
    # ByteSize (an int subclass) to enc_hook, which only knows Path and raises NotImplementedError, so
    # settings_to_dict fails for every profile and `edgecache profiles show cpu` crashes with a traceback.
    d = settings_to_dict(resolve_settings("cpu", {"data_dir": str(tmp_path)}, environ={}))
    assert d["server"]["port"] == 8000
    assert d["store"]["disk_bytes"] == 2 * 10**9
    assert resolve_settings("cpu", d, environ={}) == \
        resolve_settings("cpu", {"data_dir": str(tmp_path)}, environ={})


# --- byte sizes ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("2GB", 2 * 10**9),
    ("512MiB", 512 * 2**20),
    ("1MB", 10**6),
    ("64KiB", 64 * 2**10),
    ("1TiB", 2**40),
    (" 2 GiB ", 2 * 2**30),
    ("2gb", 2 * 10**9),
    ("1.5GB", 1_500_000_000),
    ("100", 100),
    ("100B", 100),
    (0, 0),
    (1048576, 1048576),
])
def test_byte_size_parses(text: object, expected: int) -> None:
    parsed = ByteSize.parse(text)
    assert parsed == expected and isinstance(parsed, ByteSize)


@pytest.mark.parametrize("text, expected", [
    ("2.01KB", 2010),
    ("2.05GB", 2_050_000_000),
])
def test_byte_size_parses_decimal_fractions_exactly(text: str, expected: int) -> None:
    # BUG: edgecache/settings.py ByteSize.parse, `int(float(match.group(1)) * cls._UNITS[...])` truncates a
    # binary float product: "2.01KB" -> 2009, "2.05GB" -> 2049999999. Use round() (or Decimal) instead of int().
    assert ByteSize.parse(text) == expected


@pytest.mark.parametrize("bad", ["lots", "", "2XB", "-5MB", "1,000", "GB", "2 G B", True, -1, 1.5, None])
def test_byte_size_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        ByteSize.parse(bad)


def test_a_bad_byte_size_is_a_settings_error_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="disk_bytes") as info:
        resolve_settings("cpu", {"store.disk_bytes": "lots", "data_dir": str(tmp_path)}, environ={})
    assert "lots" in str(info.value)


# --- errors ----------------------------------------------------------------------------------------------------


def test_an_unknown_field_in_a_profile_file_is_a_settings_error_naming_it(tmp_path: Path) -> None:
    path = write_profile(tmp_path, '[server]\nport = 8000\nbogus_knob = 3\n')
    with pytest.raises(SettingsError, match="bogus_knob"):
        resolve_settings(path, {"data_dir": str(tmp_path)}, environ={})


def test_an_unknown_section_in_a_profile_file_is_a_settings_error(tmp_path: Path) -> None:
    path = write_profile(tmp_path, '[sever]\nport = 8000\n')
    with pytest.raises(SettingsError, match="sever"):
        resolve_settings(path, {"data_dir": str(tmp_path)}, environ={})


def test_a_profile_file_loads_with_its_stem_as_name(tmp_path: Path) -> None:
    path = write_profile(tmp_path, '[server]\nport = 8123\n', name="mybox.toml")
    s = resolve_settings(path, {"data_dir": str(tmp_path)}, environ={})
    assert s.profile == "mybox" and s.server.port == 8123


def test_an_unknown_environment_variable_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="srever"):
        resolve_settings("cpu", environ={"EDGECACHE_SREVER__PORT": "1", "EDGECACHE_DATA_DIR": str(tmp_path)})


def test_an_out_of_range_port_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="port"):
        resolve_settings("cpu", {"server.port": 70000, "data_dir": str(tmp_path)}, environ={})
    with pytest.raises(SettingsError, match="port"):
        resolve_settings("cpu", environ={"EDGECACHE_SERVER__PORT": "70000", "EDGECACHE_DATA_DIR": str(tmp_path)})


def test_a_non_numeric_port_from_the_environment_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="port"):
        resolve_settings("cpu", environ={"EDGECACHE_SERVER__PORT": "eighty", "EDGECACHE_DATA_DIR": str(tmp_path)})


def test_a_bad_choice_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="kind"):
        resolve_settings("cpu", {"engine.kind": "tensorrt", "data_dir": str(tmp_path)}, environ={})


def test_an_unknown_profile_name_lists_the_known_ones() -> None:
    with pytest.raises(SettingsError) as info:
        resolve_settings("no-such-profile", environ={})
    message = str(info.value)
    assert "no-such-profile" in message
    for name in profile_names():
        assert name in message


def test_a_missing_profile_file_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="not found"):
        resolve_settings(str(tmp_path / "missing.toml"), environ={})


def test_invalid_toml_is_a_settings_error(tmp_path: Path) -> None:
    path = write_profile(tmp_path, "[server\nport = \n")
    with pytest.raises(SettingsError, match="TOML"):
        resolve_settings(path, environ={})


def test_overriding_below_a_leaf_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="server.port.x"):
        resolve_settings("cpu", {"server.port.x": 1, "data_dir": str(tmp_path)}, environ={})


# --- every setting is documented -------------------------------------------------------------------------------


def test_iter_fields_lists_every_leaf_setting() -> None:
    paths = [p for p, _ in iter_fields()]
    assert len(paths) == len(set(paths))
    for expected in ("data_dir", "server.port", "server.max_body_bytes", "engine.kind",
                     "engine.prefix_cache_bytes", "store.disk_bytes", "store.memory_bytes",
                     "hardware.gpu_memory_gb"):
        assert expected in paths
    # Sections are not leaves.
    assert not {"server", "engine", "store", "hardware"} & set(paths)


def test_every_setting_has_help_text() -> None:
    # BUG: edgecache/settings.py _description (line ~254) looks for `.description` / `.extra["description"]` on
    # msgspec.inspect.Metadata, but msgspec puts Meta(description=...) in `.extra_json_schema["description"]`,
    # so iter_fields returns "" as the help text of every field.
    missing = [path for path, help_text in iter_fields() if not help_text.strip()]
    assert not missing, f"settings without help text: {missing}"


def test_every_setting_is_documented_in_the_configuration_page() -> None:
    # Not skipped when the page is absent: a missing page is a failure that lists every field.
    page_path = REPO_ROOT / "docs" / "configuration.md"
    page = page_path.read_text() if page_path.is_file() else ""
    missing = [path for path, _ in iter_fields() if f"`{path}`" not in page]
    assert not missing, f"settings missing from {page_path} (write each as `dotted.path`): {missing}"
