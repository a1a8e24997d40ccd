#!/usr/bin/env bash
# GPU box check: serve the t4 profile with SGLang in-process on a small model, send a workload whose requests
# share one long system prompt, and print the engine's cached_tokens and time-to-first-token, cold vs warm.
#
#   scripts/gpu_check.sh MODEL_PATH [PROFILE]
#
#   MODEL_PATH  a local model directory or Hugging Face id SGLang can load (e.g. Qwen/Qwen2.5-0.5B-Instruct)
#   PROFILE     default t4
#
# Needs: a CUDA GPU, `pip install -e ".[gpu]"` (sglang), curl. Environment knobs:
#   GPU_CHECK_PORT (default 18080), GPU_CHECK_READY_S (default 900: model download + load),
#   GPU_CHECK_KEY (an API key to send, when the server requires one), GPU_CHECK_WARM (default 5).
# (Not EDGECACHE_*: the server reads every EDGECACHE_* variable as a settings override and refuses unknown ones.)
# EDGECACHE_* variables override the profile as usual (e.g. EDGECACHE_ENGINE__CONTEXT_TOKENS).
#
# Exit status: 0 when every warm request reports cached_tokens > 0 (the radix prefix cache works through
# EdgeCache), 1 when not, 2 when the server did not come up.
set -euo pipefail

MODEL_PATH="${1:?usage: scripts/gpu_check.sh MODEL_PATH [PROFILE]}"
PROFILE="${2:-t4}"
PORT="${GPU_CHECK_PORT:-18080}"
READY_S="${GPU_CHECK_READY_S:-900}"
WARM="${GPU_CHECK_WARM:-5}"
BASE="http://127.0.0.1:${PORT}"

DATA_DIR="$(mktemp -d -t edgecache-gpu-check.XXXXXX)"   # fresh: no result from an earlier run can answer
LOG="${DATA_DIR}/serve.log"
SERVER_PID=""

stop_server() {
  if [[ -n "${SERVER_PID}" ]] && kill -0 "${SERVER_PID}" 2>/dev/null; then
    # SIGTERM lets the lifespan close SGLang (which stops its scheduler and detokenizer processes).
    kill -TERM "${SERVER_PID}" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "${SERVER_PID}" 2>/dev/null || break; sleep 1; done
    # Still there: kill the whole process group we started (setsid below), SGLang's children included.
    kill -KILL -- "-${SERVER_PID}" 2>/dev/null || true
  fi
}
trap stop_server EXIT

echo "== edgecache serve --profile ${PROFILE} (engine ${EDGECACHE_ENGINE__KIND:-sglang}, model ${MODEL_PATH}); log: ${LOG}"
# The engine defaults to sglang; EDGECACHE_ENGINE__KIND=llamacpp with PROFILE=cpu dry-runs this script on a CPU box.
EDGECACHE_ENGINE__KIND="${EDGECACHE_ENGINE__KIND:-sglang}" EDGECACHE_ENGINE__MODEL="${MODEL_PATH}" \
  setsid edgecache serve --profile "${PROFILE}" --host 127.0.0.1 --port "${PORT}" --data-dir "${DATA_DIR}" \
  >"${LOG}" 2>&1 &
SERVER_PID=$!

deadline=$(( $(date +%s) + READY_S ))
until curl -fsS "${BASE}/health" >/dev/null 2>&1; do
  if ! kill -0 "${SERVER_PID}" 2>/dev/null; then
    echo "!! the server exited while starting; last lines of its log:"; tail -n 40 "${LOG}"; exit 2
  fi
  if (( $(date +%s) > deadline )); then
    echo "!! not ready after ${READY_S}s; last lines of its log:"; tail -n 40 "${LOG}"; exit 2
  fi
  sleep 2
done
echo "== ready: $(curl -fsS "${BASE}/v1/models")"

BASE="${BASE}" WARM="${WARM}" python - <<'PY'
"""Cold then warm requests sharing a system prompt; prints TTFT and the engine's cached_tokens for each."""
import json
import os
import statistics
import sys
import time

import httpx

BASE = os.environ["BASE"]
WARM = int(os.environ["WARM"])
KEY = os.environ.get("GPU_CHECK_KEY")
HEADERS = {"Authorization": f"Bearer {KEY}"} if KEY else {}

# ~1,500 tokens of shared instructions: the prefix the radix cache should keep after the first request.
POLICY = " ".join(
    f"Rule {i}: when a customer asks about order category {i}, check the ledger entry {i * 7}, confirm the "
    f"shipping window of {i % 5 + 2} days, and never promise a refund above {i * 3} euros without approval."
    for i in range(1, 41)
)
SYSTEM = "You are the support assistant of a parcel company. Follow these rules exactly. " + POLICY
# Distinct questions (different numbers and topics) so neither the exact nor the semantic layer answers them:
# every request must reach the engine.
QUESTIONS = [
    "Where is parcel 4411? It was due on Monday.",
    "Can I change the delivery address of order 9120 to Lyon?",
    "My invoice 3307 shows 14 euros too much. Why?",
    "Do you ship batteries to Norway?",
    "How do I return a damaged lamp bought in March?",
    "Is Saturday delivery possible for postcode 75011?",
    "What does ledger code 217 mean on my receipt?",
    "Two parcels arrived but I ordered three, order 5521.",
]


def ask(client: httpx.Client, system: str, question: str) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    usage = None
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
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
                    ttft = time.perf_counter() - start
            usage = event.get("usage") or usage
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {
        "ttft_ms": None if ttft is None else ttft * 1000,
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens"),
        "served_by": served_by,
    }


def show(label: str, r: dict) -> None:
    ttft = "n/a" if r["ttft_ms"] is None else f"{r['ttft_ms']:8.1f} ms"
    print(f"{label:<8} ttft {ttft}  prompt_tokens {r['prompt_tokens']}  cached_tokens {r['cached_tokens']}"
          f"  X-EdgeCache {r['served_by']}")


with httpx.Client(base_url=BASE, headers=HEADERS, timeout=300) as client:
    MODEL = client.get("/v1/models").json()["data"][0]["id"]
    # Compile kernels and capture graphs on an unrelated prompt first, so "cold" measures the prefix cache.
    show("warmup", ask(client, "You are a poet.", "Write one line about rain."))
    cold = ask(client, SYSTEM, QUESTIONS[0])
    show("cold", cold)
    warm = [ask(client, SYSTEM, q) for q in QUESTIONS[1 : 1 + WARM]]
    for i, r in enumerate(warm, 1):
        show(f"warm {i}", r)

warm_ttft = [r["ttft_ms"] for r in warm if r["ttft_ms"] is not None]
if cold["ttft_ms"] and warm_ttft:
    median = statistics.median(warm_ttft)
    print(f"\nTTFT cold {cold['ttft_ms']:.1f} ms, warm median {median:.1f} ms: cold/warm = {cold['ttft_ms'] / median:.2f}x")
cached = [r["cached_tokens"] or 0 for r in warm]
prompt = [r["prompt_tokens"] or 0 for r in warm]
if sum(prompt):
    print(f"warm prefix reuse: {sum(cached)} of {sum(prompt)} prompt tokens came from the prefix cache "
          f"({100 * sum(cached) / sum(prompt):.0f} %); cold request: {cold['cached_tokens']} cached")
ok = bool(warm) and all(c > 0 for c in cached)
print("RESULT:", "OK, warm requests reuse the shared prefix" if ok else "FAIL, warm requests report no cached tokens")
sys.exit(0 if ok else 1)
PY
