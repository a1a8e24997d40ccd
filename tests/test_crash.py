"""After a crash and a restart nothing is lost: a real server killed with SIGSEGV (a native fault) or SIGKILL while
it writes keeps every entry it acknowledged, holds only complete entries, and serves each of them again.

Writes come through ``POST /admin/warmup`` with answers (store transactions back to back, no engine call), from a
thread that keeps sending batches while the test kills the process after the third acknowledgement, so the next
batch is in flight when the signal lands. After the restart, sending every line again tells which ones the store
held (``skipped``), and each of those must replay as an exact hit with the very answer written.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.real_server import Server

pytestmark = pytest.mark.e2e

BATCH = 100
ENV = {"EDGECACHE_SEMANTIC__ENABLED": "false"}  # the exact store is what this test is about


def prompt(i: int) -> str:
    return f"Crash test question number {i}: what is {i} plus {i}?"


def answer(i: int) -> str:
    # long enough that a torn write would show, and self-checking: it names its own line at both ends
    return f"begin {i} | " + f"{i} plus {i} is {2 * i}. " * 40 + f"| end {i}"


def line(i: int) -> dict[str, object]:
    return {"line": i, "request": {"messages": [{"role": "user", "content": prompt(i)}], "max_tokens": 1,
                                   "answer": answer(i)}}


def ask(client: httpx.Client, i: int) -> tuple[str, str]:
    reply = client.post("/v1/chat/completions", json={
        "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": prompt(i)}], "max_tokens": 2048,
        "temperature": 0})  # more than the answer's tokens: served whole (a smaller limit is served its beginning)
    assert reply.status_code == 200, reply.text
    return reply.headers["x-edgecache"], reply.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("kill", [signal.SIGSEGV, signal.SIGKILL], ids=["SIGSEGV", "SIGKILL"])
def test_a_crash_during_writes_keeps_every_acknowledged_entry_and_only_complete_ones(
        tmp_path: Path, kill: signal.Signals) -> None:
    data = tmp_path / "data"
    first = Server(data, env=ENV).start()
    acknowledged: list[int] = []
    sent: list[int] = []
    batches_done = threading.Semaphore(0)
    stop = threading.Event()

    def write() -> None:
        n = 0
        while not stop.is_set():
            batch = list(range(n, n + BATCH))
            sent.extend(batch)
            try:
                reply = httpx.post(first.url + "/admin/warmup", json={"lines": [line(i) for i in batch]},
                                   timeout=120)
            except httpx.HTTPError:
                return  # the server died under this batch
            results = reply.json()["results"]
            acknowledged.extend(r["line"] for r in results if r["outcome"] == "written")
            n += BATCH
            batches_done.release()

    writer = threading.Thread(target=write)
    writer.start()
    try:
        for _ in range(3):
            assert batches_done.acquire(timeout=120), "the first batches were never acknowledged"
        time.sleep(random.uniform(0, 0.3))  # somewhere in the next batch's reading, checking or writing
        assert first.proc is not None
        os.kill(first.proc.pid, kill)
        assert first.proc.wait(timeout=60) == -kill
    finally:
        stop.set()
        writer.join(timeout=120)
        first.stop()
    assert len(acknowledged) >= 3 * BATCH
    assert len(sent) > len(acknowledged), "the kill landed after the writer stopped: nothing was in flight"

    second = Server(data, env=ENV).start()
    try:
        # Which lines does the restarted store hold? Sending them all again tells: a line already there is
        # "skipped", one that is not is "written" now. In batches as they were sent: on a busy box the writer may
        # have sent ten or more before the kill, and all of them in one body would pass the server's 1 MB limit.
        held: set[int] = set()
        for start in range(0, len(sent), BATCH):
            again = httpx.post(second.url + "/admin/warmup",
                               json={"lines": [line(i) for i in sent[start:start + BATCH]]}, timeout=300)
            assert again.status_code == 200, (again.status_code, again.text[:1000])
            held |= {r["line"] for r in again.json()["results"] if r["outcome"] == "skipped"}
        assert set(acknowledged) <= held  # every acknowledged entry survived
        # Every entry held before the restart replays whole: an exact hit with the very answer that was written.
        with httpx.Client(base_url=second.url, timeout=60) as c, ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda i: ask(c, i), sorted(held)))
        for i, (served, text) in zip(sorted(held), replies):
            assert (served, text) == ("exact", answer(i)), i
        health = httpx.get(second.url + "/health", timeout=10).json()
        assert health["components"]["results"]["status"] == "ready", health
    finally:
        second.stop()
