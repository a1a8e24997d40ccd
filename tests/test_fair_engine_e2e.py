"""A tenant whose long misses hold the engine cannot make another tenant's short request fail: the real `edgecache
serve` with two tenants on one plan with no caps, the real llama.cpp engine, the official openai client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.real_server import MODEL, Server

pytestmark = pytest.mark.e2e

TENANTS = """
[plans.basic]

[[tenants]]
id = "acme"
plan = "basic"
keys = ["sk-acme-0001"]

[[tenants]]
id = "beta"
plan = "basic"
keys = ["sk-beta-0001"]

[admin]
keys = ["sk-admin-0001"]
"""
QUEUE_TIMEOUT_S = 1


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("fair-engine")
    (root / "tenants.toml").write_text(TENANTS)
    srv = Server(root / "data", "--tenants", str(root / "tenants.toml"),
                 env={"EDGECACHE_SEMANTIC__ENABLED": "false",
                      "EDGECACHE_ADMISSION__QUEUE_TIMEOUT_S": str(QUEUE_TIMEOUT_S)}).start()
    yield srv
    srv.stop()


def gauge(server: Server, name: str) -> float:
    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer sk-admin-0001"}, timeout=10).text
    return float(next(line.split()[1] for line in metrics.splitlines() if line.startswith(name + " ")))


def wait_for(condition, what: str, patience_s: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + patience_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} never held"
        time.sleep(0.05)


def test_a_long_call_of_one_tenant_makes_another_wait_its_turn_not_fail(server: Server) -> None:
    acme = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-acme-0001", max_retries=0)
    beta = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-beta-0001", max_retries=0)
    essay = {"model": MODEL, "temperature": 0, "max_tokens": 3500, "extra_body": {"ignore_eos": True},
             "messages": [{"role": "user", "content": "Write a very long essay about the sea."}]}
    with ThreadPoolExecutor(2) as pool, acme.chat.completions.with_streaming_response.create(
            **essay, stream=True) as long_call:
        assert long_call.headers["x-edgecache"] == "miss"
        next(iter(long_call.parse()))  # acme's call is in the engine, writing 3,500 tokens
        assert gauge(server, "edgecache_admission_running") == 1  # llama.cpp runs one call: the gate runs one
        short = pool.submit(beta.chat.completions.with_raw_response.create, model=MODEL, max_tokens=4,
                            temperature=0, messages=[{"role": "user", "content": "Say hi."}])
        wait_for(lambda: gauge(server, "edgecache_admission_queue_depth") == 1, "beta's call waiting")
        # acme's next call waits behind acme's own: its queue timeout runs, and it gets the 429.
        with pytest.raises(openai.RateLimitError) as refused:
            acme.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                         messages=[{"role": "user", "content": "Say bye."}])
        assert "its own misses running" in refused.value.message
        time.sleep(2 * QUEUE_TIMEOUT_S)
        # Past its queue timeout twice over, beta's call still waits for its turn, with acme's call still running.
        assert not short.done()
        assert gauge(server, "edgecache_admission_running") == 1 and \
            gauge(server, "edgecache_admission_queue_depth") == 1
    # acme's client left: its call is aborted, and beta's runs.
    answer = short.result(timeout=300)
    assert answer.headers["x-edgecache"] == "miss"
    assert answer.parse().choices[0].message.content
    assert gauge(server, "edgecache_admission_running") == 0
