"""What the start-up canary adds to start-up: seconds from `edgecache serve` to /health 200, canary on and off.

Alternating on and off over ``--rounds`` rounds (a busy moment of the box hits both alike), each on a fresh data dir,
the cpu profile as shipped (the real SmolLM2 engine and the use-multilingual embedder). Prints each setting's
median and the canary's own time as /health reports it.

    python scripts/bench_canary.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time

import httpx

from edgecache.bench.harness import free_port, start_server, stop_process


def start_seconds(canary: bool, data_dir: str) -> tuple[float, float | None]:
    port = free_port()
    started = time.monotonic()
    server = start_server(["--profile", "cpu", "--port", str(port), "--data-dir", data_dir],
                          env={"EDGECACHE_CANARY__ENABLED": "true" if canary else "false"}, clean_env=True,
                          log=subprocess.DEVNULL)
    try:
        while time.monotonic() - started < 600:
            if server.poll() is not None:
                raise SystemExit(f"the server exited with {server.returncode}")
            try:
                reply = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                if reply.status_code == 200:
                    report = reply.json().get("canary")
                    return time.monotonic() - started, report["seconds"] if report else None
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise SystemExit("the server did not become ready in 600 s")
    finally:
        stop_process(server, timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    figures: dict[bool, list[float]] = {True: [], False: []}
    canary_own: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.rounds):
            for canary in (True, False):
                seconds, own = start_seconds(canary, os.path.join(tmp, f"{n}-{canary}"))
                figures[canary].append(seconds)
                if own is not None:
                    canary_own.append(own)
    on, off = statistics.median(figures[True]), statistics.median(figures[False])
    print(f"start to /health 200, median of {args.rounds} alternating rounds: canary on {on:.1f} s, "
          f"off {off:.1f} s (+{on - off:.1f} s); the canary itself {statistics.median(canary_own):.1f} s")


if __name__ == "__main__":
    main()
