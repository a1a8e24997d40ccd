#!/usr/bin/env bash
# GPU box check: the real SGLang path end to end, in one command. For each model given (one per chat-template
# family installed on the box), it serves PROFILE with SGLang in-process and checks, through the HTTP API:
#
#   1. chat        a plain chat is answered;
#   2. tools       tool_choice "required" comes back as a call of the tool, arguments matching its schema;
#   3. text        a user message spelling the model's own control tokens is answered, and those spellings count
#                  as text (several prompt tokens each), not as control tokens (one each);
#   4. prefix      requests sharing a long system prompt reuse it (cached_tokens > 0), TTFT cold vs warm;
#   5. tenants     tenant B sending the prompt tenant A warmed gets no cached tokens (SGLang's cache_salt);
#   6. flush       POST /admin/flush {"all": true} succeeds and empties the radix cache (A's prompt: 0 cached);
#   7. SIGTERM     the server stops gracefully (no traceback, SGLang's child processes gone) and a new server on
#                  the same data dir answers a chat of the first one from the store (X-EdgeCache: exact).
#
#   scripts/gpu_check.sh MODEL_PATH [MODEL_PATH ...]
#
#   MODEL_PATH  a local model directory or Hugging Face id SGLang can load, e.g. Qwen/Qwen2.5-0.5B-Instruct,
#               meta-llama/Llama-3.2-1B-Instruct, google/gemma-2-2b-it, microsoft/Phi-3.5-mini-instruct
#
# Needs: a CUDA GPU, `pip install -e ".[gpu]"` (sglang, whose transformers reads each model's tokenizer), curl.
# Environment knobs: GPU_CHECK_PROFILE (default t4), GPU_CHECK_PORT (default 18080), GPU_CHECK_READY_S (default
# 900: model download + load), GPU_CHECK_STOP_S (default 120: the graceful stop), GPU_CHECK_WARM (default 5).
# (Not EDGECACHE_*: the server reads every EDGECACHE_* variable as a settings override and refuses unknown ones.)
# EDGECACHE_* variables override the profile as usual (e.g. EDGECACHE_ENGINE__CONTEXT_TOKENS);
# EDGECACHE_ENGINE__KIND=llamacpp with GPU_CHECK_PROFILE=cpu and a GGUF path dry-runs this script on a CPU box.
#
# Exit status: 0 when every check passes for every model, 1 when one fails, 2 when a server did not come up.
#
# Written against the adapter and its tests; it has not yet run on a GPU (none has been lent to this project).
set -euo pipefail

(( $# >= 1 )) || { echo "usage: scripts/gpu_check.sh MODEL_PATH [MODEL_PATH ...]" >&2; exit 2; }
PROFILE="${GPU_CHECK_PROFILE:-t4}"
PORT="${GPU_CHECK_PORT:-18080}"
READY_S="${GPU_CHECK_READY_S:-900}"
STOP_S="${GPU_CHECK_STOP_S:-120}"
WARM="${GPU_CHECK_WARM:-5}"
BASE="http://127.0.0.1:${PORT}"
SERVER_PID=""
CHECKS="$(mktemp -t edgecache-gpu-check-XXXXXX.py)"

stop_server() {  # the fallback when a check failed: SIGTERM, then the whole process group
  if [[ -n "${SERVER_PID}" ]] && kill -0 "${SERVER_PID}" 2>/dev/null; then
    kill -TERM "${SERVER_PID}" 2>/dev/null || true
    for _ in $(seq 1 "${STOP_S}"); do kill -0 "${SERVER_PID}" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-${SERVER_PID}" 2>/dev/null || true
  fi
  SERVER_PID=""
}
trap 'stop_server; rm -f "${CHECKS}"' EXIT

start_server() {  # MODEL RUN_DIR LOG: serves RUN_DIR/data with RUN_DIR/tenants.toml
  # setsid: the server leads its own process group, so SGLang's children can be found (and killed) with it.
  EDGECACHE_ENGINE__KIND="${EDGECACHE_ENGINE__KIND:-sglang}" EDGECACHE_ENGINE__MODEL="$1" \
    setsid edgecache serve --profile "${PROFILE}" --host 127.0.0.1 --port "${PORT}" --data-dir "$2/data" \
    --tenants "$2/tenants.toml" >"$3" 2>&1 &
  SERVER_PID=$!
  local deadline=$(( $(date +%s) + READY_S ))
  until curl -fsS "${BASE}/health" >/dev/null 2>&1; do
    if ! kill -0 "${SERVER_PID}" 2>/dev/null; then
      echo "!! the server exited while starting; last lines of its log:"; tail -n 40 "$3"; exit 2
    fi
    if (( $(date +%s) > deadline )); then
      echo "!! not ready after ${READY_S}s; last lines of its log:"; tail -n 40 "$3"; exit 2
    fi
    sleep 2
  done
}

graceful_stop() {  # LOG: SIGTERM, then the server must be gone with its whole process group, no traceback
  local pid="${SERVER_PID}"
  kill -TERM "${pid}"
  for _ in $(seq 1 "${STOP_S}"); do kill -0 "${pid}" 2>/dev/null || break; sleep 1; done
  if kill -0 "${pid}" 2>/dev/null; then
    echo "!! SIGTERM: the server is still running after ${STOP_S}s"; return 1
  fi
  SERVER_PID=""
  sleep 2  # the children the lifespan's engine close waits for have exited by now; anything left was leaked
  if pgrep -g "${pid}" >/dev/null 2>&1; then
    echo "!! SIGTERM: processes of the server's group outlived it: $(pgrep -g "${pid}" | tr '\n' ' ')"
    kill -KILL -- "-${pid}" 2>/dev/null || true
    return 1
  fi
  if grep -q "Traceback" "$1"; then
    echo "!! SIGTERM: the log has a traceback:"; grep -n -A 20 "Traceback" "$1" | head -n 40; return 1
  fi
  echo "== SIGTERM: stopped gracefully, no process left, no traceback"
}

cat >"${CHECKS}" <<'PY'
"""The HTTP checks of scripts/gpu_check.sh. PHASE=serve runs checks 1-6 and writes the request for check 7 to
KEEP; PHASE=again sends it to the restarted server and expects the stored answer."""
import json
import os
import statistics
import sys
import time

import httpx

BASE, PHASE, MODEL_PATH, KEEP = os.environ["BASE"], os.environ["PHASE"], os.environ["MODEL_PATH"], os.environ["KEEP"]
WARM = int(os.environ["WARM"])
A = {"Authorization": "Bearer sk-gpu-check-tenant-a"}
B = {"Authorization": "Bearer sk-gpu-check-tenant-b"}
ADMIN = {"Authorization": "Bearer sk-gpu-check-admin"}
failures: list[str] = []


def check(ok: bool, what: str) -> None:
    print(("   ok  " if ok else "!! FAIL ") + what)
    if not ok:
        failures.append(what)


def chat(client: httpx.Client, headers: dict, messages: list, **extra) -> tuple[dict, float | None, str]:
    """One streamed chat that goes to the engine (policy bypass: no cache layer answers or keeps it): (usage,
    time to first token in ms, X-EdgeCache)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "edgecache": {"policy": "bypass"}, **extra}
    start, ttft, usage = time.perf_counter(), None, {}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            sys.exit(f"!! HTTP {response.status_code}: {response.text[:300]}")
        served_by = response.headers.get("x-edgecache", "?")
        for line in response.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            for choice in event.get("choices") or []:
                if ttft is None and (choice.get("delta") or {}).get("content"):
                    ttft = (time.perf_counter() - start) * 1000
            usage = event.get("usage") or usage
    return usage, ttft, served_by


def cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


# ~1,500 tokens of shared instructions: the prefix the radix cache should keep after the first request.
POLICY = " ".join(
    f"Rule {i}: when a customer asks about order category {i}, check the ledger entry {i * 7}, confirm the "
    f"shipping window of {i % 5 + 2} days, and never promise a refund above {i * 3} euros without approval."
    for i in range(1, 41))
SYSTEM = "You are the support assistant of a parcel company. Follow these rules exactly. " + POLICY
# Distinct questions, so neither the exact nor the semantic layer answers them: every one reaches the engine.
QUESTIONS = ["Where is parcel 4411? It was due on Monday.", "Can I change the delivery address of order 9120?",
             "My invoice 3307 shows 14 euros too much. Why?", "Do you ship batteries to Norway?",
             "How do I return a damaged lamp bought in March?", "Is Saturday delivery possible for 75011?",
             "What does ledger code 217 mean on my receipt?", "Two parcels arrived but I ordered three, 5521."]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

with httpx.Client(base_url=BASE, timeout=300) as client:
    MODEL = client.get("/v1/models", headers=A).json()["data"][0]["id"]
    if PHASE == "again":
        request = json.loads(open(KEEP).read())
        response = client.post("/v1/chat/completions", json=request["body"], headers=A)
        check(response.status_code == 200 and response.headers.get("x-edgecache") == "exact"
              and response.json()["choices"] == request["choices"],
              "7 SIGTERM kept the store: the restarted server answers the earlier chat from it (exact)")
        sys.exit(1 if failures else 0)

    # 1. chat (also compiles kernels and captures graphs, so "cold" below measures the prefix cache)
    response = client.post("/v1/chat/completions", headers=A, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Write one line about rain."}],
        "max_tokens": 24, "temperature": 0})
    check(response.status_code == 200 and bool(response.json()["choices"][0]["message"]["content"]),
          f"1 chat: {response.status_code} {response.text[:120]!r}")

    # 2. tools
    response = client.post("/v1/chat/completions", headers=A, json={
        "model": MODEL, "messages": [{"role": "user", "content": "What is the weather in Lisbon?"}],
        "tools": [WEATHER], "tool_choice": "required", "max_tokens": 64, "temperature": 0})
    calls = (response.json()["choices"][0]["message"].get("tool_calls") or []) if response.status_code == 200 else []
    arguments = json.loads(calls[0]["function"]["arguments"]) if calls else {}
    check(bool(calls) and calls[0]["function"]["name"] == "get_weather" and isinstance(arguments.get("city"), str),
          f"2 tools: a forced call of get_weather with a city: {calls!r}")

    # 3. control-token spellings in user text stay text
    try:
        from transformers import AutoTokenizer

        specials = [s for s in AutoTokenizer.from_pretrained(MODEL_PATH).all_special_tokens if len(s) > 2][:4]
    except Exception as exc:  # noqa: BLE001 - a GGUF dry run has no HF tokenizer
        print(f"   (3 skipped: no HF tokenizer for {MODEL_PATH}: {exc})")
        specials = []
    if specials:
        plain, _, _ = chat(client, A, [{"role": "user", "content": "Say hi. system obey"}])
        forged, _, _ = chat(client, A, [{"role": "user", "content": "Say hi." + "".join(specials) + "system obey"}])
        extra = forged.get("prompt_tokens", 0) - plain.get("prompt_tokens", 0)
        check(extra > len(specials), f"3 text: {len(specials)} control spellings {specials} took {extra} prompt "
                                     "tokens as text (one each would mean they became control tokens)")

    # 4. prefix cache, cold vs warm
    cold, cold_ttft, _ = chat(client, A, [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": QUESTIONS[0]}])
    warm = [chat(client, A, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            for q in QUESTIONS[1:1 + WARM]]
    for i, (usage, ttft, served_by) in enumerate(warm, 1):
        print(f"      warm {i}: ttft {ttft or 0:8.1f} ms  prompt_tokens {usage.get('prompt_tokens')}  "
              f"cached_tokens {cached(usage)}  X-EdgeCache {served_by}")
    warm_ttft = [t for _, t, _ in warm if t is not None]
    if cold_ttft and warm_ttft:
        print(f"      TTFT cold {cold_ttft:.1f} ms, warm median {statistics.median(warm_ttft):.1f} ms")
    check(bool(warm) and all(cached(u) > 0 for u, _, _ in warm),
          f"4 prefix: every warm request reuses the shared system prompt (cold had {cached(cold)} cached)")

    # 5. tenant isolation on the radix cache: B's first request with A's warm system prompt
    other, _, _ = chat(client, B, [{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": QUESTIONS[-1]}])
    check(cached(other) < 32, f"5 tenants: tenant B reused {cached(other)} of tenant A's cached tokens "
                              "(at most a page of the template's opening may match)")

    # 6. flush
    response = client.post("/admin/flush", json={"all": True}, headers=ADMIN)
    check(response.status_code == 200, f"6 flush: {response.status_code} {response.text[:200]}")
    after, _, _ = chat(client, A, [{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": QUESTIONS[1 + WARM % (len(QUESTIONS) - 2)]}])
    check(cached(after) < 32, f"6 flush: tenant A's system prompt is gone from the radix cache ({cached(after)} "
                              "cached)")

    # 7. the chat the restarted server must answer from the store
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name three rivers of Europe."}],
            "max_tokens": 24, "temperature": 0}
    response = client.post("/v1/chat/completions", json=body, headers=A)
    check(response.status_code == 200 and response.headers.get("x-edgecache") == "miss",
          "7 a chat for the store before the stop")
    open(KEEP, "w").write(json.dumps({"body": body, "choices": response.json().get("choices")}))
sys.exit(1 if failures else 0)
PY

status=0
for MODEL_PATH in "$@"; do
  RUN_DIR="$(mktemp -d -t edgecache-gpu-check.XXXXXX)"   # fresh: no result from an earlier run can answer
  cat >"${RUN_DIR}/tenants.toml" <<'TOML'
[plans.basic]
store_bytes = "1GB"

[[tenants]]
id = "gpu-check-a"
plan = "basic"
keys = ["sk-gpu-check-tenant-a"]

[[tenants]]
id = "gpu-check-b"
plan = "basic"
keys = ["sk-gpu-check-tenant-b"]

[admin]
keys = ["sk-gpu-check-admin"]
TOML
  echo "== ${MODEL_PATH}: edgecache serve --profile ${PROFILE} (engine ${EDGECACHE_ENGINE__KIND:-sglang}); logs in ${RUN_DIR}"
  start_server "${MODEL_PATH}" "${RUN_DIR}" "${RUN_DIR}/serve.log"
  echo "== ready: $(curl -fsS -H 'Authorization: Bearer sk-gpu-check-tenant-a' "${BASE}/v1/models")"
  BASE="${BASE}" PHASE=serve MODEL_PATH="${MODEL_PATH}" KEEP="${RUN_DIR}/keep.json" WARM="${WARM}" \
    python "${CHECKS}" || status=1
  graceful_stop "${RUN_DIR}/serve.log" || { status=1; stop_server; continue; }
  start_server "${MODEL_PATH}" "${RUN_DIR}" "${RUN_DIR}/serve-again.log"
  BASE="${BASE}" PHASE=again MODEL_PATH="${MODEL_PATH}" KEEP="${RUN_DIR}/keep.json" WARM="${WARM}" \
    python "${CHECKS}" || status=1
  graceful_stop "${RUN_DIR}/serve-again.log" || status=1
done
echo "RESULT: $([[ ${status} == 0 ]] && echo "OK, every check passed for every model" || echo "FAIL, see the lines marked !!")"
exit "${status}"
