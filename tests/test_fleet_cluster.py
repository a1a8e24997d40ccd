"""A fleet on a real Redis Cluster (the fleet's other tests run on one too, through ``fleet_redis_url``): what only a
cluster has. The nodes see it is one and say so; a tenant's keys live in its hash slot, and the tenants spread over
the primaries; a flush reaches every primary; and a primary killed mid-traffic (a cluster with replicas, started
here) serves nothing wrong: the nodes degrade as with one Redis away, keep serving, and go back to the cluster once a
replica has taken over."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from edgecache.fleet.link import RedisLink
from tests.conftest import REDIS_INSTALL, chat_body, require_binary, until
from edgecache.bench.redis_servers import RedisCluster
from tests.test_fleet import ask, fleet, served, sse_text, text
from tests.test_tenants import ADMIN, TenantMarkingEngine, auth, write_tenants_file

TENANTS = [f"t0{i}" for i in range(1, 9)]


def links(*nodes: httpx.AsyncClient) -> list[RedisLink]:
    return [node.app.state.runtime.fleet.link for node in nodes]  # type: ignore[attr-defined]


async def test_the_nodes_see_a_cluster_and_a_flush_reaches_every_primary(
        make_settings: Any, tmp_path: Path, redis_cluster: RedisCluster) -> None:
    redis_cluster.flushall()
    tenants = write_tenants_file(tmp_path / "tenants.toml")
    engines = [TenantMarkingEngine(), TenantMarkingEngine()]
    async with fleet(make_settings, tmp_path, redis_cluster.url, engines, tenants_file=str(tenants)) as (a, b):
        health = (await b.get("/health")).json()
        assert health["redis"]["mode"] == "cluster" and health["redis"]["primaries"] == 3
        for tenant in TENANTS:
            assert served(await ask(a, f"What is {tenant}'s plan?", headers=auth(tenant))) == "miss"
            again = await ask(b, f"What is {tenant}'s plan?", headers=auth(tenant))
            assert served(again) == "exact" and text(again).startswith(f"<{tenant}>")
        # Each tenant's keys in its one slot; the tenants on every primary.
        keys = await links(a)[0].scan("ec:*")
        for tenant in TENANTS:
            mine = [k for k in keys if f"{{{tenant}}}" in k]
            assert len(mine) >= 5 and len({redis_cluster.primary_of(k).port for k in mine}) == 1, mine
        assert len({redis_cluster.primary_of(f"ec:{{{t}}}:t:bytes").port for t in TENANTS}) == 3
        resp = await b.post("/admin/flush", json={"all": True}, headers=ADMIN)
        assert resp.status_code == 200, resp.text
        assert resp.json()["result_entries"] == len(TENANTS)
        assert not [k for k in await links(a)[0].scan("ec:*") if ":r:" in k]  # no answer left on any primary
        await until(lambda: links(a)[0].up and a.app.state.runtime.fleet.events.applied >= 1)  # type: ignore
        for tenant in TENANTS:
            assert served(await ask(a, f"What is {tenant}'s plan?", headers=auth(tenant))) == "miss"


@pytest.fixture
def cluster_with_replicas(tmp_path: Path) -> Iterator[RedisCluster]:
    """Three primaries, a replica each: a primary can be killed and a replica take over."""
    require_binary("redis-server", REDIS_INSTALL)
    require_binary("redis-cli", REDIS_INSTALL)
    cluster = RedisCluster(tmp_path / "cluster", replicas=1).start()
    yield cluster
    cluster.kill()


async def test_a_primary_killed_mid_traffic_serves_nothing_wrong_and_the_nodes_come_back(
        make_settings: Any, tmp_path: Path, cluster_with_replicas: RedisCluster) -> None:
    cluster = cluster_with_replicas
    tenants = write_tenants_file(tmp_path / "tenants.toml")
    engines = [TenantMarkingEngine(), TenantMarkingEngine()]
    async with fleet(make_settings, tmp_path, cluster.url, engines, tenants_file=str(tenants)) as nodes:
        a, b = nodes
        for tenant in TENANTS:  # answers stored before the kill, on every primary
            await ask(a, f"Before, for {tenant}", headers=auth(tenant))
        outcomes: list[tuple[str, int, str, str]] = []
        stop = asyncio.Event()

        async def traffic() -> None:
            i = 0
            while not stop.is_set():
                tenant, node = TENANTS[i % len(TENANTS)], nodes[i % 2]
                question = f"Before, for {tenant}" if i % 3 == 0 else f"Question {i // 3 % 20} for {tenant}"
                stream = i % 4 == 1
                resp = await node.post("/v1/chat/completions", headers=auth(tenant),
                                       json=chat_body(question, stream=stream))
                answer = resp.text if resp.status_code != 200 else sse_text(resp) if stream else text(resp)
                outcomes.append((tenant, resp.status_code, question, answer))
                i += 1
                await asyncio.sleep(0.005)  # a hit from memory never yields: give the nodes' own tasks their turn

        sender = asyncio.create_task(traffic())
        await until(lambda: len(outcomes) >= 20, "traffic before the kill")
        lost = cluster.kill_primary_of("ec:{t01}:t:bytes")
        await until(lambda: not any(link.up for link in links(a, b)), "both nodes seeing the primary gone")
        health = await b.get("/health")
        assert health.status_code == 200 and health.json()["components"]["redis"]["status"] == "degraded"
        during = len(outcomes)
        await until(lambda: len(outcomes) >= during + 20, "traffic while the cluster fails over")
        await until(lambda: all(link.up for link in links(a, b)), "both nodes back on the cluster", patience_s=180)
        after = len(outcomes)
        await until(lambda: len(outcomes) >= after + 20, "traffic after the failover")
        stop.set()
        await sender
        assert not lost.alive
        for tenant, status, question, answer in outcomes:  # never an error, another tenant's or a wrong answer
            assert (status, answer) == (200, f"<{tenant}> answer to: {question}")
        health = (await a.get("/health")).json()
        assert health["status"] == "ready" and health["redis"]["primaries"] == 3
        assert health["redis"]["disconnects"] >= 1
        # Back on the cluster: a miss on one node is exact on the other, for a tenant of the lost primary too.
        for tenant in ("t01", "t03"):
            assert served(await ask(a, f"After, for {tenant}", headers=auth(tenant))) == "miss"
            again = await ask(b, f"After, for {tenant}", headers=auth(tenant))
            assert served(again) == "exact" and text(again) == f"<{tenant}> answer to: After, for {tenant}"
        # What was stored before the kill is an exact hit, or (lost with the primary) a miss: never an error.
        for tenant in TENANTS:
            before = await ask(b, f"Before, for {tenant}", headers=auth(tenant))
            assert served(before) in ("exact", "miss") and text(before) == f"<{tenant}> answer to: Before, for {tenant}"

