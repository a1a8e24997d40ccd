"""Prefill and decode speed of the llama.cpp engine with its extra buffer types (weight repacking) on and off.

Each setting loads the model in a fresh child process (llama.cpp repacks at load), then, alternating on and off
over ``--rounds`` rounds: a prefill of a ``--prompt-tokens`` prompt from an empty context (tokens/s of the prompt),
and a greedy decode of ``--decode-tokens`` tokens after a short prompt (tokens/s of the answer). Prints each
setting's median. With ``--model`` any GGUF file; ``--requantize q4_0`` first writes a Q4_0 copy of it (a type
llama.cpp repacks on AVX2/AVX-512; the shipped SmolLM2 is Q4_1, which it does not).

    python scripts/bench_extra_buffer_types.py [--model smollm2] [--requantize q4_0] [--threads 1] [--rounds 5]

On a CPU with AMX, ``on`` means the AMX buffer type, whose matmul faults in llama.cpp 0.3.x (the reason
engine.extra_buffer_types defaults to auto): each setting runs in its own child, so a fault is reported, not fatal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys, time
from edgecache.engines.llamacpp import LlamaCppEngine
import asyncio
model, on, threads, prompt_tokens, decode_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
engine = LlamaCppEngine(model=model, threads=threads, extra_buffer_types=on, context_tokens=2048, batch_tokens=512)
asyncio.run(engine.start())
llm = engine._llm
text = " ".join(f"Item {i} of the list is a word." for i in range(prompt_tokens))
tokens = llm.tokenize(text.encode())[:prompt_tokens]
for line in sys.stdin:
    llm.reset()
    t = time.perf_counter(); llm.eval(tokens); prefill = len(tokens) / (time.perf_counter() - t)
    llm.reset()
    n, t = 0, 0.0
    for token in llm.generate(llm.tokenize(b"Write a long story about a cat."), temp=0.0):
        if n == 0:
            t = time.perf_counter()  # from the first sampled token on: the short prompt's prefill is left out
        n += 1
        if n > decode_tokens:
            break
    decode = decode_tokens / (time.perf_counter() - t)
    print(json.dumps({"prefill": prefill, "decode": decode}), flush=True)
"""


def requantize(source: str, kind: str) -> str:
    import llama_cpp

    from edgecache.engines.llamacpp import resolve_model_path

    path, _ = resolve_model_path(source)
    out = Path(tempfile.gettempdir()) / f"{path.stem}.{kind}.gguf"
    if not out.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}")
        params.allow_requantize = True
        params.nthread = 2
        if llama_cpp.llama_model_quantize(str(path).encode(), str(out).encode(), params) != 0:
            raise SystemExit(f"requantizing {path} to {kind} failed")
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requantize", choices=["q4_0", "q8_0"], default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    args = parser.parse_args()
    model = requantize(args.model, args.requantize) if args.requantize else args.model
    children = {}
    for setting in ("on", "off"):
        children[setting] = subprocess.Popen(
            [sys.executable, "-c", CHILD, model, setting, str(args.threads), str(args.prompt_tokens),
             str(args.decode_tokens)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    figures: dict[str, dict[str, list[float]]] = {s: {"prefill": [], "decode": []} for s in children}
    for _ in range(args.rounds):
        for setting, child in children.items():  # alternating, so a busy moment of the box hits both alike
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write("go\n")
            child.stdin.flush()
            reply = child.stdout.readline()
            if not reply:
                raise SystemExit(f"extra buffer types {setting}: the child died (exit {child.wait()})")
            for key, value in json.loads(reply).items():
                figures[setting][key].append(value)
        time.sleep(0.1)
    for child in children.values():
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    print(f"model {model}, {args.threads} thread(s), {args.prompt_tokens}-token prefill, {args.decode_tokens}-token "
          f"decode, median of {args.rounds} alternating rounds")
    for setting, values in figures.items():
        print(f"extra buffer types {setting:>3}: prefill {statistics.median(values['prefill']):7.1f} tok/s, "
              f"decode {statistics.median(values['decode']):6.1f} tok/s")


if __name__ == "__main__":
    main()
