"""The request key: equal for equal requests, different whenever anything output-affecting differs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from edgecache.engines.base import GenerationRequest, Message, SamplingParams, ToolSpec
from edgecache.keys import is_cacheable, prefix_stable, request_key

BASE_MESSAGES = (Message("system", "You are terse."), Message("user", "What is the capital of France?"))
BASE_PARAMS = SamplingParams(max_tokens=32, temperature=0.0, top_p=1.0, stop=(), seed=None,
                             presence_penalty=0.0, frequency_penalty=0.0)
NAMESPACE = {"model_version": "model@1", "tenant": "acme", "scenario": "support"}


def key(request: GenerationRequest, **namespace: str) -> str:
    return request_key(request, **{**NAMESPACE, **namespace})


def chat(messages: tuple[Message, ...] = BASE_MESSAGES, **params: Any) -> GenerationRequest:
    return GenerationRequest(messages=messages, params=msgspec.structs.replace(BASE_PARAMS, **params))


def test_the_key_is_32_hex_digits() -> None:
    k = key(chat())
    assert len(k) == 32
    int(k, 16)


def test_equal_requests_get_equal_keys() -> None:
    # Built separately (new objects, not the same instance).
    a = GenerationRequest(messages=(Message("system", "You are terse."),
                                    Message("user", "What is the capital of France?")),
                          params=SamplingParams(max_tokens=32, temperature=0.0))
    b = chat()
    assert a is not b
    assert key(a) == key(b)


def test_the_salt_changes_the_key() -> None:
    # The salt is the tenant, plus a caller's own cache_salt: a caller who salts asks for a namespace of its own.
    assert key(msgspec.structs.replace(chat(), salt="acme:session-1")) != key(chat())


@pytest.mark.parametrize("change", [
    pytest.param({"max_tokens": 33}, id="max_tokens"),
    pytest.param({"temperature": 0.5}, id="temperature"),
    pytest.param({"top_p": 0.9}, id="top_p"),
    pytest.param({"stop": ("\n",)}, id="stop"),
    pytest.param({"seed": 1}, id="seed"),
    pytest.param({"seed": 0}, id="seed-zero-vs-none"),
    pytest.param({"presence_penalty": 0.5}, id="presence_penalty"),
    pytest.param({"frequency_penalty": 0.5}, id="frequency_penalty"),
])
def test_every_sampling_parameter_changes_the_key(change: dict[str, Any]) -> None:
    assert key(chat(**change)) != key(chat())


def test_seeds_differ_from_each_other() -> None:
    assert key(chat(seed=1)) != key(chat(seed=2))


def test_stop_order_and_content_matter() -> None:
    assert key(chat(stop=("a", "b"))) != key(chat(stop=("b", "a")))
    assert key(chat(stop=("a", "b"))) != key(chat(stop=("ab",)))


@pytest.mark.parametrize("namespace", [
    pytest.param({"model_version": "model@2"}, id="model_version"),
    pytest.param({"tenant": "globex"}, id="tenant"),
    pytest.param({"scenario": "code"}, id="scenario"),
])
def test_every_namespace_field_changes_the_key(namespace: dict[str, str]) -> None:
    assert key(chat(), **namespace) != key(chat())


def test_message_content_changes_the_key() -> None:
    other = (BASE_MESSAGES[0], Message("user", "What is the capital of Spain?"))
    assert key(chat(other)) != key(chat())


def test_the_system_prompt_changes_the_key() -> None:
    other = (Message("system", "You are verbose."), BASE_MESSAGES[1])
    assert key(chat(other)) != key(chat())
    no_system = (BASE_MESSAGES[1],)
    assert key(chat(no_system)) != key(chat())


def test_roles_change_the_key() -> None:
    as_user = (Message("user", "You are terse."), BASE_MESSAGES[1])
    assert key(chat(as_user)) != key(chat())


def test_message_order_changes_the_key() -> None:
    a = (Message("user", "one"), Message("assistant", "two"), Message("user", "three"))
    b = (Message("user", "three"), Message("assistant", "two"), Message("user", "one"))
    assert key(chat(a)) != key(chat(b))


def test_chat_and_prompt_get_different_keys_for_the_same_text() -> None:
    text = "What is the capital of France?"
    as_chat = GenerationRequest(messages=(Message("user", text),), params=BASE_PARAMS)
    as_prompt = GenerationRequest(prompt=text, params=BASE_PARAMS)
    assert key(as_chat) != key(as_prompt)
    assert key(as_prompt) == key(GenerationRequest(prompt=text, params=BASE_PARAMS))
    assert key(as_prompt) != key(GenerationRequest(prompt=text + " ", params=BASE_PARAMS))


@pytest.mark.parametrize("a, b", [
    pytest.param([("user", "ab")], [("user", "a"), ("user", "b")], id="split-content"),
    pytest.param([("user", "a"), ("user", "bc")], [("user", "ab"), ("user", "c")], id="moved-boundary"),
    pytest.param([("user", 'a", "user", "b')], [("user", "a"), ("user", "b")], id="json-lookalike"),
    pytest.param([("user", "")], [], id="empty-message-vs-none"),
    pytest.param([("user", "a\nuser: b")], [("user", "a"), ("user", "b")], id="template-lookalike"),
])
def test_no_collision_across_message_boundaries(a: list[tuple[str, str]], b: list[tuple[str, str]]) -> None:
    ma = tuple(Message(r, c) for r, c in a)  # type: ignore[arg-type]
    mb = tuple(Message(r, c) for r, c in b)  # type: ignore[arg-type]
    assert key(chat(ma)) != key(chat(mb))


def test_no_collision_across_namespace_boundaries() -> None:
    request = chat()
    assert key(request, tenant="ab", scenario="c") != key(request, tenant="a", scenario="bc")
    assert key(request, model_version="m", tenant="xy") != key(request, model_version="mx", tenant="y")


def test_the_key_is_stable_across_processes(tmp_path: Path) -> None:
    # Same inputs in a fresh interpreter with a different hash seed: a key that leaned on hash() or on dict/set
    # order would change here and lose every stored answer on restart.
    script = tmp_path / "key.py"
    script.write_text(
        "from edgecache.engines.base import GenerationRequest, Message, SamplingParams\n"
        "from edgecache.keys import request_key\n"
        "r = GenerationRequest(messages=(Message('system', 'You are terse.'),"
        " Message('user', 'What is the capital of France?')),"
        " params=SamplingParams(max_tokens=32, temperature=0.0, stop=('x', 'y'), seed=3))\n"
        "print(request_key(r, model_version='model@1', tenant='acme', scenario='support'))\n")
    root = Path(__file__).resolve().parents[1]
    # PYTHONPATH: the script must import this checkout's edgecache, not whichever one is installed.
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, check=True,
                         cwd=root).stdout.strip()
    assert out == key(chat(stop=("x", "y"), seed=3))


# --- is_cacheable ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("params, cacheable", [
    pytest.param({"temperature": 0.0}, True, id="greedy"),
    pytest.param({"temperature": 0.0, "seed": 5}, True, id="greedy-with-seed"),
    pytest.param({"temperature": 0.7}, False, id="sampling-no-seed"),
    pytest.param({"temperature": 0.7, "seed": 5}, True, id="sampling-with-seed"),
    pytest.param({"temperature": 0.7, "seed": 0}, True, id="sampling-with-seed-zero"),
    pytest.param({}, False, id="defaults-sample"),
])
def test_is_cacheable(params: dict[str, Any], cacheable: bool) -> None:
    request = GenerationRequest(messages=(Message("user", "hi"),), params=SamplingParams(**params))
    assert is_cacheable(request) is cacheable


# --- max_tokens out of the key, where decoding is prefix-stable ----------------------------------------------


def free_key(request: GenerationRequest, **namespace: str) -> str:
    return request_key(request, **{**NAMESPACE, **namespace}, any_max_tokens=True)


def test_the_key_without_max_tokens_is_the_same_for_every_max_tokens() -> None:
    assert free_key(chat(max_tokens=12)) == free_key(chat(max_tokens=48)) == free_key(chat(max_tokens=256))
    assert key(chat(max_tokens=12)) != key(chat(max_tokens=48))


def test_the_key_without_max_tokens_never_equals_a_key_with_it() -> None:
    # 256 is SamplingParams' default, which the encoding omits: a key that dropped max_tokens by setting the
    # default would equal the full key of every request that asks for 256.
    for max_tokens in (1, 12, 256):
        assert free_key(chat(max_tokens=max_tokens)) != key(chat(max_tokens=max_tokens))


@pytest.mark.parametrize("change", [
    pytest.param({"stop": ("\n",)}, id="stop"),
    pytest.param({"temperature": 0.5, "seed": 1}, id="temperature"),
    pytest.param({"seed": 1}, id="seed"),
    pytest.param({"top_p": 0.9}, id="top_p"),
])
def test_the_key_without_max_tokens_keeps_every_other_parameter(change: dict[str, Any]) -> None:
    assert free_key(chat(**change)) != free_key(chat())


@pytest.mark.parametrize("fields", [
    pytest.param({"min_tokens": 4}, id="min_tokens"),
    pytest.param({"n": 2}, id="n"),
    pytest.param({"logprobs": 0}, id="logprobs"),
])
def test_the_key_without_max_tokens_keeps_the_stopping_and_shape_fields(fields: dict[str, Any]) -> None:
    assert free_key(msgspec.structs.replace(chat(), **fields)) != free_key(chat())


def test_the_key_schema_is_bumped_for_keys_without_max_tokens() -> None:
    from edgecache.keys import KEY_SCHEMA
    assert KEY_SCHEMA == 3


@pytest.mark.parametrize("params, fields, rule, stable", [
    pytest.param({"temperature": 0.0}, {}, "greedy", True, id="greedy"),
    pytest.param({"temperature": 0.0}, {}, "", False, id="engine-reports-no-token-ends"),
    pytest.param({"temperature": 0.7, "seed": 3}, {}, "greedy", False, id="seeded-on-a-greedy-only-engine"),
    pytest.param({"temperature": 0.7, "seed": 3}, {}, "seeded", True, id="seeded"),
    pytest.param({"temperature": 0.7}, {}, "seeded", False, id="sampled-without-seed"),
    pytest.param({"temperature": 0.0}, {"n": 2}, "seeded", False, id="n"),
    pytest.param({"temperature": 0.0}, {"logprobs": 0}, "seeded", False, id="logprobs"),
    pytest.param({"temperature": 0.0}, {"echo": True}, "seeded", False, id="echo"),
    pytest.param({"temperature": 0.0}, {"tools": (ToolSpec("f"),)}, "seeded", False, id="tools"),
    pytest.param({"temperature": 0.0}, {"tools": (ToolSpec("f"),), "tool_choice": "none"}, "seeded", True,
                 id="tools-not-offered"),
    pytest.param({"temperature": 0.0}, {"min_tokens": 4}, "seeded", True, id="min_tokens"),
])
def test_prefix_stable(params: dict[str, Any], fields: dict[str, Any], rule: str, stable: bool) -> None:
    request = GenerationRequest(messages=(Message("user", "hi"),), params=SamplingParams(**params), **fields)
    assert prefix_stable(request, rule) is stable
