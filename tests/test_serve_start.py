"""`edgecache serve` refuses what cannot work with one clear line and exit status 2, before its banner and before
any model loads: a public address without a tenants file, a tenants file that is missing or wrong, a data dir
another process holds, a busy port, a model that is not a GGUF file."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from edgecache.http.app import create_app
from edgecache.data_dir import DataDirBusy, DataDirLock
from tests.conftest import serve_in_process
from tests.fakes import FakeEngine

BANNER = "serving on"


def serve(tmp_path: Path, *args: str, port: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGECACHE_")}
    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
    return subprocess.run(
        [sys.executable, "-m", "edgecache.cli.main", "serve", "--profile", "cpu", "--port", str(port), *args],
        env=env, capture_output=True, text=True, timeout=120)


def assert_one_line_refusal(result: subprocess.CompletedProcess[str], *phrases: str) -> None:
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: "), result.stderr
    assert BANNER not in result.stderr and "Traceback" not in result.stderr
    for phrase in phrases:
        assert phrase in errors[0], errors[0]


def test_a_file_that_is_not_gguf_is_refused_before_the_banner(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_text("not a model\n")
    result = serve(tmp_path, "--data-dir", str(tmp_path / "data"), "--model", str(bad))
    assert_one_line_refusal(result, str(bad), "GGUF")


def test_a_missing_model_is_refused_before_the_banner(tmp_path: Path) -> None:
    result = serve(tmp_path, "--data-dir", str(tmp_path / "data"), "--model", str(tmp_path / "nope.gguf"))
    assert_one_line_refusal(result, "nope.gguf")


def test_a_busy_port_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        # A model that does not exist: had the port been checked after the model, the refusal would name the model.
        result = serve(tmp_path, "--data-dir", str(tmp_path / "data"), "--model", str(tmp_path / "nope.gguf"),
                       port=port)
    assert_one_line_refusal(result, f"127.0.0.1:{port}", "--port")


def test_a_public_address_without_a_tenants_file_is_refused(tmp_path: Path) -> None:
    result = serve(tmp_path, "--data-dir", str(tmp_path / "data"), "--host", "0.0.0.0")
    assert_one_line_refusal(result, "0.0.0.0", "no tenants file", "--tenants")


def test_a_missing_tenants_file_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    missing = tmp_path / "tenants.toml"
    # A model that does not exist: had the tenants file been read after the model, the refusal would name the model.
    result = serve(tmp_path, "--data-dir", str(tmp_path / "data"), "--host", "0.0.0.0", "--tenants", str(missing),
                   "--model", str(tmp_path / "nope.gguf"))
    assert_one_line_refusal(result, "tenants file not found", str(missing))


def test_a_tenant_on_an_unknown_plan_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[plans.basic]\n\n[[tenants]]\nid = "acme"\nplan = "gold"\nkeys = ["sk-acme-1"]\n')
    result = serve(tmp_path, "--data-dir", str(tmp_path / "data"), "--tenants", str(tenants),
                   "--model", str(tmp_path / "nope.gguf"))
    assert_one_line_refusal(result, "unknown plan 'gold'")
    assert "sk-acme-1" not in result.stderr


def test_a_data_dir_in_use_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with DataDirLock(data):
        result = serve(tmp_path, "--data-dir", str(data), "--model", str(tmp_path / "nope.gguf"))
    assert_one_line_refusal(result, str(data), f"pid {os.getpid()}")


async def test_a_second_app_on_one_data_dir_refuses_and_the_first_keeps_serving(make_settings) -> None:  # noqa: ANN001
    settings = make_settings()
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as first:
        with pytest.raises(BaseException) as refused:  # the lifespan wraps it in an exception group
            async with serve_in_process(create_app(settings, engine=FakeEngine())):
                pass
        busy = [e for e in leaves(refused.value) if isinstance(e, DataDirBusy)]
        assert busy and "in use by another EdgeCache process" in str(busy[0])
        assert (await first.get("/health")).status_code == 200
    # Released at shutdown: the next server on the same dir starts.
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as again:
        assert (await again.get("/health")).status_code == 200


def leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [exc]


def test_the_lock_is_released_when_its_holder_dies(tmp_path: Path) -> None:
    data = tmp_path / "data"
    code = f"from edgecache.data_dir import DataDirLock; DataDirLock({str(data)!r}).acquire(); import os; os._exit(0)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    DataDirLock(data).acquire().release()  # no stale lock after the holder's exit
