"""The start-up self-test: a child process runs one short generation and one embedding before the server says ready.

One process co-hosts native code from several projects (llama.cpp, onnxruntime, usearch, SGLang's CUDA kernels).
Any of them can fault on a CPU or driver nobody here tested (llama.cpp's AMX matmul does on Sapphire Rapids), and a
native fault ends the whole process: every tenant's connection is reset and no log line says why. So before
``serve`` binds its app (and before an offline ``warmup --data-dir``), :func:`settle` runs the same engine and
embedder, with the same settings, in a child (``python -m edgecache.canary``):

- the child prints ``start <part>`` and ``ok <part>`` around each part, so when it dies from a signal, exits non-zero
  or hangs past ``canary.timeout_s``, the parent knows which part (``engine`` or ``embedder``) it was in;
- the parent logs that with the CPU flags and the settings, and tries once more with :func:`safe_settings` (no extra
  buffer types, one thread);
- if that fails too, :class:`CanaryFailed` carries one line for the operator and the server never reports ready.

A part that cannot load for a Python-level reason (a missing wheel, a model hub that is not there) is not a crash:
an engine that cannot load fails the canary like a fault would; an embedder that cannot load is reported and
skipped, since the server then serves exact matches only and says so on ``/health``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Literal

import msgspec

from edgecache.cpu import cpu_flags, cpu_model, extra_buffer_types_on, llamacpp_flags
from edgecache.settings import Settings, settings_from_dict, settings_to_dict

log = logging.getLogger("edgecache")

Part = Literal["start-up", "engine", "embedder"]
PARTS: tuple[Part, ...] = ("engine", "embedder")


class Attempt(msgspec.Struct, frozen=True, kw_only=True):
    """One run of the child: with which settings, how it ended, and (when it failed) in which part and how."""

    settings: Literal["configured", "safe"]
    ok: bool
    seconds: float
    part: Part | None = None
    failure: str | None = None
    """"died with SIGSEGV", "exited with status 1: ...", "hung past 120 s"."""
    skipped: tuple[str, ...] = ()
    """Parts the child could not load for a Python-level reason (an embedder that is not installed)."""


class CanaryReport(msgspec.Struct, frozen=True, kw_only=True):
    """What the canary settled on: ``/health`` shows it under ``canary``."""

    settled: Literal["configured", "safe"]
    extra_buffer_types: bool | None
    """Whether llama.cpp may repack weights (None: not a llamacpp engine)."""
    engine_threads: int
    semantic_threads: int
    seconds: float
    attempts: tuple[Attempt, ...]


class CanaryFailed(Exception):
    """The child failed with the configured settings and with safe ones; the message is one line for the operator."""


def safe_settings(settings: Settings) -> Settings:
    """The settings least likely to fault: no extra buffer types (no weight repacking), one engine thread, one
    embedder thread."""
    return msgspec.structs.replace(
        settings,
        engine=msgspec.structs.replace(settings.engine, extra_buffer_types="off", threads=1),
        semantic=msgspec.structs.replace(settings.semantic, threads=1, bulk_threads=1))


def describe(settings: Settings) -> str:
    """The settings and the CPU a canary ran with, for a log line."""
    engine = settings.engine
    flags = cpu_flags()
    parts = [f"engine.kind={engine.kind}", f"engine.model={engine.model}", f"engine.threads={engine.threads}"]
    if engine.kind == "llamacpp":
        on = extra_buffer_types_on(engine.extra_buffer_types, flags)
        parts.append(f"engine.extra_buffer_types={engine.extra_buffer_types} ({'on' if on else 'off'})")
    if settings.semantic.enabled:
        parts += [f"semantic.embedder={settings.semantic.embedder}", f"semantic.threads={settings.semantic.threads}"]
    return f"{', '.join(parts)}; CPU {cpu_model()}, flags {' '.join(llamacpp_flags(flags)) or 'none known'}"


def run_child(settings: Settings, timeout_s: float, label: Literal["configured", "safe"]) -> Attempt:
    """One canary child with ``settings``, bounded by ``timeout_s``."""
    started = time.monotonic()
    payload = msgspec.json.encode(settings_to_dict(settings))
    # Files, not pipes: a process the child started (SGLang's scheduler) may outlive it holding a pipe open. The
    # child leads a session of its own, so it and everything it started go together at the end.
    with tempfile.TemporaryFile() as out_file, tempfile.TemporaryFile() as err_file:
        proc = subprocess.Popen([sys.executable, "-m", "edgecache.canary"], stdin=subprocess.PIPE,
                                stdout=out_file, stderr=err_file, start_new_session=True)
        assert proc.stdin is not None
        try:
            proc.stdin.write(payload)
            proc.stdin.close()
        except BrokenPipeError:  # it died before reading its settings; its exit status says how
            pass
        try:
            proc.wait(timeout=timeout_s)
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # nothing of it is left
                pass
            proc.wait()
        out_file.seek(0)
        err_file.seek(0)
        out, err = out_file.read(), err_file.read()
    seconds = time.monotonic() - started
    lines = out.decode("utf-8", "replace").splitlines()
    started_parts = [line.split(" ", 1)[1] for line in lines if line.startswith("start ")]
    done = {line.split(" ", 1)[1] for line in lines if line.startswith("ok ")}
    skipped = tuple(line.split(" ", 1)[1] for line in lines if line.startswith("skip "))
    if not hung and proc.returncode == 0:
        return Attempt(settings=label, ok=True, seconds=seconds, skipped=skipped)
    # the part it was in: the last one it started and did not finish ("start-up" when it got to none)
    part: Part = next((p for p in reversed(started_parts) if p not in done and p in PARTS),  # type: ignore[assignment]
                      "start-up")
    if hung:
        failure = f"hung past {timeout_s:g} s"
    elif proc.returncode < 0:
        try:
            failure = f"died with {signal.Signals(-proc.returncode).name}"
        except ValueError:
            failure = f"died with signal {-proc.returncode}"
    else:
        last = next((line for line in reversed(err.decode("utf-8", "replace").splitlines()) if line.strip()), "")
        failure = f"exited with status {proc.returncode}" + (f": {last.strip()}" if last else "")
    return Attempt(settings=label, ok=False, seconds=seconds, part=part, failure=failure, skipped=skipped)


def settle(settings: Settings) -> tuple[Settings, CanaryReport]:
    """Run the canary with ``settings``, then (when it fails) with :func:`safe_settings`. Returns the settings to
    serve with and the report; raises :class:`CanaryFailed` when both fail."""
    started = time.monotonic()
    timeout_s = settings.canary.timeout_s
    attempts = []
    chosen = settings
    for label, candidate in (("configured", settings), ("safe", safe_settings(settings))):
        attempt = run_child(candidate, timeout_s, label)  # type: ignore[arg-type]
        attempts.append(attempt)
        for part in attempt.skipped:
            log.warning("start-up self-test: %s", part)
        if attempt.ok:
            chosen = candidate
            break
        log.error("start-up self-test: the %s %s with the %s settings (%s)", attempt.part, attempt.failure, label,
                  describe(candidate))
        if label == "configured":
            log.warning("start-up self-test: retrying with safe settings (no extra buffer types, one thread)")
    else:
        first, second = attempts
        raise CanaryFailed(
            f"the start-up self-test failed: the {first.part} {first.failure} with the configured settings, and "
            f"the {second.part} {second.failure} with safe settings (no extra buffer types, one thread), on "
            f"{cpu_model()}; not serving. Run `edgecache doctor` and see the log lines above.")
    engine = chosen.engine
    report = CanaryReport(
        settled=attempts[-1].settings, seconds=round(time.monotonic() - started, 3), attempts=tuple(attempts),
        extra_buffer_types=(extra_buffer_types_on(engine.extra_buffer_types, cpu_flags())
                            if engine.kind == "llamacpp" else None),
        engine_threads=engine.threads, semantic_threads=chosen.semantic.threads)
    if report.settled == "safe":
        log.warning("start-up self-test: serving with safe settings (engine.extra_buffer_types=off, "
                    "engine.threads=1, semantic.threads=1); /health shows them under canary")
    return chosen, report


# ---- the child ------------------------------------------------------------------------------------------------


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def _generate_once(settings: Settings) -> None:
    from contextlib import aclosing

    from edgecache.engines import engine_from_settings
    from edgecache.engines.base import GenerationRequest, Message, SamplingParams

    engine = engine_from_settings(settings)
    await engine.start()
    try:
        request = GenerationRequest(messages=(Message(role="user", content="Say OK."),),
                                    params=SamplingParams(max_tokens=4, temperature=0.0, seed=0))
        async with aclosing(engine.generate(request)) as stream:
            async for _ in stream:
                pass
    finally:
        await engine.close()


def _child() -> int:
    settings = settings_from_dict(msgspec.json.decode(sys.stdin.buffer.read()))
    if settings.engine.kind == "openai":
        _say("skip engine: an upstream server runs the model, nothing native in this process")
    else:
        _say("start engine")
        asyncio.run(_generate_once(settings))
        _say("ok engine")
    if settings.semantic.enabled:
        from edgecache.embedders import EmbedderUnavailable, load_semantic_embedder

        _say("start embedder")
        try:
            embedder = load_semantic_embedder(settings)
        except EmbedderUnavailable as exc:
            _say(f"skip the embedder cannot load ({exc}); the server will serve exact matches only")
            return 0
        embedder.embed(["start-up self-test"])
        _say("ok embedder")
    return 0


if __name__ == "__main__":
    sys.exit(_child())
