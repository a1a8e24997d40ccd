"""SemanticIndex on a real usearch index and real SQLite in temp dirs: CRUD, isolation, restart, cap, crash safety."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from edgecache.semantic.index import Candidate, SemanticIndex, TenantBounds, TenantUsage

DIM = 16


def unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=DIM).astype(np.float32)
    return v / np.linalg.norm(v)


@pytest.fixture(params=["f16", "i8"])
def index(request: pytest.FixtureRequest, tmp_path: Path):
    ix = SemanticIndex(tmp_path, dim=DIM, embedder_version="test-v1", dtype=request.param, max_vectors=1000)
    yield ix
    ix.close()


def test_add_then_search_finds_it(index: SemanticIndex) -> None:
    keys = [index.add("t", "s", unit(i), f"store-{i}", f"text {i}") for i in range(20)]
    assert len(set(keys)) == 20
    found = index.search("t", "s", unit(7), k=3)
    assert isinstance(found[0], Candidate)
    assert found[0].store_key == "store-7" and found[0].text == "text 7" and found[0].vector_key == keys[7]
    assert found[0].similarity > 0.97
    assert found[0].similarity >= found[1].similarity >= found[2].similarity
    assert index.sizes() == {("t", "s"): 20}


def test_vectors_of_reads_back_what_one_index_holds_by_store_key(index: SemanticIndex) -> None:
    index.add_many("t", "s", np.stack([unit(i) for i in range(5)]), [f"store-{i}" for i in range(5)],
                   [f"text {i}" for i in range(5)])
    index.add("t", "other", unit(9), "store-9", "text 9")
    index.remove_store_key("t", "s", "store-3")
    got = index.vectors_of("t", "s", ["store-1", "store-3", "store-4", "store-9", "nowhere"])
    assert sorted(got) == ["store-1", "store-4"]  # removed, in another index, or never added: not there
    assert np.allclose(got["store-1"], unit(1), atol=1e-3) and got["store-4"].dtype == np.float32


def test_similarity_is_the_cosine(index: SemanticIndex) -> None:
    # f16 indexes search by inner product (the vectors are unit length), i8 ones by cosine: either way a candidate's
    # similarity is the cosine of the two vectors, never past 1 (thresholds and the verifier read it as one).
    for i in range(50):
        index.add("t", "s", unit(i), f"store-{i}", f"text {i}")
    query = unit(7) + 0.3 * unit(1000)
    query /= np.linalg.norm(query)
    found = index.search("t", "s", query, k=5)
    tolerance = 0.002 if index.dtype == "f16" else 0.05
    for candidate in found:
        exact = float(unit(int(candidate.store_key.split("-")[1])) @ query)
        assert abs(candidate.similarity - exact) < tolerance
    assert index.search("t", "s", unit(3), k=1)[0].similarity <= 1.0


def test_an_index_file_saved_under_cosine_loads(tmp_path: Path) -> None:
    # Index files written before f16 indexes searched by inner product were saved under the cosine metric: they
    # load as they are (same graph, same vectors) and answer with the same similarities.
    from usearch.index import Index

    ix = SemanticIndex(tmp_path, dim=DIM, embedder_version="v")
    keys = [ix.add("t", "s", unit(i), f"store-{i}", f"text {i}") for i in range(30)]
    path = ix._index_path("t", "s")
    ix.close()
    old = Index(ndim=DIM, metric="cos", dtype="f16")
    # One thread: a graph built by several is different each run, and an approximate search of one of them missed
    # the exact match once in a full CI run; built by one, the graph (and so every search of it) is the same.
    old.add(np.array(keys, dtype=np.uint64), np.stack([unit(i) for i in range(30)]), threads=1)
    old.save(str(path))
    again = SemanticIndex(tmp_path, dim=DIM, embedder_version="v")
    found = again.search("t", "s", unit(11), k=2)
    assert found[0].store_key == "store-11" and found[0].similarity > 0.999
    assert abs(found[1].similarity - float(unit(int(found[1].store_key.split("-")[1])) @ unit(11))) < 0.002
    assert again.repairs == []
    again.close()


def test_empty_and_wrong_dim(index: SemanticIndex) -> None:
    assert index.search("nobody", "s", unit(1), k=4) == []
    with pytest.raises(ValueError):
        index.add("t", "s", np.ones(DIM + 1, dtype=np.float32), "k", "x")


def test_tenants_and_scenarios_are_separate(index: SemanticIndex) -> None:
    index.add("tenant-a", "support", unit(1), "a-key", "a text")
    index.add("tenant-a", "code", unit(2), "a-code", "a code")
    assert index.search("tenant-b", "support", unit(1), k=4) == []
    assert [c.store_key for c in index.search("tenant-a", "code", unit(1), k=4)] == ["a-code"]
    assert [c.store_key for c in index.search("tenant-a", "support", unit(1), k=4)] == ["a-key"]


def test_remove_by_key_and_by_store_key(index: SemanticIndex) -> None:
    k1 = index.add("t", "s", unit(1), "one", "1")
    index.add("t", "s", unit(2), "two", "2")
    index.add("t", "s", unit(3), "two", "2 again")
    assert index.remove("t", "s", [k1]) == 1
    assert index.remove("t", "s", [k1]) == 0
    assert all(c.store_key != "one" for c in index.search("t", "s", unit(1), k=5))
    assert index.remove_store_key("t", "s", "two") == 2
    assert index.search("t", "s", unit(2), k=5) == []
    assert index.sizes() == {}


def test_drop_by_tenant_scenario_and_all(index: SemanticIndex) -> None:
    for tenant in ("a", "b"):
        for scenario in ("x", "y"):
            index.add(tenant, scenario, unit(hash((tenant, scenario)) % 1000), f"{tenant}{scenario}", "t")
    index.save()
    index.drop(tenant="a", scenario="x")
    assert set(index.sizes()) == {("a", "y"), ("b", "x"), ("b", "y")}
    index.drop(scenario="y")
    assert set(index.sizes()) == {("b", "x")}
    index.drop()
    assert index.sizes() == {}
    assert index.search("b", "x", unit(1), k=1) == []


def test_survives_restart(tmp_path: Path) -> None:
    ix = SemanticIndex(tmp_path, dim=DIM, embedder_version="v")
    for i in range(50):
        ix.add("t", "s", unit(i), f"k{i}", f"text {i}")
    ix.close()
    ix.close()  # twice is fine
    assert list(tmp_path.rglob("*.usearch"))
    again = SemanticIndex(tmp_path, dim=DIM, embedder_version="v")
    assert again.sizes() == {("t", "s"): 50}
    assert again.search("t", "s", unit(33), k=1)[0].store_key == "k33"
    again.close()


def test_reopening_reads_the_index_keys_in_one_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Reconciling an index with its mapping at the first lookup after a restart needs every key of the index.
    # Asked for one offset at a time, usearch scans for each: 18 s at 50k vectors, hours at 1M.
    from usearch.index import IndexedKeys

    ix = SemanticIndex(tmp_path, dim=DIM, embedder_version="v")
    ix.add_many("t", "s", np.stack([unit(i) for i in range(40)]), [f"k{i}" for i in range(40)],
                [f"text {i}" for i in range(40)])
    ix.close()
    one_at_a_time = IndexedKeys.__getitem__

    def refuse_single_offsets(self, offset):  # type: ignore[no-untyped-def]
        if isinstance(offset, int):
            raise AssertionError("index keys read one offset at a time")
        return one_at_a_time(self, offset)

    monkeypatch.setattr(IndexedKeys, "__getitem__", refuse_single_offsets)
    again = SemanticIndex(tmp_path, dim=DIM, embedder_version="v")
    assert again.search("t", "s", unit(21), k=1)[0].store_key == "k21"
    again.close()


def test_unsaved_additions_are_rebuilt_from_the_mapping(tmp_path: Path) -> None:
    ix = SemanticIndex(tmp_path, dim=DIM, embedder_version="v")
    for i in range(10):
        ix.add("t", "s", unit(i), f"k{i}", "x")
    ix.save()
    for i in range(10, 15):
        ix.add("t", "s", unit(i), f"k{i}", "x")  # never saved: as if the process died here
    # Simulate the crash: drop the object without close() (no final save).
    ix._db.close()
    again = SemanticIndex(tmp_path, dim=DIM, embedder_version="v")
    assert again.search("t", "s", unit(13), k=1)[0].store_key == "k13"
    again.close()


def test_corrupt_index_file_is_rebuilt(tmp_path: Path) -> None:
    ix = SemanticIndex(tmp_path, dim=DIM, embedder_version="v")
    for i in range(10):
        ix.add("t", "s", unit(i), f"k{i}", "x")
    ix.close()
    (path,) = tmp_path.rglob("*.usearch")
    path.write_bytes(b"garbage" * 10)
    again = SemanticIndex(tmp_path, dim=DIM, embedder_version="v")
    assert again.search("t", "s", unit(4), k=1)[0].store_key == "k4"
    again.close()


def test_cap_evicts_oldest(tmp_path: Path) -> None:
    ix = SemanticIndex(tmp_path, dim=DIM, embedder_version="v", max_vectors=5)
    for i in range(8):
        ix.add("t", "s", unit(i), f"k{i}", "x")
    assert ix.sizes() == {("t", "s"): 5}
    keys = {c.store_key for c in ix.search("t", "s", unit(0), k=10)}
    assert keys == {"k3", "k4", "k5", "k6", "k7"}
    ix.close()


def _files_of(root: Path, tenant: str) -> set[str]:
    return {path.stem for path in root.rglob(f"{tenant}/*.usearch")}


def test_a_tenants_indexes_are_bounded_least_recently_used_first(tmp_path: Path) -> None:
    """Every distinct namespace makes an index (in memory and a file): past the plan's bound on indexes the
    tenant's least recently used one goes whole, file included. A search uses an index too; another tenant's
    indexes are never touched."""
    ix = SemanticIndex(tmp_path, dim=DIM, embedder_version="v")
    bounds = TenantBounds(indexes=3)
    ix.add("other", "s~a", unit(100), "o1", "x")
    ix.add("other", "s~b", unit(101), "o2", "x")
    for i in range(3):
        ix.add("acme", f"s~{i}", unit(i), f"k{i}", "x", bounds)
    assert ix.search("acme", "s~0", unit(0), k=1)[0].store_key == "k0"  # s~0 is now the most recently used
    ix.add("acme", "s~3", unit(3), "k3", "x", bounds)  # s~1 goes
    ix.add("acme", "s~4", unit(4), "k4", "x", bounds)  # s~2 goes
    assert {name for tenant, name in ix.sizes() if tenant == "acme"} == {"s~0", "s~3", "s~4"}
    assert ix.search("acme", "s~1", unit(1), k=1) == []
    assert ix.usage("acme") == TenantUsage(indexes=3, vectors=3, largest=1)
    ix.save()
    assert _files_of(tmp_path, "acme") == {"s~0", "s~3", "s~4"}
    assert sum(1 for tenant, _ in ix._indexes if tenant == "acme") <= 3
    assert ix.usage("other") == TenantUsage(indexes=2, vectors=2, largest=1)
    ix.close()


def test_a_tenants_vectors_across_its_indexes_are_bounded(tmp_path: Path) -> None:
    """Past the plan's bound on vectors across the tenant's indexes, the oldest vectors of its least recently
    used index go first (an index emptied goes whole); the index being added to gives up its own last."""
    ix = SemanticIndex(tmp_path, dim=DIM, embedder_version="v")
    bounds = TenantBounds(vectors=10)
    ix.add_many("other", "s~a", np.stack([unit(100 + i) for i in range(20)]), [f"o{i}" for i in range(20)],
                ["x"] * 20)
    for n in range(3):
        for i in range(4):
            ix.add("acme", f"s~{n}", unit(10 * n + i), f"k{n}.{i}", "x", bounds)
    # 12 asked for, 10 kept: the first two of s~0, its least recently used
    assert ix.usage("acme") == TenantUsage(indexes=3, vectors=10, largest=4)
    assert {c.store_key for c in ix.search("acme", "s~0", unit(0), k=10)} == {"k0.2", "k0.3"}
    ix.add_many("acme", "s~3", np.stack([unit(50 + i) for i in range(5)]), [f"k3.{i}" for i in range(5)],
                ["x"] * 5, bounds)
    # s~1 was the least recently used (s~0 was searched): it went whole (4), then one of s~2's
    assert ix.sizes()[("acme", "s~3")] == 5 and ("acme", "s~1") not in ix.sizes()
    assert ix.usage("acme") == TenantUsage(indexes=3, vectors=10, largest=5)
    assert ix.usage("other").vectors == 20
    ix.close()


def test_the_bounds_hold_across_a_restart(tmp_path: Path) -> None:
    """After a restart the tenant's usage is read back from the mapping, the most recently added to last."""
    ix = SemanticIndex(tmp_path, dim=DIM, embedder_version="v")
    bounds = TenantBounds(indexes=2)
    ix.add("acme", "s~old", unit(1), "k1", "x", bounds)
    ix.add("acme", "s~new", unit(2), "k2", "x", bounds)
    ix.close()
    again = SemanticIndex(tmp_path, dim=DIM, embedder_version="v")
    assert again.usage("acme") == TenantUsage(indexes=2, vectors=2, largest=1)
    again.add("acme", "s~newer", unit(3), "k3", "x", bounds)
    assert {name for _, name in again.sizes()} == {"s~new", "s~newer"}
    again.close()


def test_searching_namespaces_that_hold_nothing_keeps_nothing(tmp_path: Path) -> None:
    """A lookup under a new system prompt searches an index that does not exist: nothing is opened, kept in
    memory or written for it. An index emptied (its vectors forgotten) is released too."""
    ix = SemanticIndex(tmp_path, dim=DIM, embedder_version="v")
    for i in range(200):
        assert ix.search("acme", f"s~{i}", unit(i), k=1) == []
    key = ix.add("acme", "s~kept", unit(1), "k", "x")
    ix.remove("acme", "s~kept", [key])
    ix.save()
    assert ix._indexes == {} and ix.usage("acme") == TenantUsage() and not list(tmp_path.rglob("*.usearch"))
    ix.close()


def test_embedder_versions_do_not_mix(tmp_path: Path) -> None:
    old = SemanticIndex(tmp_path, dim=DIM, embedder_version="model-a")
    old.add("t", "s", unit(1), "k", "x")
    old.close()
    new = SemanticIndex(tmp_path, dim=DIM, embedder_version="model-b")
    assert new.search("t", "s", unit(1), k=1) == []
    new.close()


def test_names_cannot_escape_the_data_dir(tmp_path: Path) -> None:
    ix = SemanticIndex(tmp_path / "data", dim=DIM, embedder_version="../v")
    ix.add("../../evil", "/etc", unit(1), "k", "x")
    ix.close()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files and all((tmp_path / "data") in p.parents for p in files)


WRITER = textwrap.dedent(
    """
    import sys, numpy as np
    from edgecache.semantic.index import SemanticIndex
    ix = SemanticIndex(sys.argv[1], dim=16, embedder_version="v", max_vectors=10**6)
    rng = np.random.default_rng(int(sys.argv[2]))
    i = 0
    while True:
        v = rng.normal(size=16).astype(np.float32)
        ix.add("t", "s", v / np.linalg.norm(v), f"k{i}", f"text {i}")
        i += 1
        if i % 25 == 0:
            ix.save()
        if i == 100:
            print("ready", flush=True)
    """
)


@pytest.mark.parametrize("delay_s", [0.05, 0.2, 0.5])
def test_kill_during_additions_leaves_a_loadable_index(tmp_path: Path, delay_s: float) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), str(int(delay_s * 100))],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(delay_s)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    ix = SemanticIndex(tmp_path, dim=16, embedder_version="v", max_vectors=10**6)
    size = ix.sizes()[("t", "s")]
    assert size >= 100
    # Every vector the mapping knows is searchable: the loaded index agrees with the source of truth.
    assert len(ix._open("t", "s")) == size
    rows = ix._db.execute("SELECT key, vector FROM vectors ORDER BY key DESC LIMIT 3").fetchall()
    for key, blob in rows:
        vec = np.frombuffer(blob, dtype=np.float16).astype(np.float32)
        assert ix.search("t", "s", vec, k=1)[0].vector_key == key
    ix.close()
