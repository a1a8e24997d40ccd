"""The `edgecache` command against a real server process: stats, flush, warmup, and serve's refusals."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from edgecache.cli.main import app
from tests.real_server import MODEL, Server

pytestmark = pytest.mark.e2e
runner = CliRunner()

STATS_FIELDS = {"requests", "hit_rate", "by_tenant", "engine", "semantic", "ttft", "stores", "store", "admission",
                "engine_state", "inflight", "model", "profile"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("cli") / "data").start()
    yield srv
    srv.stop()


def ask(server: Server, text: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": text}]})


def test_stats_json_has_the_documented_fields(server: Server) -> None:
    ask(server, "hello there")
    ask(server, "hello there")
    result = runner.invoke(app, ["stats", "--url", server.url, "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert STATS_FIELDS <= set(body)
    assert body["requests"]["exact"] >= 1 and body["requests"]["miss"] >= 1
    assert body["ttft"]["exact"]["p50_s"] > 0 and body["ttft"]["miss"]["p99_s"] >= body["ttft"]["miss"]["p50_s"]
    assert body["stores"]["default"]["entries"] >= 1
    table = runner.invoke(app, ["stats", "--url", server.url])
    assert table.exit_code == 0 and "hit rate" in table.output and "TTFT" in table.output


def test_stats_of_an_unreachable_server_is_a_clean_error() -> None:
    result = runner.invoke(app, ["stats", "--url", "http://127.0.0.1:9"])
    assert result.exit_code == 1 and "cannot reach" in result.output
    assert "Traceback" not in result.output


def test_warmup_then_flush(server: Server, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "What is EdgeCache?"}],
                                   "max_tokens": 4, "answer": "An inference cache."}) + "\n{broken\n")
    result = runner.invoke(app, ["warmup", str(prompts), "--url", server.url])
    assert result.exit_code == 0, result.output
    assert "1 written, 0 skipped, 1 failed" in result.output and "line 2" in result.output
    hit = ask(server, "What is EdgeCache?")
    assert hit.headers["x-edgecache"] == "exact"
    assert hit.json()["choices"][0]["message"]["content"] == "An inference cache."
    assert runner.invoke(app, ["flush", "--url", server.url]).exit_code == 2
    flushed = runner.invoke(app, ["flush", "--url", server.url, "--all"])
    assert flushed.exit_code == 0, flushed.output
    assert ask(server, "What is EdgeCache?").headers["x-edgecache"] == "miss"


def test_serve_refuses_a_public_address_without_tenants(tmp_path: Path) -> None:
    result = runner.invoke(app, ["serve", "--profile", "cpu", "--host", "0.0.0.0", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--tenants" in result.output
    missing = runner.invoke(app, ["serve", "--profile", "cpu", "--tenants", str(tmp_path / "none.toml"),
                                  "--data-dir", str(tmp_path)])
    assert missing.exit_code == 2 and "not found" in missing.output


def test_the_client_verbs_read_edgecache_url(server: Server) -> None:
    env = {"EDGECACHE_URL": server.url, "EDGECACHE_ADMIN_KEY": "unused-without-a-tenants-file"}
    stats = runner.invoke(app, ["stats", "--json"], env=env)
    assert stats.exit_code == 0, stats.output
    assert "requests" in json.loads(stats.output)
    flushed = runner.invoke(app, ["flush", "--all"], env=env)
    assert flushed.exit_code == 0, flushed.output
    # The client's variables are not settings: a server started from the same shell is not refused over them.
    from edgecache.settings import resolve_settings
    assert resolve_settings("cpu", {}, environ=env).profile == "cpu"


def test_stats_watch_prints_when_not_on_a_terminal(server: Server) -> None:
    import subprocess
    import sys

    watch = subprocess.Popen([sys.executable, "-m", "edgecache.cli.main", "stats", "--watch", "--interval", "0.2"],
                             env={**__import__("os").environ, "EDGECACHE_URL": server.url},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        snapshots = 0
        assert watch.stdout is not None
        for line in watch.stdout:
            snapshots += line.startswith("--- ")
            if snapshots == 3:
                break
        assert snapshots == 3
    finally:
        watch.terminate()
        watch.wait(timeout=30)
