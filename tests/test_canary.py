"""The start-up canary (edgecache/canary.py) and the engine setting it leans on (engine.extra_buffer_types).

A native fault of a co-hosted component must show at start, named in one line, never on a user's first request: a
fake engine that kills its own process with SIGSEGV (tests/canary_fakes.py) stands for llama.cpp's AMX fault.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
import pytest

from edgecache.bench.harness import free_port
from edgecache.canary import CanaryFailed, safe_settings, settle
from edgecache.cpu import cpu_flags, extra_buffer_types_on, has_amx
from edgecache.settings import Settings
from tests.canary_fakes import SLEEPER

REPO_ROOT = Path(__file__).resolve().parent.parent
SAPPHIRE_RAPIDS = {"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx_vnni", "amx_bf16",
                   "amx_tile", "amx_int8"}
EPYC = {"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni"}


# ---- engine.extra_buffer_types --------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["amx_int8", "amx_tile", "amx_bf16"])
def test_auto_is_off_where_the_cpu_has_amx(flag: str) -> None:
    assert extra_buffer_types_on("auto", (EPYC | {flag})) is False
    assert extra_buffer_types_on("auto", SAPPHIRE_RAPIDS) is False


def test_auto_is_on_without_amx_and_on_off_are_forced() -> None:
    assert extra_buffer_types_on("auto", EPYC) is True
    assert extra_buffer_types_on("on", SAPPHIRE_RAPIDS) is True
    assert extra_buffer_types_on("off", EPYC) is False


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8488C\n"
                       f"flags\t\t: {' '.join(sorted(SAPPHIRE_RAPIDS))}\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(cpuinfo) == SAPPHIRE_RAPIDS
    assert has_amx(cpu_flags(cpuinfo))
    assert cpu_flags(tmp_path / "absent") == frozenset()


LOAD_AND_REPORT = """
import asyncio, sys
from edgecache.engines import engine_from_settings
from edgecache.settings import resolve_settings
settings = resolve_settings("cpu", {"engine.extra_buffer_types": sys.argv[1], "data_dir": sys.argv[2]}, environ={})
engine = engine_from_settings(settings)
asyncio.run(engine.start())
llm = engine._llm
# what llama-cpp-python handed to llama_model_load_from_file, and its own default
import llama_cpp
print(llm.model_params.use_extra_bufts, llm._model.params.use_extra_bufts,
      llama_cpp.llama_model_default_params().use_extra_bufts)
"""


@pytest.mark.parametrize("choice", ["on", "off"])
def test_the_setting_reaches_llama_cpps_model_params(choice: str, tmp_path: Path) -> None:
    # In a child: on an AMX CPU a model loaded with extra buffer types faults on its first decode, and loading is
    # all this test does, but a child keeps even that away from the test process.
    proc = subprocess.run([sys.executable, "-c", LOAD_AND_REPORT, choice, str(tmp_path / "data")],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    given, loaded_with, default = proc.stdout.split()
    assert given == loaded_with == str(choice == "on")
    assert default == "True"  # llama.cpp's own default: without the setting, repacking would be on


# ---- the canary -----------------------------------------------------------------------------------------------


def test_the_real_engine_and_embedder_pass_with_the_configured_settings(
        make_settings: Callable[..., Settings]) -> None:
    settings = make_settings(semantic__enabled=True)
    settled, report = settle(settings)
    assert settled is settings
    assert report.settled == "configured" and [a.ok for a in report.attempts] == [True]
    assert report.extra_buffer_types is extra_buffer_types_on("auto", cpu_flags())


def test_safe_settings_turn_off_repacking_and_use_one_thread(make_settings: Callable[..., Settings]) -> None:
    safe = safe_settings(make_settings(engine__threads=0, semantic__threads=2))
    assert (safe.engine.extra_buffer_types, safe.engine.threads, safe.semantic.threads) == ("off", 1, 1)


def test_a_hanging_embedder_is_bounded_and_named(make_settings: Callable[..., Settings],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    settings = make_settings(semantic__enabled=True, semantic__embedder="tests.canary_fakes:hanging_embedder",
                             engine__kind="tests.canary_fakes:segfaults_unless_one_thread", engine__threads=1,
                             canary__timeout_s=5)
    with pytest.raises(CanaryFailed) as failed:
        settle(settings)
    message = str(failed.value)
    assert "the embedder hung past 5 s with the configured settings" in message
    assert "the embedder hung past 5 s with safe settings" in message
    assert "\n" not in message
    logged = [r.getMessage() for r in caplog.records]
    assert any("the embedder hung past 5 s with the configured settings" in m and "semantic.embedder=tests."
               "canary_fakes:hanging_embedder" in m and "CPU " in m for m in logged), logged


def start_serve(tmp_path: Path, engine_kind: str) -> tuple[subprocess.Popen[str], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGECACHE_")} | {
        "EDGECACHE_ENGINE__KIND": engine_kind, "EDGECACHE_SEMANTIC__ENABLED": "false",
        "PYTHONPATH": str(REPO_ROOT)}
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgecache.cli.main", "serve", "--profile", "cpu", "--port", str(port),
         "--data-dir", str(tmp_path / "data")], env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"


def poll_health(proc: subprocess.Popen[str], url: str, deadline_s: float = 240) -> list[int]:
    """/health's statuses until it answers 200 or the process exits."""
    seen: list[int] = []
    deadline = time.monotonic() + deadline_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            seen.append(httpx.get(url + "/health", timeout=2).status_code)
            if seen[-1] == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return seen


def test_serve_retries_a_segfaulting_engine_with_safe_settings_then_serves(tmp_path: Path) -> None:
    proc, url = start_serve(tmp_path, "tests.canary_fakes:segfaults_unless_one_thread")
    try:
        assert poll_health(proc, url)[-1:] == [200], proc.poll()
        health = httpx.get(url + "/health", timeout=5).json()
        assert health["canary"]["settled"] == "safe"
        assert health["canary"]["engine_threads"] == 1  # extra_buffer_types: None, the fake is no llamacpp
        first, second = health["canary"]["attempts"]
        assert (first["ok"], first["part"], first["failure"]) == (False, "engine", "died with SIGSEGV")
        assert second["ok"] is True
        reply = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": "canary-fake", "messages": [{"role": "user", "content": "hello"}]})
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "answer to: hello"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert "the engine died with SIGSEGV with the configured settings" in out
    assert "retrying with safe settings" in out


def test_serve_exits_with_one_message_when_the_engine_dies_both_times(tmp_path: Path) -> None:
    proc, url = start_serve(tmp_path, "tests.canary_fakes:segfaults_always")
    try:
        seen = poll_health(proc, url)
        returncode = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        out, _ = proc.communicate(timeout=60)
    assert 200 not in seen
    assert returncode == 1, out
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out
    assert "the engine died with SIGSEGV with the configured settings" in errors[0]
    assert "the engine died with SIGSEGV with safe settings" in errors[0]
    assert "serving on" not in out and "Traceback" not in out


def test_the_report_is_what_health_shows(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings(engine__kind="tests.canary_fakes:segfaults_unless_one_thread")
    settled, report = settle(settings)
    assert settled.engine.threads == 1 and report.settled == "safe"
    # the report travels as JSON on /health
    assert msgspec.json.decode(msgspec.json.encode(report))["attempts"][0]["failure"] == "died with SIGSEGV"


def test_an_offline_warmup_runs_the_canary_first(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello", "answer": "hi"}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGECACHE_")} | {
        "EDGECACHE_ENGINE__KIND": "tests.canary_fakes:segfaults_always", "EDGECACHE_SEMANTIC__ENABLED": "false",
        "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-m", "edgecache.cli.main", "warmup", str(prompts), "--profile", "cpu",
                             "--data-dir", str(tmp_path / "data")], env=env, cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "the engine died with SIGSEGV with safe settings" in errors[0], result.stderr
    assert "written" not in result.stdout


def test_a_process_the_child_leaves_behind_neither_hides_the_fault_nor_outlives_the_canary(
        make_settings: Callable[..., Settings]) -> None:
    settings = make_settings(engine__kind="tests.canary_fakes:segfaults_leaving_a_process", canary__timeout_s=120)
    settled, report = settle(settings)
    first, second = report.attempts
    assert (first.part, first.failure) == ("engine", "died with SIGSEGV")  # not "hung past 120 s"
    assert second.ok and settled.engine.threads == 1
    # The sleepers the two children started went with them. The canary ends each child's session with SIGKILL, and
    # a killed process can be listed for a moment before it is gone: wait for that, far less than the sleepers'
    # own 300 s, so one the canary left behind still fails here.
    deadline = time.monotonic() + 60
    while (leftover := sleepers_of(settings.data_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftover == []


def sleepers_of(marker: str) -> list[str]:
    """The processes running canary_fakes' sleeper for this test (its data dir is their last argument): another
    suite's on the same machine are not this test's to judge."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or gone meanwhile
            continue
        if SLEEPER.encode() in args and marker.encode() in args:
            found.append(proc.name)
    return found
