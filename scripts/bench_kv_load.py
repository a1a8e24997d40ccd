"""How long the CPU engine takes to load a long prefix's KV state from its disk tier, against computing it.

One run, side by side: a prompt of --tokens tokens is computed once (cold prefill, the state is saved and written to
disk), then --repeats times a fresh engine on the same data dir (a restart) finds the state on disk and loads it:
read and checked (CRC-32), then handed to llama.cpp (``llama_state_seq_set_data``), first with the file in the
operating system's page cache (a process restart), then, as root, with the page cache dropped before each load (a
reboot: the file comes from the device); and --repeats times the state is loaded again from RAM. Prints each
phase's seconds and the ratio to the cold prefill.

    python scripts/bench_kv_load.py [--tokens 5000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from edgecache.engines.base import GenerationRequest, Message, SamplingParams
from edgecache.engines.llamacpp import LlamaCppEngine


def prompt_of(engine: LlamaCppEngine, tokens: int) -> GenerationRequest:
    """A chat whose rendered prompt has about ``tokens`` tokens."""
    words = [f"Rule {i}: the assistant answers question kind {i % 17} in at most {i % 9 + 2} sentences." for i in
             range(tokens)]
    lo, hi = 1, len(words)
    while lo < hi:  # the fewest rules that reach the token count
        mid = (lo + hi) // 2
        probe = GenerationRequest(messages=(Message(role="system", content=" ".join(words[:mid])),
                                            Message(role="user", content="Hello")))
        if len(engine._prompt_tokens(probe)) < tokens:
            lo = mid + 1
        else:
            hi = mid
    return GenerationRequest(messages=(Message(role="system", content=" ".join(words[:lo])),
                                       Message(role="user", content="Hello")),
                             params=SamplingParams(max_tokens=1, temperature=0.0), salt="bench")


def engine(data_dir: Path, context: int) -> LlamaCppEngine:
    return LlamaCppEngine(model="smollm2", context_tokens=context, data_dir=data_dir, prefix_cache_bytes=1 << 30,
                          prefix_cache_disk_bytes=4 << 30)


def drop_page_cache() -> bool:
    """Empty the operating system's page cache (root only): the next read of a state comes from the device."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def timed_restore(e: LlamaCppEngine, tokens: list[int]) -> tuple[float, int, str]:
    """Seconds to find and load the best state for ``tokens`` into an empty context (the engine's own path)."""
    e._llm.reset()
    e._salt_in_context = None
    start = time.perf_counter()
    loaded, found, _ = e._restore_best_prefix("bench", tokens)
    return time.perf_counter() - start, loaded, found.tier if found is not None else "-"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    context = max(8192, args.tokens + 512)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        first = engine(data, context)
        await first.start()
        request = prompt_of(first, args.tokens)
        tokens = first._prompt_tokens(request)
        start = time.perf_counter()
        async for _ in first.generate(request):
            pass
        cold = time.perf_counter() - start
        first.prefix_cache.drain()
        size = first.prefix_cache.figures()["prefix_cache_disk_bytes"]
        await first.close()
        disk: list[float] = []
        device: list[float] = []
        ram: list[float] = []
        for run in range(2 * args.repeats):
            cold_read = run >= args.repeats
            again = engine(data, context)
            await again.start()
            if cold_read and not drop_page_cache():
                await again.close()
                break
            seconds, loaded, tier = await asyncio.get_running_loop().run_in_executor(
                again._executor, timed_restore, again, tokens)
            assert tier == "disk" and loaded >= len(tokens) - 1, (tier, loaded)
            (device if cold_read else disk).append(seconds)
            seconds, loaded, tier = await asyncio.get_running_loop().run_in_executor(
                again._executor, timed_restore, again, tokens)
            assert tier == "ram", tier
            ram.append(seconds)
            await again.close()
    print(f"prompt: {len(tokens)} tokens; state on disk: {size / 2**20:.1f} MiB")
    print(f"{'phase':<28}{'seconds':>10}{'x cold':>10}")
    print(f"{'cold prefill (1 token out)':<28}{cold:>10.2f}{1:>10.2f}")
    for name, runs in (("load from disk, page cache", disk), ("load from disk, device", device),
                       ("load from RAM", ram)):
        if not runs:
            print(f"{name:<28}{'-':>10}   (the page cache can only be dropped as root)")
            continue
        median = statistics.median(runs)
        print(f"{name:<28}{median:>10.3f}{median / cold:>10.4f}   runs: {', '.join(f'{r:.3f}' for r in runs)}")


if __name__ == "__main__":
    asyncio.run(main())
