"""The exact result store: a real diskcache under a temp dir, with the memory tier in front."""

from __future__ import annotations

import asyncio
import codecs
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import diskcache
import msgspec
import pytest

from edgecache.stores import CachedAnswer, serve_within
from edgecache.stores.disk import DiskResultStore
from edgecache.stores.memory import MemoryLRU, MemoryTier
from tests.conftest import until

MiB = 2**20


def answer(text: str = "hello", *, ttl_s: float = 3600.0, now: float | None = None) -> CachedAnswer:
    now = time.time() if now is None else now
    return CachedAnswer(text=text, finish_reason="stop", prompt_tokens=3, completion_tokens=2,
                        created_at=now, expires_at=now + ttl_s)


def open_store(directory: Path, *, disk_bytes: int = 64 * MiB, memory_bytes: int = 4 * MiB) -> DiskResultStore:
    return DiskResultStore(directory, disk_bytes=disk_bytes, memory_bytes=memory_bytes)


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "results"


@pytest.fixture
def store(store_dir: Path) -> Iterator[DiskResultStore]:
    s = open_store(store_dir)
    yield s
    s.close()


# --- put / get -------------------------------------------------------------------------------------------------


async def test_put_then_get_returns_the_same_answer(store: DiskResultStore) -> None:
    stored = answer("the answer")
    await store.put("k1", stored)
    assert await store.get("k1") == stored
    assert store.get_memory("k1") == stored


async def test_get_of_an_unknown_key_is_a_miss(store: DiskResultStore) -> None:
    assert await store.get("never-stored") is None
    assert store.get_memory("never-stored") is None


async def test_put_replaces_an_earlier_answer(store: DiskResultStore) -> None:
    await store.put("k", answer("first"))
    await store.put("k", answer("second"))
    got = await store.get("k")
    assert got is not None and got.text == "second"


async def test_an_answer_already_expired_is_not_stored(store: DiskResultStore) -> None:
    await store.put("k", answer(ttl_s=-1.0))
    assert await store.get("k") is None
    assert (await store.stats())["entries"] == 0


async def test_the_memory_copy_exists_before_the_disk_write_finishes(store: DiskResultStore) -> None:
    stored = answer()
    write = asyncio.create_task(store.put("k", stored))
    await asyncio.sleep(0)  # put ran up to its first await: the disk write is on the writer thread
    assert store.get_memory("k") == stored
    await write


async def test_puts_made_while_the_writer_is_busy_go_in_one_transaction_and_keep_their_order(
        store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Twenty puts made while the writer thread is busy are one batch (one SQLite transaction); a delete asked
    after them runs after them, and a put asked after the delete runs after it, in a batch of its own. Each put
    learns that its answer is on disk."""
    store = open_store(store_dir)
    batches: list[list[str]] = []
    write_batch = store._write_batch

    def counted(batch, disk):  # type: ignore[no-untyped-def]
        batches.append([row[0] for row in batch.rows])
        return write_batch(batch, disk)

    monkeypatch.setattr(store, "_write_batch", counted)
    busy = threading.Event()
    store._writer.submit(busy.wait)  # the writer thread is busy until the puts below are all asked
    try:
        first = [asyncio.create_task(store.put(f"k{i}", answer(f"first {i}"))) for i in range(20)]
        await until(lambda: store._batch is not None and len(store._batch.rows) == 20, "twenty puts in one batch")
        deleted = asyncio.create_task(store.delete("k3"))
        await asyncio.sleep(0)
        again = [asyncio.create_task(store.put("k3", answer("after the delete"))),
                 asyncio.create_task(store.put("k20", answer("first 20")))]
        await until(lambda: store._batch is not None and len(store._batch.rows) == 2, "a second batch")
        busy.set()
        assert await asyncio.gather(*first, *again) == [True] * 22
        assert await deleted is True
    finally:
        busy.set()
        store.close()
    assert batches == [[f"k{i}" for i in range(20)], ["k3", "k20"]]
    reopened = open_store(store_dir)  # from disk alone
    try:
        texts = {i: (await reopened.get(f"k{i}")) for i in range(21)}
        assert {i: a.text for i, a in texts.items() if a is not None} == {
            **{i: f"first {i}" for i in range(21)}, 3: "after the delete"}
    finally:
        reopened.close()


# --- restarts --------------------------------------------------------------------------------------------------


async def test_an_answer_survives_reopening_the_store(store_dir: Path) -> None:
    stored = answer("durable")
    first = open_store(store_dir)
    await first.put("k", stored)
    first.close()

    second = open_store(store_dir)
    try:
        # The memory tier starts empty, so this get must come from disk.
        assert second.get_memory("k") is None
        assert (await second.stats())["memory_entries"] == 0
        assert await second.get("k") == stored
        # A disk hit is copied into memory for the next look.
        assert second.get_memory("k") == stored
    finally:
        second.close()


# --- TTL -------------------------------------------------------------------------------------------------------


async def test_an_entry_expires_in_the_memory_tier(store: DiskResultStore) -> None:
    await store.put("k", answer(ttl_s=0.2))
    assert store.get_memory("k") is not None
    await asyncio.sleep(0.3)
    assert store.get_memory("k") is None
    assert await store.get("k") is None
    assert (await store.stats())["memory_entries"] == 0


async def test_an_entry_expires_on_the_disk_path_after_a_reopen(store_dir: Path) -> None:
    first = open_store(store_dir)
    await first.put("k", answer(ttl_s=0.2))
    first.close()
    await asyncio.sleep(0.3)
    second = open_store(store_dir)
    try:
        assert await second.get("k") is None
        assert second.get_memory("k") is None
    finally:
        second.close()


async def test_the_store_checks_expires_at_itself_on_the_disk_path(store_dir: Path) -> None:
    # An entry whose diskcache expiry is still ahead (or absent) but whose own expires_at has passed: the
    # stored deadline is the one that counts, so a clock jump or an older writer cannot serve a stale answer.
    with diskcache.Cache(str(store_dir)) as raw:
        raw.set("k", msgspec.msgpack.encode(answer(ttl_s=-5.0)))
    store = open_store(store_dir)
    try:
        assert await store.get("k") is None
        assert store.get_memory("k") is None
    finally:
        store.close()


# --- LRU eviction on disk ---------------------------------------------------------------------------------------

BIG = 40_000  # above diskcache's 32 KiB inline limit, so every value is a file counted in the volume


async def test_disk_eviction_is_lru_a_recently_read_entry_survives(store_dir: Path) -> None:
    # memory_bytes=1: the memory tier keeps nothing, so every read reaches diskcache and refreshes its access time.
    store = open_store(store_dir, disk_bytes=1_000_000, memory_bytes=1)
    try:
        await store.put("old-unread", answer("o" * BIG))
        await store.put("hot", answer("h" * BIG))
        await asyncio.sleep(0.01)  # distinct access times for diskcache's LRU ordering
        for n in range(200):
            await store.put(f"filler{n}", answer("x" * BIG))
            assert await store.get("hot") is not None, f"the recently read entry was evicted after {n} writes"
            if (await store.stats())["entries"] < n + 3:  # something was evicted (found without reading it)
                break
        else:
            raise AssertionError("the disk budget never evicted anything")
        assert await store.get("old-unread") is None
        assert await store.get("hot") is not None
        stats = await store.stats()
        assert stats["bytes"] <= stats["budget_bytes"] + 2 * BIG
        assert stats["budget_bytes"] == 1_000_000
    finally:
        store.close()


async def test_disk_eviction_sees_reads_served_by_the_memory_tier(store_dir: Path) -> None:
    # BUG: edgecache/stores/disk.py DiskResultStore.get (memory tier short-circuit) — a hit served from
    # MemoryLRU never touches diskcache, so the disk's access time of a hot entry stays at its write time and
    # "least-recently-used" on disk degenerates to least-recently-stored: the hot entry is evicted from disk
    # (lost on the next restart) while entries written after it but never read survive. The comment in
    # __init__ ("a hot FAQ answer must outlive a one-off") is not met when memory_bytes holds the entry.
    store = open_store(store_dir, disk_bytes=1_000_000, memory_bytes=8 * MiB)
    try:
        await store.put("hot", answer("h" * BIG))
        for n in range(200):
            await store.put(f"filler{n}", answer("x" * BIG))
            assert await store.get("hot") is not None  # served from memory
            if (await store.stats())["entries"] < n + 2:
                break
        else:
            raise AssertionError("the disk budget never evicted anything")
    finally:
        store.close()
    reopened = open_store(store_dir, disk_bytes=1_000_000, memory_bytes=8 * MiB)
    try:
        assert await reopened.get("hot") is not None, "the most read entry was evicted from disk"
    finally:
        reopened.close()


# --- MemoryLRU -------------------------------------------------------------------------------------------------


def test_memory_lru_evicts_the_least_recently_used_entry_past_its_byte_bound() -> None:
    lru = MemoryLRU(max_bytes=300)
    now = time.time()
    lru.put("a", answer("a"), 100)
    lru.put("b", answer("b"), 100)
    lru.put("c", answer("c"), 100)
    assert lru.bytes == 300 and len(lru) == 3
    assert lru.get("a", now) is not None  # a is now the most recently used; b the least
    lru.put("d", answer("d"), 100)
    assert lru.get("b", now) is None
    assert [k for k in "acd" if lru.get(k, now) is not None] == ["a", "c", "d"]
    assert lru.bytes == 300 and len(lru) == 3


def test_memory_lru_evicts_as_many_as_needed_for_a_big_entry() -> None:
    lru = MemoryLRU(max_bytes=300)
    now = time.time()
    for k in "abc":
        lru.put(k, answer(k), 100)
    lru.put("big", answer("big"), 250)
    assert lru.get("big", now) is not None
    assert len(lru) == 1 and lru.bytes == 250


def test_memory_lru_skips_an_entry_larger_than_its_bound() -> None:
    lru = MemoryLRU(max_bytes=100)
    now = time.time()
    lru.put("a", answer("a"), 50)
    lru.put("huge", answer("huge"), 101)
    assert lru.get("huge", now) is None
    assert lru.get("a", now) is not None  # a huge entry does not flush the small ones
    assert lru.bytes == 50


def test_memory_lru_replacing_a_key_counts_its_bytes_once() -> None:
    lru = MemoryLRU(max_bytes=1000)
    lru.put("a", answer("one"), 100)
    lru.put("a", answer("two"), 200)
    assert len(lru) == 1 and lru.bytes == 200
    got = lru.get("a", time.time())
    assert got is not None and got.text == "two"
    lru.pop("a")
    lru.pop("a")  # popping a missing key is harmless
    assert len(lru) == 0 and lru.bytes == 0


def test_memory_lru_drops_an_expired_entry_on_get() -> None:
    lru = MemoryLRU(max_bytes=1000)
    now = time.time()
    lru.put("a", answer(ttl_s=10.0, now=now), 100)
    assert lru.get("a", now + 5) is not None
    assert lru.get("a", now + 10) is None  # expires_at is exclusive
    assert len(lru) == 0 and lru.bytes == 0


def test_memory_lru_clear() -> None:
    lru = MemoryLRU(max_bytes=1000)
    lru.put("a", answer(), 100)
    lru.clear()
    assert len(lru) == 0 and lru.bytes == 0 and lru.get("a", time.time()) is None


def test_memory_tier_replays_its_reads_in_batches_kept_while_the_backend_cannot_take_them() -> None:
    batches: list[set[str]] = []
    backend_open = False

    def replay(keys: set[str]) -> bool:
        if backend_open:
            batches.append(set(keys))
        return backend_open

    tier = MemoryTier(max_bytes=10**6, replay=replay)
    batch = MemoryTier.READ_SYNC_BATCH
    for n in range(batch + 1):
        tier.put(f"k{n}", answer(), 100)
    for n in range(batch - 1):
        assert tier.get(f"k{n}") is not None
    assert tier.get("never-stored") is None and tier.peek("k0", time.time()) is not None  # neither is a read
    assert batches == []  # not a full batch yet
    assert tier.get(f"k{batch - 1}") is not None
    assert batches == []  # a full batch, but the backend refused it: kept, not lost
    backend_open = True
    assert tier.get(f"k{batch}") is not None
    assert batches == [{f"k{n}" for n in range(batch + 1)}]
    tier.replay_reads()
    assert len(batches) == 1  # nothing left to replay
    assert tier.stats() == {"memory_entries": batch + 1, "memory_bytes": (batch + 1) * 100}
    tier.forget()
    assert tier.get("k0") is None and tier.stats() == {"memory_entries": 0, "memory_bytes": 0}


def test_a_memory_tier_peek_is_no_read_to_replay_and_misses_an_expired_copy() -> None:
    replayed: list[set[str]] = []
    tier = MemoryTier(max_bytes=10**6, replay=lambda keys: replayed.append(set(keys)) or True)
    now = time.time()
    tier.put("live", answer("here"), 100)
    tier.put("old", answer("gone", ttl_s=1.0, now=now - 2), 100)
    for _ in range(MemoryTier.READ_SYNC_BATCH + 1):
        assert tier.peek("live", now).text == "here"  # type: ignore[union-attr]
    assert tier.peek("old", now) is None and tier.peek("never-stored", now) is None
    tier.replay_reads()
    assert replayed == []
    assert tier.get("live") is not None
    tier.replay_reads()
    assert replayed == [{"live"}]  # whereas a get is one


# --- corrupt entries -------------------------------------------------------------------------------------------


async def test_a_corrupt_entry_reads_as_a_miss_and_is_deleted(store_dir: Path) -> None:
    with diskcache.Cache(str(store_dir)) as raw:
        raw.set("k", b"\x93garbage that is not a CachedAnswer")
    store = open_store(store_dir)
    try:
        assert await store.get("k") is None
        assert (await store.stats())["entries"] == 0
    finally:
        store.close()
    with diskcache.Cache(str(store_dir)) as raw:
        assert "k" not in raw


async def test_an_entry_of_another_layout_reads_as_a_miss_and_is_deleted(store_dir: Path) -> None:
    # Valid msgpack, wrong shape (e.g. an older version stored a map).
    with diskcache.Cache(str(store_dir)) as raw:
        raw.set("k", msgspec.msgpack.encode({"text": "old", "finish_reason": "stop"}))
    store = open_store(store_dir)
    try:
        assert await store.get("k") is None
        assert (await store.stats())["entries"] == 0
    finally:
        store.close()


async def test_a_non_bytes_entry_reads_as_a_miss_and_is_deleted(store_dir: Path) -> None:
    # BUG: edgecache/stores/disk.py DiskResultStore.get catches only msgspec.DecodeError around
    # self._decoder.decode(raw); an entry diskcache returns as a non-bytes object (a str or a pickled dict
    # written by another version or tool) raises TypeError there, so the request fails with a 500 instead of
    # being a miss, and the entry is never dropped.
    with diskcache.Cache(str(store_dir)) as raw:
        raw.set("k", "a str written by an older version")
    store = open_store(store_dir)
    try:
        assert await store.get("k") is None
        assert (await store.stats())["entries"] == 0
    finally:
        store.close()


async def test_get_many_reads_every_damaged_entry_as_a_miss_and_drops_it(store_dir: Path) -> None:
    # What get does for one entry, in one batched read (a warmup's): garbage, another layout, a non-bytes value.
    with diskcache.Cache(str(store_dir)) as raw:
        raw.set("garbage", b"\x93garbage that is not a CachedAnswer")
        raw.set("layout", msgspec.msgpack.encode({"text": "old", "finish_reason": "stop"}))
        raw.set("str", "a str written by an older version")
    store = open_store(store_dir)
    try:
        await store.put("good", answer("kept"))
        store.forget_memory()
        got = await store.get_many(["garbage", "good", "layout", "str", "absent"])
        assert [None if a is None else a.text for a in got] == [None, "kept", None, None, None]
        stats = await store.stats()
        assert stats["entries"] == 1 and stats["dropped_unreadable"] == 3
    finally:
        store.close()


# --- stats, clear, close ---------------------------------------------------------------------------------------


async def test_stats_count_entries_and_bytes(store_dir: Path) -> None:
    store = open_store(store_dir, disk_bytes=50 * MiB, memory_bytes=2 * MiB)
    try:
        empty = await store.stats()
        assert empty["entries"] == 0 and empty["memory_entries"] == 0 and empty["memory_bytes"] == 0
        assert empty["budget_bytes"] == 50 * MiB
        await store.put("a", answer("x" * BIG))
        await store.put("b", answer("short"))
        stats = await store.stats()
        assert stats["entries"] == 2
        assert stats["memory_entries"] == 2
        assert stats["memory_bytes"] > BIG
        assert stats["bytes"] >= empty["bytes"] + BIG
    finally:
        store.close()


async def test_clear_empties_both_tiers(store: DiskResultStore) -> None:
    await store.put("a", answer())
    await store.put("b", answer())
    assert await store.clear() == 2
    assert store.get_memory("a") is None
    assert await store.get("a") is None and await store.get("b") is None
    stats = await store.stats()
    assert stats["entries"] == 0 and stats["memory_entries"] == 0 and stats["memory_bytes"] == 0


async def test_clear_is_durable_across_a_reopen(store_dir: Path) -> None:
    first = open_store(store_dir)
    await first.put("a", answer())
    await first.clear()
    first.close()
    second = open_store(store_dir)
    try:
        assert await second.get("a") is None
    finally:
        second.close()


async def test_close_twice_is_safe(store_dir: Path) -> None:
    store = open_store(store_dir)
    await store.put("a", answer())
    store.close()
    store.close()


# --- an answer served for another max_tokens (serve_within) ---------------------------------------------------


def tokens(*pieces: str, finish: str = "stop", max_tokens: int = 16, text: str | None = None,
           stop_sequence: str | None = None) -> CachedAnswer:
    """An answer of these token pieces; ``text``: the stored text when a stop string cut it."""
    ends, total = [], 0
    for piece in pieces:
        total += len(piece.encode())
        ends.append(total)
    now = time.time()
    return CachedAnswer(text="".join(pieces) if text is None else text, finish_reason=finish, prompt_tokens=3,
                        completion_tokens=len(pieces), created_at=now, expires_at=now + 60,
                        stop_sequence=stop_sequence, token_ends=tuple(ends), max_tokens=max_tokens)


def test_an_answer_that_ended_by_itself_serves_any_larger_max_tokens_whole() -> None:
    stored = tokens("Paris", " is", " nice", ".")
    assert serve_within(stored, 5) is stored and serve_within(stored, 300) is stored


def test_a_smaller_max_tokens_is_served_the_first_tokens_with_finish_length() -> None:
    stored = tokens("Paris", " is", " nice", ".")
    cut = serve_within(stored, 2)
    assert cut is not None
    assert (cut.text, cut.finish_reason, cut.completion_tokens, cut.token_ends) == ("Paris is", "length", 2, (5, 8))
    assert (cut.prompt_tokens, cut.created_at, cut.expires_at) == (stored.prompt_tokens, stored.created_at,
                                                                 stored.expires_at)


def test_max_tokens_equal_to_an_answer_that_the_end_token_ended_is_cut_at_length() -> None:
    # The engine stops at the limit before it samples the end-of-sequence token: the same text, finish length.
    cut = serve_within(tokens("Paris", "."), 2)
    assert cut is not None and (cut.text, cut.finish_reason) == ("Paris.", "length")


def test_an_answer_that_ended_at_its_limit_serves_only_limits_it_covers() -> None:
    stored = tokens("a", "b", "c", finish="length", max_tokens=3)
    assert serve_within(stored, 4) is None and serve_within(stored, 48) is None
    assert serve_within(stored, 3) is stored
    cut = serve_within(stored, 1)
    assert cut is not None and (cut.text, cut.finish_reason, cut.completion_tokens) == ("a", "length", 1)


def test_an_answer_the_context_ended_serves_larger_limits() -> None:
    # 3 tokens under a limit of 10 and finish length: the context had no more room, and will not for a larger one.
    stored = tokens("a", "b", "c", finish="length", max_tokens=10)
    assert serve_within(stored, 48) is stored


def test_a_stop_string_answer_serves_its_own_count_whole_and_no_cut_past_the_stored_text() -> None:
    # Tokens "Hi", "!\n", "\nBye": stop "\n\n" matched in the third token, the text cut at its start.
    stored = tokens("Hi", "!\n", "\nBye", text="Hi!", stop_sequence="\n\n")
    assert serve_within(stored, 3) is stored and serve_within(stored, 9) is stored
    # Cut after the second token the engine writes "Hi!\n" (the held-back "\n" is sent at the end): not stored.
    assert serve_within(stored, 2) is None
    first = serve_within(stored, 1)
    assert first is not None and (first.text, first.finish_reason, first.stop_sequence) == ("Hi", "length", None)


def test_a_cut_inside_a_character_ends_in_a_replacement_character() -> None:
    e_acute = "é".encode()
    now = time.time()
    stored = CachedAnswer(text="café!", finish_reason="stop", prompt_tokens=1, completion_tokens=3, created_at=now,
                          expires_at=now + 60, token_ends=(4, 5, 6), max_tokens=16)  # "caf"+é's 1st byte, rest, "!"
    cut = serve_within(stored, 1)
    assert cut is not None and cut.text == "caf\ufffd"
    # What an incremental decoder writes when told the bytes ended there: the engine's own words.
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    assert decoder.decode(b"caf" + e_acute[:1]) + decoder.decode(b"", final=True) == cut.text
    assert serve_within(stored, 2) is not None and serve_within(stored, 2).text == "café"  # type: ignore[union-attr]


def test_answers_without_token_ends_are_never_cut() -> None:
    assert serve_within(answer(), 1) is None
    assert serve_within(answer(), 100) is None


def test_answers_stored_before_token_ends_existed_still_decode() -> None:
    old = msgspec.msgpack.encode([  # the array a CachedAnswer was stored as before its last two fields
        "hello", "stop", 3, 2, 1.0, 2.0, None, None])
    decoded = msgspec.msgpack.decode(old, type=CachedAnswer)
    assert (decoded.text, decoded.token_ends, decoded.max_tokens) == ("hello", None, 0)
