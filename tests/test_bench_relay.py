"""The token-path benchmark's client (edgecache.bench.relay.drive): it counts every token a stream brought, checks
each stream ended well, and fails loudly on a stream that did not."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from edgecache.bench import relay
from edgecache.bench.harness import free_port, stop_process, wait_ready

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bare_port():
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "bench_hitpath.py"), "--relay-server", "bare",
                             str(port)], cwd=ROOT)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, path="/v1/chat/completions", ready=(200, 405), timeout=120,
                   poll_s=0.1)
        yield port
    finally:
        stop_process(proc, timeout=60)


@pytest.mark.parametrize("read_every_s", [0.0, 0.005], ids=["as bytes come", "every 5 ms"])
def test_the_client_counts_the_tokens_of_every_stream_and_keeps_one_whole(bare_port, read_every_s):
    tally = relay.run_drive(bare_port, 2, 0.5, 16, read_every_s)
    assert tally.streams >= 2
    # every complete stream's 16 tokens, and those of the two cut off at the end
    assert 16 * tally.streams <= tally.tokens < 16 * (tally.streams + 2)
    assert relay.sample_text(tally.sample) == relay.TokenEngine.token * 16
    assert tally.tokens_per_s == tally.tokens / 0.5


def _serve_once(answer: bytes, *, hang_up: bool = False) -> tuple[int, threading.Thread]:
    """A server that answers one request with ``answer`` on a thread of its own (so the client's loop stays free),
    then waits for the client to close, or with ``hang_up`` closes first."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(answer)
            if not hang_up:
                conn.recv(65536)  # until the client closes
        listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener.getsockname()[1], thread


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 500 Internal Server Error\r\ntransfer-encoding: chunked\r\n\r\n5\r\noops!\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n10\r\ndata: {\"a\": 1}\n\n\r\n0\r\n\r\n",  # no [DONE]
], ids=["an error status", "a stream cut short"])
def test_a_stream_that_did_not_end_well_fails_the_run(answer):
    port, thread = _serve_once(answer)
    with pytest.raises(RuntimeError, match="a stream failed"):
        relay.run_drive(port, 1, 5, 16)
    thread.join(timeout=10)


def test_a_server_that_hangs_up_fails_the_run():
    port, thread = _serve_once(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", hang_up=True)
    with pytest.raises(RuntimeError, match="closed the stream"):
        relay.run_drive(port, 1, 5, 16)
    thread.join(timeout=10)
