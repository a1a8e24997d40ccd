"""A real `edgecache serve --profile cpu` (llama.cpp and SmolLM2) in a subprocess, for the end-to-end tests: started
and awaited with the measurements' own harness (``edgecache.bench.harness``), so tests and benchmarks launch a
server one way."""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

import httpx

from edgecache.bench.harness import free_port, start_server, wait_ready

MODEL = "SmolLM2-135M-Instruct"
LONG_SYSTEM = "You are the support assistant of ACME Rockets. " + " ".join(
    f"Policy {i}: rockets of series {i} ship within {i % 7 + 1} days and carry a {i % 3 + 1}-year warranty."
    for i in range(60))


class Server:
    """`edgecache serve --profile cpu` on a free port; ``extra`` flags and ``env`` are added to a clean environment
    (no ``EDGECACHE_`` variable of the test process leaks in). Its output goes to a log beside the data dir."""

    def __init__(self, data_dir: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.extra = extra
        self.extra_env = env or {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Any = None
        self.log: IO[bytes] | None = None

    def start(self) -> Server:
        self.log = open(self.data_dir.parent / f"server-{self.port}.log", "ab")  # noqa: SIM115
        self.proc = start_server(["--profile", "cpu", "--port", str(self.port), "--data-dir", str(self.data_dir),
                                  *self.extra], env=self.extra_env, log=self.log, clean_env=True)
        try:
            wait_ready(self.url, self.proc, timeout=120, poll_s=0.1)
        except SystemExit as exc:  # the harness ends a measurement; a test fails instead
            raise RuntimeError(f"{exc}; see {self.log.name}") from None
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
        if self.log is not None:
            self.log.close()

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=10).json()
