"""The CPU engine's prefix states in tiers, with the real model (llama.cpp and SmolLM2): a restart keeps a prefix
and the answer is the same as computed; a state made for another model file or another context size never loads;
a client's breakpoint saves the state at its block's end and reports what it wrote; retention pins a prefix, or keeps
it in RAM only."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from edgecache.engines.base import CacheBreakpoint, CacheHints, Chunk, GenerationRequest, Message, SamplingParams
from edgecache.engines.llamacpp import LlamaCppEngine, resolve_model_path

pytestmark = pytest.mark.e2e

SYSTEM = "You are the help desk of a small library. " + " ".join(
    f"Rule {i}: books of shelf {i} may be borrowed for {i % 4 + 1} weeks." for i in range(12))


def ask(question: str, salt: str = "acme", cache: CacheHints | None = None) -> GenerationRequest:
    return GenerationRequest(messages=(Message(role="system", content=SYSTEM), Message(role="user", content=question)),
                             params=SamplingParams(max_tokens=6, temperature=0.0), salt=salt, cache=cache)


async def answer(engine: LlamaCppEngine, request: GenerationRequest) -> tuple[str, Chunk]:
    text, last = "", None
    async for chunk in engine.generate(request):
        text += chunk.text
        if chunk.finish_reason is not None:
            last = chunk
    assert last is not None
    return text, last


def engine(data_dir: Path, model: str = "smollm2", context_tokens: int = 2048, **kw: int) -> LlamaCppEngine:
    return LlamaCppEngine(model=model, context_tokens=context_tokens, data_dir=data_dir,
                          prefix_cache_bytes=kw.get("ram", 256 << 20), prefix_cache_disk_bytes=kw.get("disk", 1 << 30),
                          prefix_cache_min_tokens=32)


async def started(e: LlamaCppEngine) -> LlamaCppEngine:
    await e.start()
    return e


async def test_a_restart_keeps_a_prefix_and_answers_as_computed(tmp_path: Path) -> None:
    first = await started(engine(tmp_path))
    computed, cold = await answer(first, ask("How long may I keep a book?"))
    assert cold.cached_tokens == 0 and cold.kv_miss == "never_seen"
    first.prefix_cache.drain()
    await first.close()

    second = await started(engine(tmp_path))
    assert second.prefix_cache.figures()["prefix_cache_disk_entries"] == 1
    again, warm = await answer(second, ask("How long may I keep a book?"))
    assert again == computed
    assert warm.cache_tier == "disk" and warm.cached_tokens == cold.prompt_tokens - 1
    _, near = await answer(second, ask("Where are the atlases?"))
    assert near.cache_tier == "ram" and near.cached_tokens > cold.prompt_tokens - 20  # the system prompt's
    stranger, none = await answer(second, ask("How long may I keep a book?", salt="beta"))
    assert none.cached_tokens == 0 and stranger == computed  # another tenant computes it, and gets the same
    await second.close()


async def test_a_state_made_for_another_model_file_or_context_never_loads(tmp_path: Path) -> None:
    data = tmp_path / "data"
    made = await started(engine(data))
    await answer(made, ask("Can I renew a loan?"))
    made.prefix_cache.drain()
    await made.close()

    smaller = await started(engine(data, context_tokens=1024))
    _, chunk = await answer(smaller, ask("Can I renew a loan?"))
    assert chunk.cached_tokens == 0
    await smaller.close()

    # The same weights file with one byte of its last tensor changed: another model, to the fingerprint.
    path, _ = resolve_model_path("smollm2")
    altered = tmp_path / "altered.gguf"
    shutil.copyfile(path, altered)
    with altered.open("r+b") as f:
        f.seek(-3, 2)
        byte = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([byte[0] ^ 1]))
    other = await started(engine(data, model=str(altered)))
    assert other.version != made.version
    _, chunk = await answer(other, ask("Can I renew a loan?"))
    assert chunk.cached_tokens == 0
    await other.close()

    back = await started(engine(data))  # and the original context finds its own state again
    _, chunk = await answer(back, ask("Can I renew a loan?"))
    assert chunk.cache_tier == "disk" and chunk.cached_tokens > 0
    await back.close()


async def test_a_breakpoint_saves_the_state_at_its_block_and_reports_what_it_wrote(tmp_path: Path) -> None:
    e = await started(engine(tmp_path))
    marks = CacheHints(breakpoints=(CacheBreakpoint(message=0, ttl_s=3600.0), CacheBreakpoint(message=1)))
    _, first = await answer(e, ask("What are the opening hours on weekdays, on weekends, on public holidays, during the "
                                   "summer break and in exam weeks, and does the reading room keep the lending "
                                   "desk's hours?", cache=marks))
    written = dict(first.cache_writes)
    assert first.cached_tokens == 0 and set(written) == {3600.0, 300.0}
    assert sum(written.values()) == first.prompt_tokens  # the last mark ends the prompt (its assistant header too)
    e.prefix_cache.drain()
    states = sorted(len(entry.tokens) for entry in e.prefix_cache.entries())
    assert states[0] == written[3600.0]  # a state that ends with the system turn, kept apart
    # Another question after the same system prompt reads the system turn and writes its own message.
    _, second = await answer(e, ask("Is there a reading room with desks, lamps and sockets for laptops, and may "
                                    "visitors without a library card use it on Saturday mornings?", cache=marks))
    assert second.cached_tokens >= written[3600.0] and dict(second.cache_writes).keys() == {300.0}
    await e.close()


async def test_retention_keeps_a_prefix_a_day_or_in_ram_only(tmp_path: Path) -> None:
    e = await started(engine(tmp_path))
    await answer(e, ask("May I bring a dog?", cache=CacheHints(memory_only=True)))
    await answer(e, ask("May I bring a cat?", salt="beta", cache=CacheHints(retention_s=86400.0)))
    e.prefix_cache.drain()
    by_salt = {entry.salt: entry for entry in e.prefix_cache.entries()}
    assert not by_salt["acme"].on_disk and by_salt["acme"].data is not None
    assert by_salt["beta"].on_disk and by_salt["beta"].keep_s == 86400.0
    await e.close()
    again = await started(engine(tmp_path))
    assert {entry.salt for entry in again.prefix_cache.entries()} == {"beta"}
    await again.close()


async def test_with_the_disk_tier_off_nothing_is_written(tmp_path: Path) -> None:
    e = await started(engine(tmp_path, disk=0))
    _, chunk = await answer(e, ask("Do you have newspapers?"))
    assert chunk.cached_tokens == 0 and not e.has_disk_tier and not (tmp_path / "kv").exists()
    _, again = await answer(e, ask("Do you have newspapers?"))
    assert again.cache_tier == "ram"
    await e.close()
