"""The prefix states' tiers (edgecache/engines/kv_tiers.py) on real files, without a model: restart, isolation by
salt and by context, checked and atomic writes (a kill -9 mid-write, a damaged file, a full disk), budgets per tenant
and per box, least recently used first with kept states last, superseding, flushes, and why a prefix was missed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edgecache.engines.kv_tiers import EVICTED_DISK, EVICTED_RAM, NEVER_SEEN, TieredPrefixCache

CONTEXT = '{"weights": "m@1", "n_ctx": 4096}'
MiB = 2**20


def tokens(*runs: tuple[int, int]) -> np.ndarray:
    """Token ids: each run ``(start, count)`` is start, start+1, ..."""
    return np.concatenate([np.arange(a, a + n) for a, n in runs]).astype(np.intc)


def kv(n: int, fill: int) -> bytearray:
    return bytearray(bytes([fill % 256]) * n)


class Faults:
    """What /health shows: failing from a fault until the next success (as edgecache.health.StorageFaults)."""

    def __init__(self) -> None:
        self.recorded: list[str] = []
        self.failing = False

    def record(self, component: str, exc: BaseException, *, action: str, path: object = None) -> None:
        self.recorded.append(f"{component}: {exc} ({action})")
        self.failing = True

    def recovered(self, component: str) -> None:
        self.failing = False


def open_cache(root: Path, **kw: object) -> TieredPrefixCache:
    options: dict[str, object] = {"ram_bytes": 64 * MiB, "disk_bytes": 256 * MiB, "root": root, "context": CONTEXT}
    options.update(kw)
    return TieredPrefixCache(**options)  # type: ignore[arg-type]


def test_a_state_outlives_a_restart_and_comes_back_checked_from_disk(tmp_path: Path) -> None:
    cache = open_cache(tmp_path)
    prompt = tokens((1, 500))
    cache.put("acme", prompt, kv(MiB, 7))
    cache.drain()
    cache.close()

    again = open_cache(tmp_path)
    assert again.figures()["prefix_cache_disk_entries"] == 1 and again.figures()["prefix_cache_ram_entries"] == 0
    found = again.best("acme", list(tokens((1, 500), (9000, 20))))
    assert found is not None and found.length == 500 and found.tier == "disk"
    assert again.load(found) == kv(MiB, 7)
    assert again.figures()["prefix_cache_hits_disk"] == 1
    promoted = again.best("acme", list(prompt))
    assert promoted is not None and promoted.tier == "ram"  # a disk hit is promoted to RAM
    again.close()


def test_no_salt_ever_finds_another_salts_state_in_any_tier_even_after_a_restart(tmp_path: Path) -> None:
    cache = open_cache(tmp_path)
    prompt = tokens((1, 300))
    cache.put("acme", prompt, kv(MiB, 1))
    assert cache.best("beta", list(prompt)) is None
    assert cache.best("acme:own-salt", list(prompt)) is None  # a caller's own salt is a namespace of its own
    cache.drain()
    cache.close()
    again = open_cache(tmp_path)
    assert again.best("beta", list(prompt)) is None
    assert again.best("acme", list(prompt)) is not None
    again.close()


def test_a_file_moved_under_another_tenant_is_dropped_as_damaged(tmp_path: Path) -> None:
    cache = open_cache(tmp_path)
    cache.put("acme", tokens((1, 300)), kv(MiB, 1))
    cache.put("beta", tokens((5000, 300)), kv(MiB, 2))
    cache.drain()
    cache.close()
    files = {p.parent.name: p for p in tmp_path.rglob("*.kv")}
    assert len(files) == 2
    (acme_file, beta_file) = sorted(files.values(), key=lambda p: p.stat().st_ino)[:2]
    # Tenant beta's directory gets acme's file under beta's own file name: its header still says acme.
    os.replace(acme_file, beta_file)
    again = open_cache(tmp_path)
    assert again.best("beta", list(tokens((1, 300)))) is None
    assert again.best("acme", list(tokens((1, 300)))) is None
    assert again.figures()["prefix_cache_disk_damaged"] == 1 and not list(tmp_path.rglob("*.kv"))
    again.close()


def test_a_state_of_another_model_or_context_is_never_listed_and_goes_first_when_space_is_short(
        tmp_path: Path) -> None:
    cache = open_cache(tmp_path)
    cache.put("acme", tokens((1, 300)), kv(MiB, 1))
    cache.drain()
    cache.close()
    other = open_cache(tmp_path, context='{"weights": "m@2", "n_ctx": 4096}', disk_bytes=3 * MiB)
    assert other.best("acme", list(tokens((1, 300)))) is None
    assert other.figures()["prefix_cache_disk_entries"] == 0
    other.put("acme", tokens((1, 300)), kv(MiB, 2))
    other.put("acme", tokens((7000, 300)), kv(MiB, 3))
    other.drain()
    assert len(list(tmp_path.iterdir())) == 1  # the old context's directory went to make room
    other.close()


def test_a_torn_or_damaged_file_is_dropped_and_counted_never_loaded(tmp_path: Path) -> None:
    cache = open_cache(tmp_path)
    cache.put("acme", tokens((1, 300)), kv(MiB, 1))
    cache.put("acme", tokens((9000, 300)), kv(MiB, 2))
    cache.drain()
    cache.close()
    first, second = sorted(tmp_path.rglob("*.kv"))
    with first.open("r+b") as f:  # cut short
        f.truncate(first.stat().st_size - 100)
    raw = bytearray(second.read_bytes())
    raw[-10] ^= 0xFF  # one byte of its KV flipped: the size still fits, the checksum does not
    second.write_bytes(raw)
    faults = Faults()
    again = open_cache(tmp_path, faults=faults)
    assert again.figures()["prefix_cache_disk_damaged"] == 1  # the short one, at start
    flipped = again.best("acme", list(tokens((1, 300)))) or again.best("acme", list(tokens((9000, 300))))
    assert flipped is not None
    assert again.load(flipped) is None
    assert again.figures()["prefix_cache_disk_damaged"] == 2 and not list(tmp_path.rglob("*.kv"))
    assert again.best("acme", list(flipped.entry.tokens)) is None
    again.close()


WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import numpy as np
    from edgecache.engines.kv_tiers import TieredPrefixCache
    cache = TieredPrefixCache(ram_bytes=1 << 30, disk_bytes=8 << 30, root=Path(sys.argv[1]), context="c")
    for i in range(1000):
        cache.put("acme", np.arange(i * 1000, i * 1000 + 400, dtype=np.intc), bytearray(b"x" * (48 << 20)))
        cache.drain()
        cache._ram.clear(); cache._ram_by_tenant.clear()
        for entry in list(cache.entries()):
            entry.data = None
""")


def test_a_kill_9_mid_write_never_leaves_a_state_that_loads_torn(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=Path(__file__).parent.parent)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until a write is under way, after at least one finished
            if list(tmp_path.rglob("*.tmp-*")) and list(tmp_path.rglob("*.kv")):
                break
            time.sleep(0.005)
        else:
            pytest.fail("the writer never wrote")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    written = list(tmp_path.rglob("*.kv"))
    cache = TieredPrefixCache(ram_bytes=1 << 30, disk_bytes=8 << 30, root=tmp_path, context="c")
    assert not list(tmp_path.rglob("*.tmp-*"))  # what the kill cut short is gone
    assert cache.figures()["prefix_cache_disk_entries"] == len(written) >= 1
    for entry in list(cache.entries()):
        found = cache.best("acme", list(entry.tokens))
        assert found is not None and cache.load(found) == bytearray(b"x" * (48 << 20))
    assert cache.figures()["prefix_cache_disk_damaged"] == 0
    cache.close()


def test_a_full_disk_keeps_states_in_ram_shows_degraded_and_recovers_by_itself(tmp_path: Path) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True,
                          check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.decode().strip()}")
    try:
        faults = Faults()
        cache = open_cache(mount, faults=faults)
        cache.put("acme", tokens((1, 100)), kv(MiB, 1))
        cache.drain()
        assert cache.figures()["prefix_cache_disk_entries"] == 1 and not faults.recorded
        cache.put("acme", tokens((5000, 100)), kv(2 * MiB, 2))  # does not fit what is left
        cache.drain()
        figures = cache.figures()
        assert figures["prefix_cache_disk_write_failures"] == 1 and "No space left" in faults.recorded[0]
        assert faults.failing
        found = cache.best("acme", list(tokens((5000, 100))))
        assert found is not None and found.tier == "ram" and cache.load(found) == kv(2 * MiB, 2)
        assert not list(mount.rglob("*.tmp-*"))
        cache.drop_tenant("acme")  # space comes back
        cache.put("acme", tokens((8000, 100)), kv(MiB, 3))
        cache.drain()
        assert not faults.failing and cache.figures()["prefix_cache_disk_entries"] == 1
        cache.close()
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_data_dir_that_cannot_hold_the_tier_leaves_states_in_ram_and_says_so(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    faults = Faults()
    cache = open_cache(blocker / "kv", faults=faults)
    assert faults.failing and cache.disk_budget == 0
    cache.put("acme", tokens((1, 100)), kv(MiB, 1))
    found = cache.best("acme", list(tokens((1, 100))))
    assert found is not None and found.tier == "ram"
    cache.close()


def test_budgets_per_tenant_and_per_box_least_recently_used_first(tmp_path: Path) -> None:
    shares = {"acme": 0.5, "beta": 0.5}
    cache = open_cache(tmp_path, ram_bytes=4 * MiB + 40_000, disk_bytes=0, share_for=shares.__getitem__)
    for i in range(5):  # one tenant, many salts: its share bounds all of them together
        cache.put(f"acme:salt{i}", tokens((i * 1000, 100)), kv(MiB, i))
    usage = cache.usage()
    assert usage["acme"]["ram"] <= 2 * MiB + 20_000 and cache.figures()["prefix_cache_ram_entries"] == 2
    assert cache.best("acme:salt4", list(tokens((4000, 100)))) is not None  # the newest stayed
    assert cache.best("acme:salt0", list(tokens((0, 100)))) is None
    found = cache.best("acme:salt3", list(tokens((3000, 100))))
    assert found is not None
    cache.load(found)  # salt3 is now the more recently used
    cache.put("acme:salt5", tokens((5000, 100)), kv(MiB, 5))
    assert cache.best("acme:salt3", list(tokens((3000, 100)))) is not None
    assert cache.best("acme:salt4", list(tokens((4000, 100)))) is None
    for i in range(2):
        cache.put("beta", tokens((20000 + i * 1000, 100)), kv(MiB, i))
    assert sum(cache.figures()[k] for k in ("prefix_cache_ram_bytes",)) <= 4 * MiB + 40_000
    assert cache.figures()["kv_usage_ratio"] <= 1.0


def test_a_state_a_client_asked_to_keep_goes_after_the_others(tmp_path: Path) -> None:
    clock = [1000.0]
    cache = open_cache(tmp_path, ram_bytes=3 * MiB + 30_000, disk_bytes=0, clock=lambda: clock[0])
    cache.put("acme", tokens((1, 100)), kv(MiB, 1), keep_s=300)
    cache.put("acme", tokens((1000, 100)), kv(MiB, 2))
    cache.put("acme", tokens((2000, 100)), kv(MiB, 3))
    cache.put("acme", tokens((3000, 100)), kv(MiB, 4))
    assert cache.best("acme", list(tokens((1, 100)))) is not None  # kept, though least recently used
    assert cache.best("acme", list(tokens((1000, 100)))) is None
    clock[0] += 301  # its ttl is over: it goes like any other
    cache.put("acme", tokens((4000, 100)), kv(MiB, 5))
    assert cache.best("acme", list(tokens((1, 100)))) is None


def test_a_longer_state_supersedes_the_one_it_extends_but_not_a_kept_breakpoint(tmp_path: Path) -> None:
    cache = open_cache(tmp_path)
    system = tokens((1, 200))
    cache.put("acme", system, kv(MiB, 1), keep_s=300, anchor=True)  # a breakpoint at the system prompt's end
    turn1 = tokens((1, 200), (500, 100))
    cache.put("acme", turn1, kv(MiB, 2))
    turn2 = tokens((1, 200), (500, 100), (900, 50))
    cache.put("acme", turn2, kv(MiB, 3))
    cache.drain()
    kept = {len(e.tokens) for e in cache.entries()}
    assert kept == {200, 350}  # turn 1's state went (turn 2's holds it), the breakpoint's stayed
    assert len(list(tmp_path.rglob("*.kv"))) == 2
    cache.close()


def test_a_state_pushed_out_of_ram_while_its_write_is_under_way_is_still_served(tmp_path: Path) -> None:
    cache = open_cache(tmp_path, ram_bytes=2 * MiB + 20_000)
    gate = threading.Event()
    write = cache._write
    cache._write = lambda entry, data: (gate.wait(10), write(entry, data))  # type: ignore[method-assign]
    for i in range(3):
        cache.put("acme", tokens((i * 1000 + 1, 200)), kv(MiB, i))
    assert cache.figures()["prefix_cache_ram_entries"] == 2
    found = cache.best("acme", list(tokens((1, 200))))
    assert found is not None and found.tier == "ram" and cache.load(found) == kv(MiB, 0)
    gate.set()
    cache.drain()
    assert cache.figures()["prefix_cache_disk_entries"] == 3 and cache.figures()["prefix_cache_disk_damaged"] == 0
    cache.close()


def test_ram_only_states_are_never_written(tmp_path: Path) -> None:
    cache = open_cache(tmp_path)
    cache.put("acme", tokens((1, 200)), kv(MiB, 1), disk=False)
    cache.drain()
    assert not list(tmp_path.rglob("*.kv"))
    cache.close()
    assert open_cache(tmp_path).best("acme", list(tokens((1, 200)))) is None


def test_a_tenant_flush_drops_its_states_in_every_tier_and_no_one_elses(tmp_path: Path) -> None:
    cache = open_cache(tmp_path)
    cache.put("acme", tokens((1, 200)), kv(MiB, 1))
    cache.put("acme:own", tokens((3000, 200)), kv(MiB, 1))
    cache.put("beta", tokens((1, 200)), kv(MiB, 2))
    cache.drain()
    assert cache.drop_tenant("acme") == 2
    assert cache.best("acme", list(tokens((1, 200)))) is None
    assert cache.best("acme:own", list(tokens((3000, 200)))) is None
    cache.close()
    again = open_cache(tmp_path)
    assert again.best("acme", list(tokens((1, 200)))) is None
    assert again.best("beta", list(tokens((1, 200)))) is not None
    assert set(again.usage()) == {"beta"}
    again.close()


def test_why_a_prefix_was_missed(tmp_path: Path) -> None:
    ram_only = open_cache(tmp_path / "a", ram_bytes=2 * MiB + 20_000, disk_bytes=0)
    first = tokens((1, 200))
    assert ram_only.miss_reason("acme", list(first), 0, min_tokens=64) == NEVER_SEEN
    ram_only.put("acme", first, kv(MiB, 1))
    ram_only.put("acme", tokens((1000, 200)), kv(MiB, 2))
    ram_only.put("acme", tokens((2000, 200)), kv(MiB, 3))  # pushes the first out, with no disk copy
    assert ram_only.best("acme", list(first)) is None
    assert ram_only.miss_reason("acme", list(first), 0, min_tokens=64) == EVICTED_RAM
    assert ram_only.miss_reason("beta", list(first), 0, min_tokens=64) == NEVER_SEEN

    tiered = open_cache(tmp_path / "b", ram_bytes=2 * MiB + 20_000, disk_bytes=2 * MiB + 20_000)
    for i in range(3):
        tiered.put("acme", tokens((i * 1000 + 1, 200)), kv(MiB, i))
    tiered.drain()
    assert tiered.best("acme", list(tokens((1, 200)))) is None
    assert tiered.miss_reason("acme", list(tokens((1, 200))), 0, min_tokens=64) == EVICTED_DISK
    # A state that holds part of the prompt: not a miss unless a lost one held more.
    assert tiered.miss_reason("acme", list(tokens((2001, 200))), 200, min_tokens=64) is None
    tiered.close()
