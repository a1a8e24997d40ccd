"""`edgecache doctor`: one line per check, every check in --json, and a failing exit status when a check fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from edgecache.doctor import CHECK_NAMES

REPO_ROOT = Path(__file__).resolve().parent.parent


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGECACHE_")}
    env["EDGECACHE_SEMANTIC__ENABLED"] = "false"  # the canary's embedder is tested in test_canary.py
    return subprocess.run([sys.executable, "-m", "edgecache.cli.main", "doctor", "--profile", "cpu", *args],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)


def test_doctor_json_has_every_check_and_fails_when_the_data_dir_is_not_writable(tmp_path: Path) -> None:
    good = doctor("--json", "--data-dir", str(tmp_path / "data"))
    report = json.loads(good.stdout)
    assert [c["name"] for c in report["checks"]] == list(CHECK_NAMES)
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["data_dir"]["status"] == "ok" and "writable" in by_name["data_dir"]["detail"]
    assert by_name["canary"]["status"] in ("ok", "warn"), by_name["canary"]
    assert good.returncode == (0 if report["ok"] else 1)

    # A data dir under a regular file cannot be created, whoever runs the test (root ignores permission bits).
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = doctor("--json", "--data-dir", str(blocker / "data"))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    failed = json.loads(bad.stdout)
    assert failed["ok"] is False
    statuses = {c["name"]: c["status"] for c in failed["checks"]}
    assert statuses["data_dir"] == "fail"
    assert [c["name"] for c in failed["checks"]] == list(CHECK_NAMES)
    # the data dir is what failed: the other checks read as they did on the good dir
    assert {n: s for n, s in statuses.items() if n != "data_dir"} == \
        {c["name"]: c["status"] for c in report["checks"] if c["name"] != "data_dir"}


def test_doctor_prints_one_line_per_check(tmp_path: Path) -> None:
    result = doctor("--data-dir", str(tmp_path / "data"))
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert [line.split()[1] for line in lines] == list(CHECK_NAMES), result.stdout
    assert all(line.split()[0] in ("ok", "warn", "fail") for line in lines)


def test_doctor_fails_when_redis_is_not_reachable_and_names_a_server_holding_the_data_dir(tmp_path: Path) -> None:
    import socket

    from edgecache.data_dir import DataDirLock

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with DataDirLock(tmp_path / "data"):  # as a running server holds it
        result = doctor("--json", "--data-dir", str(tmp_path / "data"), "--redis", f"redis://127.0.0.1:{port}/0")
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert f"in use by another EdgeCache process (pid {os.getpid()})" in checks["data_dir"]["detail"]
    assert checks["redis"]["status"] == "fail" and "not reachable" in checks["redis"]["detail"]
    assert result.returncode == 1


def test_the_cpu_check_warns_when_repacking_is_forced_on_an_amx_cpu(monkeypatch, make_settings) -> None:  # noqa: ANN001
    from edgecache import doctor as doctor_module

    amx = frozenset({"avx2", "avx512f", "amx_tile", "amx_int8", "amx_bf16"})
    monkeypatch.setattr(doctor_module, "cpu_flags", lambda: amx)
    forced = doctor_module.check_cpu(make_settings(engine__extra_buffer_types="on"))
    assert forced.status == "warn" and "AMX" in forced.detail and "-> on" in forced.detail
    auto = doctor_module.check_cpu(make_settings())
    assert auto.status == "ok" and "engine.extra_buffer_types = auto -> off" in auto.detail


def _tiered(tmp_path: Path, **overrides: object):  # noqa: ANN202
    from edgecache.settings import resolve_settings

    return resolve_settings("a100", {"data_dir": str(tmp_path), **overrides}, environ={})


def test_the_hicache_build_check_runs_only_for_a_storage_tier(tmp_path: Path, make_settings) -> None:  # noqa: ANN001
    from edgecache.doctor import check_hicache_build

    never = lambda name: None  # noqa: E731 - no compiler anywhere
    for settings in (make_settings(), _tiered(tmp_path)):  # the CPU engine; a host tier without storage
        check = check_hicache_build(settings, environ={}, which=never)
        assert check.status == "ok" and "not needed" in check.detail


def test_the_hicache_build_check_fails_without_a_compiler_saying_what_to_install(tmp_path: Path) -> None:
    from edgecache.doctor import check_hicache_build

    asked: list[str] = []
    check = check_hicache_build(_tiered(tmp_path, **{"engine.hicache_storage": "file"}), environ={"CXX": "clang++"},
                                which=lambda name: asked.append(name))  # type: ignore[func-returns-value]
    assert asked == ["clang++"]  # torch's compiler: $CXX, else c++
    assert check.status == "fail"
    assert "no C++ compiler (clang++)" in check.detail and "apt-get install g++ libssl-dev" in check.detail


def test_the_hicache_build_check_fails_without_openssl_headers(tmp_path: Path) -> None:
    from edgecache.doctor import check_hicache_build

    compiler = tmp_path / "c++"  # a compiler that cannot find the header, as on a box without libssl-dev
    compiler.write_text("#!/bin/sh\necho \"$1:1:10: fatal error: openssl/sha.h: No such file or directory\" >&2\n"
                        "exit 1\n")
    compiler.chmod(0o755)
    check = check_hicache_build(_tiered(tmp_path, **{"engine.hicache_storage": "file"}), environ={},
                                which=lambda name: str(compiler) if name == "c++" else None)
    assert check.status == "fail"
    assert "OpenSSL's headers or libcrypto are missing" in check.detail and "libssl-dev" in check.detail


def test_the_hicache_build_check_passes_where_a_compiler_builds_against_openssl(tmp_path: Path) -> None:
    import shutil

    from edgecache.doctor import check_hicache_build

    if shutil.which("c++") is None or not Path("/usr/include/openssl/sha.h").is_file():
        import pytest

        pytest.skip("no c++ and OpenSSL headers on this machine")
    check = check_hicache_build(_tiered(tmp_path, **{"engine.hicache_storage": "file"}), environ={})
    assert check.status == "ok", check.detail


def test_model_version_says_what_the_keys_hold_and_where_it_comes_from(make_settings: Any) -> None:
    """Behind an upstream, the version doctor reports is the one the engine would key by (here a pinned one, and an
    upstream nobody answers at), and the CPU engine's comes from its weights."""
    from edgecache.doctor import check_model_version

    assert "fingerprint" in check_model_version(make_settings()).detail
    pinned = check_model_version(make_settings(engine__kind="openai", engine__upstream_url="http://127.0.0.1:9/v1",
                                               engine__version="release-7"))
    assert pinned.status == "ok" and "release-7" in pinned.detail
    away = check_model_version(make_settings(engine__kind="openai", engine__upstream_url="http://127.0.0.1:9/v1"))
    assert away.status == "fail" and "127.0.0.1:9" in away.detail
