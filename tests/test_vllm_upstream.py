"""EdgeCache in front of a real vLLM: `edgecache serve --upstream` with a tenants file, and vLLM's CPU build serving
the shipped SmolLM2 (converted from its GGUF at test time) with prefix caching on. One vLLM server for the module.

vLLM is installed into the git-ignored ``.vllm-venv/`` the first time (``edgecache.bench.vllm``; .ci/run does it
before the tests); where it cannot be installed the module skips, saying why.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from edgecache.bench.vllm import MODEL, VLLMServer, VLLMUnavailable, prepare
from tests.conftest import front_server
from tests.real_server import LONG_SYSTEM, Server
from tests.test_tenants import ADMIN, auth, key_of, write_tenants_file

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    try:
        python, model_dir = prepare(ROOT / ".vllm-venv")
    except VLLMUnavailable as exc:
        pytest.skip(f"vLLM is not available here: {exc}")
    server = VLLMServer(python, model_dir, tmp_path_factory.mktemp("vllm") / "vllm.log").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def upstream(vllm: VLLMServer) -> VLLMServer:
    """The module's vLLM, started again on its port if a test killed it."""
    if not vllm.alive():
        vllm.stop()
        vllm.start()
    return vllm


@pytest.fixture(scope="module")
def front(vllm: VLLMServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("vllm-front")
    tenants = write_tenants_file(root / "tenants.toml")
    with front_server(root / "data", vllm.api, "--tenants", str(tenants)) as server:
        yield server


def stats(front: Server) -> dict[str, Any]:
    return httpx.get(front.url + "/stats", headers=ADMIN, timeout=30).json()


def sdk(front: Server, tenant: str = "t01") -> openai.OpenAI:
    return openai.OpenAI(base_url=front.url + "/v1", api_key=key_of(tenant), max_retries=0, timeout=300)


def ask(front: Server, tenant: str, question: str, **extra: Any) -> Any:
    """A chat request under the long system prompt, for ``tenant``: (x-edgecache, the parsed answer)."""
    raw = sdk(front, tenant).chat.completions.with_raw_response.create(
        model=MODEL, temperature=0, max_tokens=8, **extra,
        messages=[{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": question}])
    return raw.headers["x-edgecache"], raw.parse()


def cached(answer: Any) -> int:
    details = answer.usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


def test_cached_tokens_are_relayed_and_the_tenants_salts_kept_apart(upstream: VLLMServer, front: Server) -> None:
    served, first = ask(front, "t01", "Which series ship within three days?")
    assert served == "miss" and first.usage.prompt_tokens >= 1000  # a long shared prefix
    assert cached(first) == 0  # nothing under t01's salt yet
    served, second = ask(front, "t01", "What warranty do rockets of series 12 carry?")
    assert served == "miss"
    # vLLM's prefix cache served the system prompt, and the front relayed how much of it.
    assert cached(second) >= first.usage.prompt_tokens // 2
    # Another tenant, the same system prompt: its own salt, so none of t01's prefix is used for it.
    served, other = ask(front, "t02", "Which series ship within three days?")
    assert served == "miss" and other.usage.prompt_tokens == first.usage.prompt_tokens
    assert cached(other) == 0
    served, other_again = ask(front, "t02", "How long do rockets of series 5 take to ship?")
    assert served == "miss" and cached(other_again) > 0  # its own prefix, now cached under its own salt
    assert stats(front)["engine"]["cached_tokens"] >= cached(second) + cached(other_again)


def _stream_in_thread(url: str, body: dict[str, Any], tenant: str) -> tuple[threading.Thread, threading.Event,
                                                                           list[str]]:
    """A streamed chat request read in a thread: (the thread, set at its first event, its data lines)."""
    started, lines = threading.Event(), []

    def read() -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=auth(tenant),
                          timeout=300) as resp:
            lines.append(f"x-edgecache: {resp.headers.get('x-edgecache')}")
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    started.set()
        started.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, started, lines


# Long enough (ignore_eos) that a second request arrives while the first is still generating.
LONG = {"model": MODEL, "temperature": 0, "max_tokens": 200, "ignore_eos": True, "stream": True,
        "messages": [{"role": "user", "content": "Count from one to five hundred in words."}]}


def test_exact_and_shared_hits_never_reach_vllm(upstream: VLLMServer, front: Server) -> None:
    before = upstream.requests_served()
    served, answer = ask(front, "t03", "Is there a warranty on series 7?")
    assert served == "miss"
    assert upstream.requests_served() == before + 1
    served, again = ask(front, "t03", "Is there a warranty on series 7?")
    assert served == "exact" and again.choices[0].message.content == answer.choices[0].message.content
    assert upstream.requests_served() == before + 1

    # The same request twice at once: the second follows the first one's generation.
    thread, started, lines = _stream_in_thread(front.url, LONG, "t03")
    assert started.wait(300)
    follower = httpx.post(front.url + "/v1/chat/completions", json={**LONG, "stream": False}, headers=auth("t03"),
                          timeout=300)
    thread.join(timeout=300)
    assert follower.status_code == 200, follower.text
    # Shared while the first still generates (about 8 s here); a box fast enough to finish first makes it exact.
    # Either way vLLM is not asked again (the count below).
    assert lines[0] == "x-edgecache: miss" and follower.headers["x-edgecache"] in ("shared", "exact")
    streamed = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in lines[1:] if line != "data: [DONE]" and json.loads(line[6:])["choices"])
    assert follower.json()["choices"][0]["message"]["content"] == streamed
    assert upstream.requests_served() == before + 2


def test_streaming_on_chat_responses_and_messages(upstream: VLLMServer, front: Server) -> None:
    before = upstream.requests_served()
    c = sdk(front, "t04")
    chat = {"model": MODEL, "temperature": 0, "max_tokens": 24, "messages": [{"role": "user", "content": "Name two colours."}]}
    texts = []
    for served in ("miss", "exact"):
        with c.chat.completions.with_streaming_response.create(**chat, stream=True) as resp:
            assert resp.headers["x-edgecache"] == served
            pieces = [e.choices[0].delta.content or "" for e in resp.parse() if e.choices]
        assert len([p for p in pieces if p]) > 1 or served == "exact"
        texts.append("".join(pieces))
    assert texts[0] and texts[0] == texts[1]

    responses = {"model": MODEL, "input": "Name a fruit.", "temperature": 0, "max_output_tokens": 24}
    outputs = []
    for served in ("miss", "exact"):
        with c.responses.with_streaming_response.create(**responses, stream=True) as resp:
            assert resp.headers["x-edgecache"] == served
            events = list(resp.parse())
        kinds = [e.type for e in events]
        assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
        outputs.append("".join(e.delta for e in events if e.type == "response.output_text.delta"))
    assert outputs[0] and outputs[0] == outputs[1]

    messages = anthropic.Anthropic(base_url=front.url, api_key=key_of("t04"), max_retries=0, timeout=300)
    replies = []
    for served in ("miss", "exact"):
        with messages.messages.stream(model=MODEL, max_tokens=24, extra_body={"temperature": 0},
                                      messages=[{"role": "user", "content": "Name an animal."}]) as stream:
            assert stream.response.headers["x-edgecache"] == served
            replies.append("".join(stream.text_stream))
            final = stream.get_final_message()
        assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0
    assert replies[0] and replies[0] == replies[1]
    assert upstream.requests_served() == before + 3  # the repeats were exact hits


# A token id beyond SmolLM2's vocabulary (49,152): EdgeCache passes logit_bias through, vLLM refuses it.
REFUSED = {"max_tokens": 8, "logit_bias": {"999999": 5}}


@pytest.mark.parametrize("stream", [False, True])
def test_vllms_refusal_is_a_400_naming_the_field(upstream: VLLMServer, front: Server, stream: bool) -> None:
    body = {"model": MODEL, "temperature": 0, "stream": stream, **REFUSED,
            "messages": [{"role": "user", "content": f"Refuse me ({stream})."}]}
    for _ in range(2):  # and the refusal was not stored
        resp = httpx.post(front.url + "/v1/chat/completions", json=body, headers=auth("t05"), timeout=120)
        assert resp.status_code == 400, resp.text
        message = resp.json()["error"]["message"]
        assert "logit_bias" in message and upstream.api in message and "Traceback" not in message
        assert resp.headers.get("x-edgecache") != "exact"


def test_the_upstreams_prefix_cache_hit_ratio_in_stats_and_metrics(upstream: VLLMServer, front: Server) -> None:
    ask(front, "t06", "Which series carry a three-year warranty?")
    ask(front, "t06", "Which series ship within seven days?")  # a prefix-cache hit at vLLM
    deadline = time.monotonic() + 120  # the front reads vLLM's /metrics every few seconds
    while True:
        state = stats(front)["engine_state"]
        if state.get("upstream_prefix_cache_hits", 0) > 0:
            break
        assert time.monotonic() < deadline, f"the upstream's figures never reached /stats: {state}"
        time.sleep(0.2)
    assert state["upstream_metrics"] == "vllm"
    own = upstream.metrics()
    hits, queries = own["vllm:prefix_cache_hits_total"], own["vllm:prefix_cache_queries_total"]
    assert 0 < state["upstream_prefix_cache_hits"] <= hits
    assert state["upstream_prefix_cache_queries"] <= queries
    assert 0 < state["upstream_prefix_cache_hit_ratio"] < 1
    assert state["upstream_prefix_cache_hit_ratio"] == pytest.approx(
        state["upstream_prefix_cache_hits"] / state["upstream_prefix_cache_queries"])
    text = httpx.get(front.url + "/metrics", headers=ADMIN, timeout=30).text
    lines = [line for line in text.splitlines() if line.startswith("edgecache_upstream_prefix_cache_hit_ratio{")]
    assert len(lines) == 1 and 'server="vllm"' in lines[0] and 0 < float(lines[0].rsplit(" ", 1)[1]) < 1


def test_a_vllm_killed_mid_stream_fails_the_client_and_stores_nothing(upstream: VLLMServer, front: Server) -> None:
    body = {**LONG, "messages": [{"role": "user", "content": "Count from one to five hundred, in digits."}]}
    entries = stats(front)["store"]["entries"]
    events: list[dict[str, Any]] = []
    killed = False
    with httpx.stream("POST", front.url + "/v1/chat/completions", json=body, headers=auth("t07"),
                      timeout=300) as resp:
        assert resp.status_code == 200 and resp.headers["x-edgecache"] == "miss"
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if not killed and events[-1].get("choices") and events[-1]["choices"][0]["delta"].get("content"):
                upstream.kill()  # the server and its engine, mid-answer
                killed = True
    assert killed
    assert "error" in events[-1], events[-1]
    assert not any(choice.get("finish_reason") for e in events for choice in e.get("choices", ()))
    # Nothing was stored: the repeat is computed again, and fails while vLLM is down.
    again = httpx.post(front.url + "/v1/chat/completions", json={**body, "stream": False}, headers=auth("t07"),
                       timeout=120)
    assert again.status_code == 502 and again.headers.get("x-edgecache") != "exact"
    assert "upstream" in again.json()["error"]["message"]
    assert stats(front)["store"]["entries"] == entries
    # The front's read of vLLM's /metrics now fails: /stats says so, and /metrics drops the figure.
    deadline = time.monotonic() + 120
    while "unreachable" not in str(stats(front)["engine_state"].get("upstream_metrics")):
        assert time.monotonic() < deadline, stats(front)["engine_state"]
        time.sleep(0.2)
    assert "upstream_prefix_cache_hit_ratio" not in stats(front)["engine_state"]
    text = httpx.get(front.url + "/metrics", headers=ADMIN, timeout=30).text
    assert "edgecache_upstream_prefix_cache_hit_ratio{" not in text
