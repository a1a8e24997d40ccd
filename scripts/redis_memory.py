"""What each shared layer costs Redis in memory per entry, measured on a real redis-server (docs/fleet.md).

Starts its own redis-server on a free port (Debian's package), writes N entries of each kind through the real
backends, and reads ``used_memory`` from ``INFO memory`` before and after:

- a result: one answer of --answer-chars characters in the store (value, LRU member, size, tag);
- a flight: one finished flight's lease and stream of --chunks chunks, as it is during its finished window;
- a vector: one record of a --dim-dimension vector (float16) and its prompt text in a tenant's vector stream;
- a label: one semantic learner label in the fleet's label stream;
- a stored response: one Responses API response (a --answer-chars answer to a one-line question: the Response as
  served, its input items and the conversation) with its tenant's bookkeeping (age order, size, byte counter).

    python scripts/redis_memory.py [--n 2000] [--answer-chars 600] [--chunks 40] [--dim 512]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from edgecache.bench.harness import free_port
from edgecache.engines.base import Chunk
from edgecache.fleet.labels import LABELS, SharedLabel
from edgecache.fleet.link import RedisLink
from edgecache.fleet.responses import RedisResponseStore
from edgecache.fleet.vectors import VectorRecord
from edgecache.inflight.local import Flight
from edgecache.http.request_surface import ChatMessageIn
from edgecache.http.response_store import StoredResponse
from edgecache.http.responses_api import (InputTokensDetails, OutputMessage, OutputText, OutputTokensDetails,
                                          ResponseObject, ResponseUsage)
from edgecache.inflight.redis import RedisFlightTable
from edgecache.stores import CachedAnswer
from edgecache.stores.redis import RedisTenantStores


async def used(link: RedisLink) -> int:
    return int((await link.client.info("memory"))["used_memory"])


async def measure(args: argparse.Namespace, url: str) -> dict[str, float]:
    link = RedisLink(url, timeout_s=5.0)
    await link.start()
    out: dict[str, float] = {}
    try:
        stores = RedisTenantStores(link, quota_for=lambda t: 10**12, memory_bytes=0, model_version=lambda: "m@1")
        text = ("word " * args.answer_chars)[:args.answer_chars]
        before = await used(link)
        now = time.time()
        for i in range(args.n):
            await stores("tenant-a").put(f"{i:064x}", CachedAnswer(
                text=text, finish_reason="stop", prompt_tokens=40, completion_tokens=150, created_at=now,
                expires_at=now + 3600), tag="default")
        out["result"] = (await used(link) - before) / args.n

        table = RedisFlightTable(link, node_id="node", epoch=lambda: 0, lease_s=600)
        piece = ("tok " * 4)[: max(1, args.answer_chars // args.chunks)]

        async def produce(flight: Flight) -> None:
            for _ in range(args.chunks):
                flight.publish(Chunk(text=piece))
            flight.publish(Chunk(finish_reason="stop", prompt_tokens=40, completion_tokens=args.chunks))
            flight.finish()

        before = await used(link)
        for i in range(args.n // 4):
            flight = table.lead(f"{i:064x}", produce)
            async for _ in flight.follow():
                pass
        await table.drain(60)
        out["flight"] = (await used(link) - before) / (args.n // 4)

        before = await used(link)
        vector = np.random.default_rng(0).standard_normal(args.dim).astype(np.float16).tobytes()
        encode = __import__("msgspec").msgpack.Encoder().encode
        pipe = link.client.pipeline(transaction=False)
        for i in range(args.n):
            pipe.xadd("ec:{tenant-a}:v:measure", {"r": encode(VectorRecord(
                origin="node", tenant="tenant-a", index="default~0123456789abcdef", store_key=f"{i:064x}",
                text="How do I reset my password on the mobile app?", vector=vector))})
        await pipe.execute()
        out["vector"] = (await used(link) - before) / args.n

        before = await used(link)
        pipe = link.client.pipeline(transaction=False)
        for i in range(args.n):
            pipe.xadd(LABELS, {"l": encode(SharedLabel(
                origin="node-0123456789ab", tenant="tenant-a", scenario="support", store_key=f"{i:032x}",
                similarity=0.8731, good=False, answer_key=f"{i + 1:032x}"))})
        await pipe.execute()
        out["label"] = (await used(link) - before) / args.n

        question = "How do I reset my password on the mobile app?"
        responses = RedisResponseStore(link, tenant_bytes=10**12, ttl_s=3600)
        before = await used(link)
        for i in range(args.n):
            response_id = f"resp_{i:024x}"
            body = __import__("msgspec").json.encode(ResponseObject(
                id=response_id, created_at=int(now), status="completed", model="SmolLM2-135M-Instruct",
                output=[OutputMessage(id=f"msg_{i:024x}", status="completed", content=[OutputText(text=text)])],
                usage=ResponseUsage(input_tokens=40, input_tokens_details=InputTokensDetails(cached_tokens=0),
                                    output_tokens=150, output_tokens_details=OutputTokensDetails(),
                                    total_tokens=190)))
            items = __import__("msgspec").json.encode([{"type": "message", "role": "user", "content": question,
                                                        "id": f"msg_{i:024x}_in0"}])
            record = encode(StoredResponse(body=body, input_items=items, history=(
                ChatMessageIn(role="user", content=question), ChatMessageIn(role="assistant", content=text)),
                created_at=now, expires_at=now + 3600))
            responses.put("tenant-a", response_id, record, now, now + 3600)
        await responses.flushed()
        out["response"] = (await used(link) - before) / args.n
        out["response_record"] = len(record)
    finally:
        await link.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--answer-chars", type=int, default=600)
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--dim", type=int, default=512)
    args = parser.parse_args()
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", directory], stdout=subprocess.DEVNULL)
        try:
            time.sleep(0.5)
            figures = asyncio.run(measure(args, f"redis://127.0.0.1:{port}/0"))
        finally:
            proc.kill()
            proc.wait()
    print(f"Redis memory per entry (redis-server, n={args.n}):")
    for label, value in ((f"result ({args.answer_chars}-char answer)", figures["result"]),
                         (f"flight ({args.chunks} chunks, finished window)", figures["flight"]),
                         (f"vector ({args.dim}-dim f16 + prompt text)", figures["vector"]),
                         ("learner label", figures["label"]),
                         (f"stored response ({figures['response_record']:.0f}-byte record)", figures["response"])):
        print(f"  {label:42}{value:8.0f} B")


if __name__ == "__main__":
    main()
