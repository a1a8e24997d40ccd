"""Damaged and full storage: each corruption is found at open, moved aside with its path reported and rebuilt from
what remains (or refused with what to do); the semantic layer failing leaves the exact layer serving; /health tells
the truth. Real SQLite, real usearch, real diskcache files, damaged on purpose."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgecache.http.app import create_app
from edgecache.health import Health, HealthChecks, StorageFaults, fault_kind
from edgecache.metrics import Metrics
from edgecache.semantic.index import SemanticIndex
from tests.conftest import chat_body, serve_in_process
from tests.fakes import FakeEngine

DIM = 8
VERSION = "test-v1"


def unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def filled_index(root: Path, n: int) -> Path:
    """An index of ``n`` vectors under ``root``, saved and closed; returns its mapping's path."""
    ix = SemanticIndex(root, dim=DIM, embedder_version=VERSION)
    ix.add_many("t", "s", np.stack([unit(i) for i in range(n)]), [f"store-{i}" for i in range(n)],
                [f"text {i}" for i in range(n)])
    ix.close()
    mapping = ix.mapping_path
    con = sqlite3.connect(mapping)  # fold the WAL into the main file, as a clean shutdown leaves it
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    return mapping


def reopen(root: Path) -> SemanticIndex:
    return SemanticIndex(root, dim=DIM, embedder_version=VERSION, damaged_dir=root / "damaged")


def moved_aside(root: Path) -> list[Path]:
    return sorted((root / "damaged").iterdir()) if (root / "damaged").is_dir() else []


@pytest.mark.parametrize("damage", ["garbage", "truncated", "directory"])
def test_a_damaged_mapping_is_moved_aside_reported_and_the_index_works(tmp_path: Path, damage: str) -> None:
    mapping = filled_index(tmp_path, 50)
    if damage == "garbage":
        mapping.write_bytes(b"this is not a database" * 200)
    elif damage == "truncated":
        with mapping.open("r+b") as f:
            f.truncate(mapping.stat().st_size // 3)
    else:
        mapping.unlink()
        mapping.mkdir()
    ix = reopen(tmp_path)
    try:
        assert len(ix.repairs) == 1 and str(mapping) in ix.repairs[0]
        assert moved_aside(tmp_path) and str(moved_aside(tmp_path)[0]) in ix.repairs[0]
        assert ix.mapping_path.is_file()
        key = ix.add("t", "s", unit(999), "store-new", "new text")
        assert ix.search("t", "s", unit(999), k=1)[0].vector_key == key
    finally:
        ix.close()


def test_a_mapping_emptied_to_zero_bytes_reports_the_vectors_it_loses(tmp_path: Path) -> None:
    mapping = filled_index(tmp_path, 40)
    mapping.write_bytes(b"")
    ix = reopen(tmp_path)
    try:
        # Not silent: the 40 vectors still in the index file are counted in the report, and the files moved aside.
        assert len(ix.repairs) == 1 and "40 vectors" in ix.repairs[0] and str(mapping) in ix.repairs[0]
        assert ix.sizes() == {}
        assert any(moved_aside(tmp_path)[0].rglob("*.usearch"))
    finally:
        ix.close()


def test_a_partly_damaged_mapping_keeps_every_row_it_can_read(tmp_path: Path) -> None:
    mapping = filled_index(tmp_path, 3000)
    size = mapping.stat().st_size
    with mapping.open("r+b") as f:  # overwrite the last pages: the rows before them stay readable
        f.seek(size - 8 * 4096)
        f.write(b"\xff" * 8 * 4096)
    ix = reopen(tmp_path)
    try:
        assert len(ix.repairs) == 1
        kept = sum(ix.sizes().values())
        assert f"kept {kept} vectors" in ix.repairs[0]
        assert 0 < kept < 3000
        hit = ix.search("t", "s", unit(0), k=1)[0]
        assert hit.store_key == "store-0" and hit.similarity > 0.97
    finally:
        ix.close()


def test_a_healthy_mapping_is_not_touched(tmp_path: Path) -> None:
    filled_index(tmp_path, 10)
    ix = reopen(tmp_path)
    try:
        assert ix.repairs == [] and not moved_aside(tmp_path)
        assert ix.sizes() == {("t", "s"): 10}
    finally:
        ix.close()


def test_add_many_keeps_keys_unique_after_removals_and_honours_the_cap(tmp_path: Path) -> None:
    ix = SemanticIndex(tmp_path, dim=DIM, embedder_version=VERSION, max_vectors=100)
    try:
        first = ix.add_many("t", "s", np.stack([unit(i) for i in range(60)]), [f"a{i}" for i in range(60)],
                            [f"a{i}" for i in range(60)])
        ix.remove("t", "s", first[-10:])  # the highest keys are gone; they must never be handed out again
        second = ix.add_many("t", "s", np.stack([unit(100 + i) for i in range(60)]),
                             [f"b{i}" for i in range(60)], [f"b{i}" for i in range(60)])
        assert min(second) > max(first)
        assert ix.sizes() == {("t", "s"): 100}  # 50 + 60 over a cap of 100: the 10 oldest went
        assert ix.search("t", "s", unit(0), k=1)[0].store_key != "a0"
        assert ix.search("t", "s", unit(159), k=1)[0].store_key == "b59"
    finally:
        ix.close()


# ---- health and fault accounting ----


def test_health_is_the_worst_component_with_every_reason() -> None:
    checks = HealthChecks()
    checks.register("a", lambda: Health("ready"))
    checks.register("b", lambda: Health("degraded", "half the disk is gone"))
    overall, components = checks.report()
    assert overall.status == "degraded" and overall.serving and "b: half the disk is gone" in overall.reason
    checks.register("c", lambda: Health("loading", "warming"))
    assert checks.report()[0].status == "loading" and not checks.report()[0].serving
    assert set(components) == {"a", "b"}


def test_storage_faults_count_every_failure_log_once_per_interval_and_recover(caplog: Any) -> None:
    metrics = Metrics()
    now = [0.0]
    faults = StorageFaults(metrics.storage_failures, log_interval_s=60, clock=lambda: now[0])
    full = OSError(28, "No space left on device")
    for _ in range(100):
        faults.record("results", full, action="write skipped", path="/data/x")
    assert sum(1 for r in caplog.records if "write skipped" in r.getMessage()) == 1
    assert faults.check("results")().status == "degraded"
    now[0] = 61
    faults.record("results", full, action="write skipped")
    logged = [r.getMessage() for r in caplog.records if "write skipped" in r.getMessage()]
    assert len(logged) == 2 and "99 more" in logged[1]
    assert 'edgecache_storage_failures_total{component="results",kind="disk_full"} 101.0' in \
        metrics.render().decode()
    faults.recovered("results")
    assert faults.check("results")().status == "ready"


def test_fault_kinds() -> None:
    assert fault_kind(OSError(28, "No space left on device")) == "disk_full"
    assert fault_kind(sqlite3.OperationalError("database or disk is full")) == "disk_full"
    assert fault_kind(sqlite3.DatabaseError("file is not a database")) == "damaged"
    assert fault_kind(sqlite3.DatabaseError("database disk image is malformed")) == "damaged"
    assert fault_kind(PermissionError(13, "Permission denied")) == "io"


# ---- through the app: the semantic layer is optional ----


async def test_semantic_layer_that_cannot_open_leaves_the_exact_layer_serving(make_settings: Any) -> None:
    settings = make_settings(semantic__enabled=True)
    settings.data_path.mkdir(parents=True)
    (settings.data_path / "semantic").write_text("a file where the semantic directory should be")
    engine = FakeEngine()
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        health = await c.get("/health")
        assert health.status_code == 200, health.text
        body = health.json()
        assert body["status"] == "degraded" and body["components"]["semantic"]["status"] == "degraded"
        assert "exact matches only" in body["reason"]
        first = await c.post("/v1/chat/completions", json=chat_body("How do I reset my password?"))
        again = await c.post("/v1/chat/completions", json=chat_body("How do I reset my password?"))
        assert (first.status_code, again.status_code) == (200, 200)
        assert (first.headers["x-edgecache"], again.headers["x-edgecache"]) == ("miss", "exact")
        assert engine.calls == 1


async def test_a_damaged_mapping_at_start_is_reported_on_health_and_metrics(make_settings: Any) -> None:
    settings = make_settings(semantic__enabled=True)
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        assert (await c.post("/v1/chat/completions", json=chat_body("What is your refund policy?"))).status_code \
            == 200
    [mapping] = (settings.data_path / "semantic").rglob("mapping.sqlite3")
    for extra in mapping.parent.glob("mapping.sqlite3-*"):
        extra.unlink()
    mapping.write_bytes(b"\0garbage" * 1000)
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        body = (await c.get("/health")).json()
        assert body["components"]["semantic"]["status"] == "degraded"
        assert str(mapping) in body["reason"] and "damaged" in body["reason"]
        assert (settings.data_path / "damaged").is_dir()
        assert 'edgecache_storage_failures_total{component="semantic",kind="damaged"} 1.0' in (await c.get(
            "/metrics")).text
        old = await c.post("/v1/chat/completions", json=chat_body("What is your refund policy?"))
        assert (old.status_code, old.headers["x-edgecache"]) == (200, "exact")  # the result store was not touched
        new = await c.post("/v1/chat/completions", json=chat_body("Where do you ship to?"))
        assert new.status_code == 200
        # The layer writes again (the new prompt's vector is indexed after its answer is sent): /health says ready.
        for _ in range(200):
            if (await c.get("/health")).json()["status"] == "ready":
                break
            await asyncio.sleep(0.01)
        assert (await c.get("/health")).json()["status"] == "ready"


# ---- the exact result store ----


def settle_into_main_file(db: Path) -> None:
    """Every entry in the main file and no WAL beside it, as after a clean shutdown. Without this the damage done
    to the main file was not deterministic: while a checkpoint was still blocked (a closing server's store thread on
    a loaded box), the entries lived on in the WAL, which SQLite laid over the truncated file, so it read as whole."""
    for _ in range(500):
        con = sqlite3.connect(db)
        busy, wal_frames, moved = con.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        con.close()
        if busy == 0 and wal_frames == moved:
            break
        time.sleep(0.01)
    else:
        raise AssertionError(f"{db}: the WAL could not be checkpointed; a connection of the closed server is open")
    for suffix in ("-wal", "-shm"):
        db.with_name(db.name + suffix).unlink(missing_ok=True)


def store_db(settings: Any, tenant: str = "default") -> Path:
    return settings.data_path / "results" / tenant / "cache.db"


async def fill(c: Any, questions: list[str]) -> None:
    for q in questions:
        assert (await c.post("/v1/chat/completions", json=chat_body(q))).status_code == 200


def served(resp: Any) -> str:
    assert resp.status_code == 200, resp.text
    return resp.headers["x-edgecache"]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "directory"])
async def test_a_damaged_result_store_is_rebuilt_at_start_and_never_500s(make_settings: Any, damage: str) -> None:
    settings = make_settings()
    questions = [f"question number {i}" for i in range(20)]
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        await fill(c, questions)
    db = store_db(settings)
    settle_into_main_file(db)
    if damage == "truncated":
        with db.open("r+b") as f:
            f.truncate(db.stat().st_size // 2)
    elif damage == "garbage":
        db.write_bytes(b"not a database at all" * 500)
    else:
        db.unlink()
        db.mkdir()
    engine = FakeEngine()
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        for q in questions[:3]:
            assert served(await c.post("/v1/chat/completions", json=chat_body(q))) in ("exact", "miss")
        assert served(await c.post("/v1/chat/completions", json=chat_body(questions[0]))) == "exact"
        body = (await c.get("/health")).json()
        assert str(db) in body.get("reason", "") or body["status"] == "ready"  # ready again once a write succeeded
        assert 'edgecache_storage_failures_total{component="results",kind="damaged"} 1.0' in (await c.get(
            "/metrics")).text
    [moved] = [p for p in (settings.data_path / "damaged").iterdir() if p.name.endswith("cache.db")]
    assert moved.exists()


async def test_a_partly_damaged_result_store_keeps_the_readable_entries(make_settings: Any) -> None:
    settings = make_settings()
    questions = [f"a longer question, number {i}, padded so that entries fill several pages " * 3
                 for i in range(400)]
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        await fill(c, questions)
    db = store_db(settings)
    settle_into_main_file(db)
    size = db.stat().st_size
    with db.open("r+b") as f:  # damage the last pages only
        f.seek(size - 4 * 4096)
        f.write(b"\xee" * 4 * 4096)
    engine = FakeEngine()
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        first = served(await c.post("/v1/chat/completions", json=chat_body(questions[0])))
        body = (await c.get("/health")).json()
        assert first == "exact" and engine.calls == 0
        kept = int(body["reason"].split("with the ")[1].split(" entries")[0])
        assert 0 < kept < 400
        for q in questions:  # every key answers: a hit where it survived, a miss (recomputed) where not
            assert served(await c.post("/v1/chat/completions", json=chat_body(q))) in ("exact", "miss")
        assert engine.calls == 400 - kept


async def test_a_damaged_entry_reads_as_a_miss(make_settings: Any) -> None:
    settings = make_settings()
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        await fill(c, ["hello there"])
    con = sqlite3.connect(store_db(settings))
    con.execute("UPDATE Cache SET value = ?", (b"\xc1\xc1 definitely not msgpack",))
    con.commit()
    con.close()
    engine = FakeEngine()
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        assert served(await c.post("/v1/chat/completions", json=chat_body("hello there"))) == "miss"
        assert served(await c.post("/v1/chat/completions", json=chat_body("hello there"))) == "exact"
        assert engine.calls == 1


# ---- a full disk (a small tmpfs; needs root) ----


@pytest.fixture
def small_disk(tmp_path: Path):  # noqa: ANN201
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill_disk(mount: Path) -> Path:
    filler = mount / "filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


async def test_a_full_disk_answers_misses_counts_skipped_writes_and_recovers(small_disk: Path,
                                                                             make_settings: Any) -> None:
    settings = make_settings(data_dir=str(small_disk / "data"))
    engine = FakeEngine()
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        assert served(await c.post("/v1/chat/completions", json=chat_body("before the disk filled"))) == "miss"
        filler = fill_disk(small_disk)
        for i in range(30):
            assert served(await c.post("/v1/chat/completions", json=chat_body(f"while full {i} " * 200))) == "miss"
        health = await c.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert "disk full" in health.json()["reason"]
        metrics = (await c.get("/metrics")).text
        assert 'edgecache_storage_failures_total{component="results",kind="disk_full"}' in metrics
        assert served(await c.post("/v1/chat/completions", json=chat_body("before the disk filled"))) == "exact"
        warm = await c.post("/admin/warmup", json={"lines": [
            {"line": 1, "request": {"prompt": "warm me", "answer": "warmed"}}]})
        assert warm.status_code == 200 and warm.json()["results"][0]["outcome"] == "failed"
        flush = await c.post("/admin/flush", json={"all": True})
        assert flush.status_code in (200, 503), flush.text  # done, or refused saying why; never a bare 500
        filler.unlink()
        assert served(await c.post("/v1/chat/completions", json=chat_body("after space returned"))) == "miss"
        for _ in range(200):  # the answer is stored after it was sent: that write clears the fault
            if (await c.get("/health")).json()["status"] == "ready":
                break
            await asyncio.sleep(0.01)
        assert (await c.get("/health")).json()["status"] == "ready"


async def test_started_on_a_full_disk_serves_then_recovers_when_space_returns(small_disk: Path,
                                                                               make_settings: Any) -> None:
    settings = make_settings(data_dir=str(small_disk / "data"), semantic__enabled=True,
                             semantic__save_interval_s=0.05)
    (small_disk / "data").mkdir()
    filler = fill_disk(small_disk)
    engine = FakeEngine()
    async with serve_in_process(create_app(settings, engine=engine)) as c:
        health = await c.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
        assert "model" not in health.json()["reason"]  # the disk is blamed, not the model
        assert served(await c.post("/v1/chat/completions", json=chat_body("asked on a full disk"))) == "miss"
        assert served(await c.post("/v1/chat/completions", json=chat_body("asked on a full disk"))) == "exact"
        filler.unlink()
        for i in range(300):  # the stores retry on their own (the semantic index from housekeeping)
            await asyncio.sleep(0.05)
            await c.post("/v1/chat/completions", json=chat_body(f"after space returned {i}"))
            if (await c.get("/health")).json()["status"] == "ready":
                break
        assert (await c.get("/health")).json()["status"] == "ready", (await c.get("/health")).text
