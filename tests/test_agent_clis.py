"""The two agent CLIs, really run, against `edgecache serve` fronting an upstream double: Codex CLI (`codex exec`, the
Responses API) and Claude Code (`claude -p`, the Messages API).

Their requests are 40-50 KB (12k tokens: a long system prompt and 9-12 tools), more than the CPU model's context,
so the engine is an OpenAI-compatible double (tests/openai_double.py) that answers one fixed text. Each CLI runs the
same prompt twice: it must exit 0 and print the double's answer both times, and the second run must be an exact hit
that never reaches the upstream. Neither CLI sends a temperature (so each request samples, at the API's default of
1): the runs carry ``X-EdgeCache-Policy: reuse``, set in each CLI's own configuration (docs/clients.md, "Agent
clients").

The CLIs are npm packages, pinned in tests/agent_clis.json (`.ci/run` installs them into `.agent-clis/` when npm is
there); a test skips, saying so, when its CLI is neither on PATH nor in `.agent-clis/`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from edgecache.bench.harness import free_port
from tests.conftest import front_server
from tests.real_server import Server

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
#: Where .ci/run installs the pinned CLIs (git-ignored).
LOCAL_BIN = ROOT / ".agent-clis" / "node_modules" / ".bin"
#: The pinned packages, by the command each provides: data that .ci/run reads too, to install them.
NPM_PACKAGES: dict[str, str] = json.loads(Path(__file__).with_name("agent_clis.json").read_text())
ANSWER = "The answer is forty-two, said the upstream double."
MODEL = "double-model"
PROMPT = "Say hello, then stop."


def cli(name: str) -> str:
    """The CLI's path (the pinned one in .agent-clis/ first), or a skip that says how to install it."""
    found = shutil.which(name, path=str(LOCAL_BIN)) or shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed: `npm install --prefix .agent-clis {NPM_PACKAGES[name]}` (.ci/run "
                    f"does this when npm is on PATH)")
    return found


class Upstream:
    """tests/openai_double.py in a subprocess: its API root and the chat requests it received."""

    def __init__(self, root: Path) -> None:
        self.log = root / "upstream.jsonl"
        self.log.touch()
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/v1"
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("openai_double.py")),
                                      "--port", str(port), "--answer", ANSWER, "--log", str(self.log)])
        deadline = time.monotonic() + 60  # a bound on a hang, not a timing assertion
        while True:
            try:
                if httpx.get(self.url + "/models", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the upstream double did not start")
            time.sleep(0.1)

    def calls(self) -> int:
        return len(self.log.read_text().splitlines())

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Upstream]]:
    root = tmp_path_factory.mktemp("agent-clis")
    upstream = Upstream(root)
    try:
        with front_server(root / "data", upstream.url) as server:
            yield server, upstream
    finally:
        upstream.stop()


def run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """One CLI run with only the environment given (no caller's keys, no EDGECACHE_* overrides), stdin closed."""
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd), "LANG": "C.UTF-8", "TERM": "dumb"}
    return subprocess.run(command, cwd=cwd, env=base | env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=300)


def layers(server: Server) -> dict[str, int]:
    return dict(server.stats()["requests"])


def twice(server: Server, upstream: Upstream, command: list[str], cwd: Path, env: dict[str, str]) -> None:
    """Run the CLI twice: both exit 0 with the double's answer; the first reaches the upstream once, the second is
    an exact hit that does not reach it."""
    before, calls = layers(server), upstream.calls()
    first = run(command, cwd, env)
    assert first.returncode == 0 and ANSWER in first.stdout, (first.stdout[-2000:], first.stderr[-3000:])
    assert upstream.calls() == calls + 1
    middle = layers(server)
    assert (middle["miss"], middle["exact"]) == (before["miss"] + 1, before["exact"])
    second = run(command, cwd, env)
    assert second.returncode == 0 and ANSWER in second.stdout, (second.stdout[-2000:], second.stderr[-3000:])
    after = layers(server)
    assert upstream.calls() == calls + 1  # no upstream call
    assert (after["miss"], after["exact"]) == (middle["miss"], middle["exact"] + 1)
    assert after["error"] == before["error"] and after["rejected"] == before["rejected"]


def test_codex_exec_twice_the_second_is_an_exact_hit(front: tuple[Server, Upstream], tmp_path: Path) -> None:
    codex = cli("codex")
    server, upstream = front
    home = tmp_path / "codex-home"
    home.mkdir()
    # web_search off: Codex offers OpenAI's hosted search tool by default, which a model server cannot run (the
    # server refuses it, naming this setting). No update check, analytics or feedback uploads.
    (home / "config.toml").write_text(f"""\
model = "{MODEL}"
model_provider = "edgecache"
approval_policy = "never"
sandbox_mode = "read-only"
web_search = "disabled"
check_for_update_on_startup = false

[analytics]
enabled = false

[feedback]
enabled = false

[model_providers.edgecache]
name = "EdgeCache"
base_url = "{server.url}/v1"
wire_api = "responses"
env_key = "CODEX_EDGECACHE_KEY"
request_max_retries = 0
stream_max_retries = 0
http_headers = {{ "X-EdgeCache-Policy" = "reuse" }}
""")
    work = tmp_path / "work"
    work.mkdir()
    twice(server, upstream, [codex, "exec", "--skip-git-repo-check", PROMPT], work,
          {"CODEX_HOME": str(home), "CODEX_EDGECACHE_KEY": "unused"})


def test_claude_code_print_twice_the_second_is_an_exact_hit(front: tuple[Server, Upstream], tmp_path: Path) -> None:
    claude = cli("claude")
    server, upstream = front
    env = {"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "unused",
           "ANTHROPIC_CUSTOM_HEADERS": "X-EdgeCache-Policy: reuse",
           # The small model it uses for side tasks is the served one too.
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL, "CLAUDE_CONFIG_DIR": str(tmp_path / ".claude"),
           # No telemetry, error reports, update checks or other traffic beyond the API calls.
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
           "DISABLE_AUTOUPDATER": "1"}
    twice(server, upstream, [claude, "-p", PROMPT, "--model", MODEL], tmp_path, env)
