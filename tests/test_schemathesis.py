"""Property-based fuzzing of every route with schemathesis, against the server's own ``/openapi.json``, on a real
socket: valid and invalid requests alike must never get a 5xx or a traceback.

Budget: a bounded number of examples per operation and mode (``EXAMPLES``), so the test costs about the same on
every run. If a server has no ``/openapi.json`` (an older build), the schema is generated from the request structs
instead, so the test keeps running.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

import schemathesis
from schemathesis.generation import GenerationMode

from edgecache.http.app import create_app
from edgecache.http.server import uvicorn_config
from edgecache.http.openai_api import ChatCompletionRequest, CompletionRequest
from edgecache.settings import resolve_settings
from tests.fakes import FakeEngine

EXAMPLES = 40  # per operation and generation mode


def schema_from_structs() -> dict[str, Any]:
    """A minimal OpenAPI document for the two generation routes, from the msgspec request structs."""
    (chat, completion), components = msgspec.json.schema_components(
        [ChatCompletionRequest, CompletionRequest], ref_template="#/components/schemas/{name}")

    def post(body: dict[str, Any]) -> dict[str, Any]:
        return {"post": {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                         "responses": {"200": {"description": "the answer"}}}}

    return {"openapi": "3.1.0", "info": {"title": "EdgeCache", "version": "0"},
            "paths": {"/v1/chat/completions": post(chat), "/v1/completions": post(completion)},
            "components": {"schemas": components}}


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The app with a fake engine and the real semantic layer, behind the real server config, in a thread."""
    data = tmp_path_factory.mktemp("fuzz")
    app_settings = resolve_settings("cpu", {"data_dir": str(data), "semantic.enabled": True}, environ={})
    app = create_app(app_settings, engine=FakeEngine())
    server = uvicorn.Server(uvicorn_config(app, app_settings, port=0, log_level="warning", loop="asyncio"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    for _ in range(3000):
        if server.started:
            break
        thread.join(0.01)
    assert server.started
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    for _ in range(3000):
        if httpx.get(url + "/health").status_code == 200:
            break
        thread.join(0.01)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


def load_schema(url: str) -> Any:
    resp = httpx.get(url + "/openapi.json")
    document = resp.json() if resp.status_code == 200 else schema_from_structs()
    return schemathesis.openapi.from_dict(document)


def operations(url: str) -> list[Any]:
    return [result.ok() for result in load_schema(url).get_all_operations()]


def test_the_fallback_schema_is_usable() -> None:
    schema = schemathesis.openapi.from_dict(schema_from_structs())
    assert len([r.ok() for r in schema.get_all_operations()]) == 2


def test_every_api_is_fuzzed(server_url: str) -> None:
    paths = {operation.path for operation in operations(server_url)}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens"} <= paths


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_request_gets_a_5xx(server_url: str, mode: GenerationMode) -> None:
    ops = operations(server_url)
    assert len(ops) >= 2
    seen: dict[int, int] = {}
    with httpx.Client(base_url=server_url, timeout=60) as client:
        for operation in ops:
            # Half the generated bodies name the served model, so the fuzz reaches past the model check.
            cases = st.tuples(operation.as_strategy(generation_mode=mode), st.booleans())

            @settings(max_examples=EXAMPLES, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(cases)
            def check(generated: tuple[Any, bool]) -> None:
                case, served_model = generated
                body = case.body
                if served_model and isinstance(body, dict) and "model" in body:
                    body = {**body, "model": "fake-model"}
                kwargs: dict[str, Any] = {}
                if isinstance(body, (dict, list, str, int, float, bool)) or body is None:
                    if case.media_type and body is not None:
                        kwargs["json"] = body
                resp = client.request(case.method, case.formatted_path, params=case.query,
                                      headers={k: str(v) for k, v in (case.headers or {}).items()}, **kwargs)
                seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
                assert resp.status_code < 500, (case.method, case.formatted_path, body, resp.text[:500])
                assert "Traceback" not in resp.text

            try:
                check()
            except Unsatisfiable:
                # An operation with nothing to get wrong (a GET without parameters) has no negative cases.
                assert mode is GenerationMode.NEGATIVE
    assert sum(seen.values()) >= len(ops)
    assert any(400 <= status < 500 for status in seen)


def test_the_responses_routes_are_fuzzed_on_a_stored_response(server_url: str) -> None:
    """The generic run above covers /v1/responses; its id routes get random ids there (404s), so here they are
    fuzzed on a response that exists: every generated query is answered below 500, and a valid one with 200."""
    ops = [op for op in operations(server_url) if op.path.startswith("/v1/responses/")]
    assert sorted((op.method.upper(), op.path) for op in ops) == [
        ("DELETE", "/v1/responses/{response_id}"), ("GET", "/v1/responses/{response_id}"),
        ("GET", "/v1/responses/{response_id}/input_items")]
    made = httpx.post(server_url + "/v1/responses", json={"model": "fake-model", "input": "Fuzz me.",
                                                           "temperature": 0}, timeout=60).json()["id"]
    statuses: dict[tuple[str, str], set[int]] = {}
    with httpx.Client(base_url=server_url, timeout=60) as client:
        for operation in sorted(ops, key=lambda op: op.method.upper() == "DELETE"):  # the delete last
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                @settings(max_examples=EXAMPLES // 2, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
                @given(operation.as_strategy(generation_mode=mode))
                def check(case: Any) -> None:
                    path = operation.path.replace("{response_id}", made)
                    resp = client.request(case.method, path, params=case.query)
                    statuses.setdefault((case.method.upper(), operation.path), set()).add(resp.status_code)
                    assert resp.status_code < 500, (case.method, path, case.query, resp.text[:500])
                    assert "Traceback" not in resp.text
                    if mode is GenerationMode.POSITIVE and case.method.upper() == "GET":
                        assert resp.status_code == 200, (path, case.query, resp.text[:500])

                try:
                    check()
                except Unsatisfiable:
                    assert mode is GenerationMode.NEGATIVE
    assert 200 in statuses[("GET", "/v1/responses/{response_id}/input_items")]
    assert 200 in statuses[("DELETE", "/v1/responses/{response_id}")]


# --- the schema and the server agree -------------------------------------------------------------------------------
# Requests an earlier `schemathesis run /openapi.json --checks all` found the schema allowing and the server refusing
# (400), and their schema-invalid neighbours: each must be valid to both, or invalid to both.

CHAT_BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "agree"}], "temperature": 0}
MESSAGES_BODY: dict[str, Any] = {"model": "fake-model", "messages": [{"role": "user", "content": "agree"}],
                                 "max_tokens": 8, "temperature": 0}
RESPONSES_BODY = {"model": "fake-model", "temperature": 0}
AGREED: list[tuple[str, dict[str, Any], bool]] = [
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "max_tokens": 4.0, "temperature": 0}, True),
    ("/v1/completions", {"model": "fake-model", "prompt": ""}, False),
    ("/v1/completions", {"model": "fake-model", "prompt": [""]}, False),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "max_tokens": 4.5}, False),
    ("/v1/chat/completions", {**CHAT_BODY, "n": 1.0, "function_call": None, "functions": None}, True),
    ("/v1/chat/completions", {**CHAT_BODY, "function_call": "auto"}, False),
    ("/v1/chat/completions", {**CHAT_BODY, "functions": [{"name": "f"}]}, False),
    ("/v1/chat/completions", {**CHAT_BODY, "audio": {"voice": "alloy"}}, False),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "user"}]}, False),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "user", "content": None}]}, False),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "tool", "content": "42"}]}, False),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "tool", "content": "42", "tool_call_id": ""}]},
     False),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": [
        {"role": "user", "content": "hi", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, False),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "user", "content": "hi", "reasoning": "r"}]}, False),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}]}]},
     False),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, False),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": None}]}, False),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "custom", "custom": {"name": "f", "input": "x"}}]}]}, False),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": [
        {"role": "system", "content": [{"type": "text", "text": "be terse"}]},
        {"role": "user", "content": "2+2?", "tool_calls": []},
        {"role": "assistant", "content": None, "reasoning_content": "adding", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "4"},
        {"role": "assistant", "refusal": "no"},
        {"role": "user", "content": "thanks"}]}, True),
    ("/admin/flush", {"all": True}, True),
    ("/admin/flush", {"scenario": "default", "tenant": None}, True),
    ("/admin/flush", {}, False),
    ("/admin/flush", {"all": False}, False),
    ("/admin/flush", {"tenant": None}, False),
    ("/admin/warmup", {"lines": [{"line": 1, "request": {"prompt": "warm", "answer": "hot", "max_tokens": 8.0}}]},
     True),
    ("/admin/warmup", {"lines": [{"line": 1, "request": {"messages": [{"role": "user", "content": "hi"}],
                                                          "prompt": None, "answer": "hello"}}]}, True),
    ("/admin/warmup", {"lines": [{"line": 1, "request": {"scenario": "default"}}]}, False),
    ("/admin/warmup", {"lines": [{"line": 1, "request": {"prompt": "a", "messages": [
        {"role": "user", "content": "b"}]}}]}, False),
    ("/admin/warmup", {"lines": [{"line": 1, "request": {"messages": None, "prompt": None}}]}, False),
    ("/admin/warmup", {"lines": [{"line": 1, "request": {"messages": [{"role": "assistant"}], "scenario": "nope"}}]},
     False),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "best_of": 1, "temperature": 0}, True),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "n": 1, "best_of": 1.0, "temperature": 0}, True),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "best_of": 7}, False),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "n": 2, "best_of": 3}, False),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "logit_bias": {"²": 1}}, False),
    ("/v1/chat/completions", {**CHAT_BODY, "modalities": ["text"]}, True),
    ("/v1/chat/completions", {**CHAT_BODY, "modalities": ["audio"]}, False),
    ("/v1/chat/completions", {**CHAT_BODY, "modalities": ["text", "audio"]}, False),
    ("/v1/chat/completions", {**CHAT_BODY, "top_logprobs": 2}, False),
    ("/v1/messages", {**MESSAGES_BODY, "max_tokens": 1}, True),
    ("/v1/messages", {**MESSAGES_BODY, "max_tokens": 0}, False),
    ("/v1/messages", {**MESSAGES_BODY, "mcp_servers": []}, True),
    ("/v1/messages", {**MESSAGES_BODY, "mcp_servers": [{}]}, False),
    ("/v1/messages", {**MESSAGES_BODY, "container": "c"}, False),
    ("/v1/messages/count_tokens", {"model": "fake-model", "messages": MESSAGES_BODY["messages"], "mcp_servers": None},
     True),
    ("/v1/messages/count_tokens", {"model": "fake-model", "messages": MESSAGES_BODY["messages"], "mcp_servers": [{}]},
     False),
    ("/v1/responses", {**RESPONSES_BODY, "input": ""}, True),
    ("/v1/responses", {**RESPONSES_BODY, "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 4.0},
     True),
    ("/v1/responses", {**RESPONSES_BODY, "input": None}, False),
    ("/v1/responses", {**RESPONSES_BODY, "input": []}, False),
    ("/v1/responses", {**RESPONSES_BODY, "input": [{"type": "reasoning", "summary": []}]}, False),
]


def body_validator(document: dict[str, Any], path: str) -> Any:
    """The JSON Schema validator schemathesis itself uses (jsonschema-rs), for one route's request body."""
    import jsonschema_rs

    schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema_rs.Draft202012Validator({**schema, "components": document["components"]})


@pytest.mark.parametrize(("path", "body", "valid"), AGREED)
def test_the_schema_and_the_server_agree(server_url: str, path: str, body: dict[str, Any], valid: bool) -> None:
    document = httpx.get(server_url + "/openapi.json").json()
    errors = list(body_validator(document, path).iter_errors(body))
    assert (not errors) == valid, [e.message for e in errors]
    resp = httpx.post(server_url + path, json=body, timeout=60)
    assert (resp.status_code == 200) == valid, resp.text
    if not valid:
        assert resp.status_code == 400, resp.text


def test_an_integral_float_is_an_integer_for_embeddings_too(server_url: str) -> None:
    """``dimensions: 2348117.0`` is an integer to JSON Schema: it is refused for its size (this embedder cannot
    change its width), never for its type; the width itself, written as a float, is taken."""
    document = httpx.get(server_url + "/openapi.json").json()
    embedder = next(m["id"] for m in httpx.get(server_url + "/v1/models").json()["data"] if m["id"] != "fake-model")
    width = len(httpx.post(server_url + "/v1/embeddings", json={"model": embedder, "input": "x"},
                           timeout=60).json()["data"][0]["embedding"])
    same = {"model": embedder, "input": "x", "dimensions": float(width)}
    assert not list(body_validator(document, "/v1/embeddings").iter_errors(same))
    assert httpx.post(server_url + "/v1/embeddings", json=same, timeout=60).status_code == 200
    huge = httpx.post(server_url + "/v1/embeddings", json={**same, "dimensions": 2348117.0}, timeout=60)
    assert huge.status_code == 400 and f"dimensions must be {width}" in huge.json()["error"]["message"]


def test_options_allows_what_the_document_lists(server_url: str) -> None:
    """``OPTIONS`` on each path names in ``Allow`` exactly the methods the document lists there (and OPTIONS)."""
    document = httpx.get(server_url + "/openapi.json").json()
    for path, methods in document["paths"].items():
        resp = httpx.options(server_url + re.sub(r"\{[^}]+\}", "some-id", path))
        allowed = {m.strip() for m in resp.headers["allow"].split(",")}
        assert allowed == {m.upper() for m in methods} | {"OPTIONS"}, (path, resp.headers["allow"])


# --- schemathesis's own run, every check ---------------------------------------------------------------------------
# `st run /openapi.json --checks all` against this server: a schema-valid request must be accepted, a schema-invalid
# one refused, each status and header documented. A fixed seed and a bounded number of examples make the run the
# same on every call. tests/schemathesis_hooks.py leaves out the bodies that break the one rule JSON Schema cannot
# state (tool names).
ST_SEED = 1
ST_EXAMPLES = 20
#: Routes whose documents still allow requests the handlers refuse for a reason JSON Schema does not state (a
#: value bounded by a setting, such as edgecache.ttl and min_tokens against the default max_tokens; where an
#: Anthropic content block may appear); the cases they were fixed for are in AGREED.
ST_NOT_YET = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens")


def test_schemathesis_finds_no_disagreement(server_url: str, tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "schemathesis.cli", "run", server_url + "/openapi.json", "--checks", "all",
               "--seed", str(ST_SEED), "--max-examples", str(ST_EXAMPLES), "--workers", "1",
               "--generation-database", "none", "--no-color",
               *(arg for path in ST_NOT_YET for arg in ("--exclude-path", path))]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "Tested: " in run.stdout
