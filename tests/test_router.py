"""Two real `edgecache serve` nodes (llama.cpp and SmolLM2, one Redis, a tenants file) behind the real SGLang router
(``sglang-router``, its Rust binary), once with ``cache_aware`` and once with ``round_robin``: chat and completions,
streamed or not, a repeat served exactly, the tenant's key reaching the node, the router's worker discovery, and a
set of the API tests' requests answered through the router as a node answers them directly.

The router rewrites every body it forwards: it adds its own fields at their defaults (``no_stop_trim: false``,
``separate_reasoning: true``, ...) and renames chat's ``max_tokens`` ``max_completion_tokens``; the nodes accept
both (docs/clients.md, "SGLang's router"). It refuses some bodies itself, before any node sees them
(:data:`ROUTER_REFUSES`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from edgecache.bench.fleet_router import Router
from tests.real_server import MODEL, Server
from edgecache.bench.redis_servers import RedisServer
from tests.test_app import sse_events, sse_text
from tests.test_tenants import auth, write_tenants_file

pytest.importorskip("sglang_router", reason="sglang-router is not installed (the dev extra installs it; .ci/run does)")

pytestmark = pytest.mark.e2e

KEY = auth("t01")
POLICIES = ("cache_aware", "round_robin")


@pytest.fixture(scope="module")
def nodes(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    redis_server.fresh()
    root = tmp_path_factory.mktemp("router")
    tenants = write_tenants_file(root / "tenants.toml")
    started = [Server(root / f"node{i}" / "data", "--redis", redis_server.url, "--tenants", str(tenants),
                      env={"EDGECACHE_SEMANTIC__ENABLED": "false"}) for i in range(2)]
    try:
        for server in started:
            server.data_dir.parent.mkdir(parents=True, exist_ok=True)
            server.start()
        yield started
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module", params=POLICIES)
def router(request: pytest.FixtureRequest, nodes: list[Server]) -> Iterator[Router]:
    started = Router(nodes[0].data_dir.parent.parent, [n.url for n in nodes], request.param).start(MODEL)
    yield started
    started.stop()


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 8,
            **extra}


def completion(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 8, **extra}


def post(url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=KEY if headers is None else headers, timeout=300)


def exact_again(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    """The repeat of a request just answered, until its answer is in the shared store: the client has a miss's
    answer a moment before the node has stored it, and the repeat may land on the other node."""
    for _ in range(200):
        again = post(url, path, body)
        if again.headers.get("x-edgecache") == "exact":
            return again
    return again


def test_the_router_discovers_the_nodes_as_sglang_workers(router: Router) -> None:
    """It registered both under the model the nodes serve, read from their /server_info and /model_info."""
    models = httpx.get(router.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    log = router.log()
    assert "Failed to fetch metadata" not in log and "Failed to load tokenizer" not in log, log[-3000:]


@pytest.mark.parametrize("streamed", [False, True])
def test_chat_through_the_router_then_an_exact_hit(router: Router, streamed: bool) -> None:
    body = chat(f"Name a colour ({router.port}, {'streamed' if streamed else 'whole'}).", stream=streamed)
    first = post(router.url, "/v1/chat/completions", body)
    assert first.status_code == 200, first.text
    assert first.headers["x-edgecache"] in ("miss", "shared")  # the node's header, relayed
    if streamed:
        assert first.headers["content-type"].startswith("text/event-stream")
        text = sse_text(sse_events(first.text))
    else:
        text = first.json()["choices"][0]["message"]["content"]
    assert text
    again = exact_again(router.url, "/v1/chat/completions", {**body, "stream": False})
    assert again.headers["x-edgecache"] == "exact"
    assert again.json()["choices"][0]["message"]["content"] == text


@pytest.mark.parametrize("streamed", [False, True])
def test_completions_through_the_router_then_an_exact_hit(router: Router, streamed: bool) -> None:
    body = completion(f"The sky over port {router.port} is", stream=streamed)
    first = post(router.url, "/v1/completions", body)
    assert first.status_code == 200, first.text
    if streamed:
        text = "".join(e["choices"][0]["text"] for e in sse_events(first.text) if e["choices"])
    else:
        text = first.json()["choices"][0]["text"]
    again = exact_again(router.url, "/v1/completions", {**body, "stream": True})
    assert again.headers["x-edgecache"] == "exact"
    assert "".join(e["choices"][0]["text"] for e in sse_events(again.text) if e["choices"]) == text


def test_the_tenant_s_key_reaches_the_node(router: Router, nodes: list[Server]) -> None:
    """The router passes the client's Authorization header on to the node, which authenticates the tenant."""
    body = chat("Which tenant am I?")
    missing = post(router.url, "/v1/chat/completions", body, headers={})
    assert missing.status_code == 401 and missing.json() == post(nodes[0].url, "/v1/chat/completions", body,
                                                                  headers={}).json()
    wrong = post(router.url, "/v1/chat/completions", body, headers={"Authorization": "Bearer sk-nobody"})
    assert wrong.status_code == 401
    assert post(router.url, "/v1/chat/completions", body).status_code == 200


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/chat/completions", chat("x", no_stop_trim=True), "no_stop_trim"),
    ("/v1/chat/completions", chat("x", continue_final_message=True), "continue_final_message"),
    ("/v1/chat/completions", chat("x", regex="[a-z]+"), "regex"),
    ("/v1/chat/completions", chat("x", return_hidden_states=True), "return_hidden_states"),
    ("/v1/completions", completion("x", ebnf='root ::= "a"'), "ebnf"),
    ("/v1/completions", completion("x", lora_path="adapter"), "lora_path"),
])
def test_a_field_value_that_changes_the_answer_is_a_400_naming_it(router: Router, path: str, body: dict[str, Any],
                                                                  field: str) -> None:
    resp = post(router.url, path, body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == field


# Requests of the API tests (tests/test_request_surface.py, tests/test_app.py), each answered through the router as a
# node answers it directly: the same status, the same error field, the same shape of answer.
SAME_THROUGH_THE_ROUTER: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", chat("Say hi.")),
    ("/v1/chat/completions", chat("Say hi.", stream=True, stream_options={"include_usage": True})),
    ("/v1/chat/completions", chat("Two answers.", n=2, seed=1)),
    ("/v1/chat/completions", chat("With logprobs.", logprobs=True, top_logprobs=2)),
    ("/v1/chat/completions", chat("JSON please.", response_format={"type": "json_object"})),
    ("/v1/chat/completions", chat("Call f.", tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}],
        tool_choice={"type": "function", "function": {"name": "f"}})),
    ("/v1/chat/completions", chat("Sampling.", top_k=5, min_p=0.1, repetition_penalty=1.1, stop=["."])),
    ("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_tokens": 8, "temperature": 0}),
    ("/v1/chat/completions", chat("x", model="gpt-9")),
    ("/v1/chat/completions", chat("x", logit_bias={"42": 5})),
    ("/v1/chat/completions", chat("x", modalities=["text", "audio"])),
    ("/v1/chat/completions", chat("x", reasoning_effort="maximal")),
    ("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]}),
    ("/v1/completions", completion("Once upon a time")),
    ("/v1/completions", completion("Echo me", echo=True, logprobs=2)),
    ("/v1/completions", completion("hi", best_of=3)),
    ("/v1/completions", completion("hi", suffix="end")),
    ("/v1/completions", completion("hi", stop=[""])),
]

# Chat bodies the router refuses itself (its own 400, naming no field, before any node sees them), each with the
# node's answer to it: the router reads verbosity as an integer (OpenAI's is a word), takes token ids and n within
# its own bounds, top_logprobs only with logprobs, min_tokens only up to max_tokens, no empty stop string, and
# tool_choice "required" only with tools.
ROUTER_REFUSES: list[tuple[str, dict[str, Any], int]] = [
    ("/v1/chat/completions", chat("x", verbosity="low"), 200),
    ("/v1/chat/completions", chat("x", stop_token_ids=[-1]), 400),
    ("/v1/chat/completions", chat("x", n=99), 400),
    ("/v1/chat/completions", chat("x", top_logprobs=2), 400),
    ("/v1/chat/completions", chat("x", min_tokens=20, max_tokens=8), 400),
    ("/v1/chat/completions", chat("x", stop=[""]), 400),
    ("/v1/chat/completions", chat("x", tool_choice="required"), 400),
]


def shape(resp: httpx.Response) -> Any:
    """Status, and what an answer says without its generated text: an error's type and field, an answer's keys,
    its choices' keys and finish reasons, or a stream's event kinds."""
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = sse_events(resp.text)
        return resp.status_code, sorted({tuple(sorted(e)) for e in events}), \
            sorted({c.get("finish_reason") or "" for e in events for c in e["choices"]})
    body = resp.json()
    if "error" in body:
        return resp.status_code, body["error"]["type"], body["error"]["param"]
    return resp.status_code, sorted(body), [(sorted(c), c.get("finish_reason")) for c in body["choices"]], \
        sorted(body["usage"])


@pytest.mark.parametrize(("path", "body"), SAME_THROUGH_THE_ROUTER, ids=[
    f"{'chat' if 'chat' in p else 'text'}-{i}" for i, (p, _) in enumerate(SAME_THROUGH_THE_ROUTER)])
def test_the_api_tests_requests_are_answered_the_same_through_the_router(
        router: Router, nodes: list[Server], path: str, body: dict[str, Any]) -> None:
    direct = post(nodes[0].url, path, body)
    routed = post(router.url, path, body)
    assert shape(routed) == shape(direct), (routed.text[:400], direct.text[:400])


@pytest.mark.parametrize(("path", "body", "node_status"), ROUTER_REFUSES)
def test_what_the_router_refuses_itself(router: Router, nodes: list[Server], path: str, body: dict[str, Any],
                                        node_status: int) -> None:
    assert post(nodes[0].url, path, body).status_code == node_status
    routed = post(router.url, path, body)
    assert routed.status_code == 400 and "error" in routed.json(), routed.text
    assert routed.json()["error"].get("param") is None  # the router's own refusal names no field


def test_a_stream_through_the_router_is_relayed_event_by_event(router: Router) -> None:
    """The router forwards a miss's stream as the node writes it: several content events, then [DONE]."""
    body = chat(f"Count from 1 to 10 ({router.port}).", max_tokens=24, stream=True)
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, headers=KEY, timeout=300) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    contents = [json.loads(line[6:])["choices"][0]["delta"].get("content") for line in lines[:-1]
                if json.loads(line[6:])["choices"]]
    assert sum(1 for c in contents if c) > 1


def test_the_router_drops_a_chat_field_it_does_not_know(router: Router, nodes: list[Server]) -> None:
    """A chat body's field the router does not define never reaches the node: a typo that a node refuses directly
    (naming it) is answered through the router as if it were not there. (A completions body's unknown fields are
    passed on, and the node names them.)"""
    typo = chat("Typo.", max_token=3)
    direct = post(nodes[0].url, "/v1/chat/completions", typo)
    assert direct.status_code == 400 and direct.json()["error"]["param"] == "max_token"
    assert post(router.url, "/v1/chat/completions", typo).status_code == 200
    routed = post(router.url, "/v1/completions", completion("Typo.", max_token=3))
    assert routed.status_code == 400 and routed.json()["error"]["param"] == "max_token"
