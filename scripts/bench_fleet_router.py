"""N nodes behind SGLang's router (cache_aware, then round_robin) against one node alone: the engines' prefix-cache
hit ratio, TTFT p50/p99 and refusals per arm, side by side in one run, and the checks that nothing was lost or
served to the wrong tenant. The workload and the checks: edgecache/bench/fleet_router.py.

    python scripts/bench_fleet_router.py [--nodes 2] [--tenants 4] [--requests 80] [--concurrency 4]
        [--system-tokens 1100] [--max-tokens 16] [--no-redis] [--json out.json] [--keep DIR]

Each arm starts fresh `edgecache serve --profile cpu` nodes (llama.cpp, SmolLM2); the router is
`python -m sglang_router.launch_router` (sglang-router from PyPI). Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from edgecache.bench import fleet_router


def main() -> None:
    defaults = fleet_router.FleetConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=defaults.nodes)
    parser.add_argument("--tenants", type=int, default=defaults.tenants)
    parser.add_argument("--requests", type=int, default=defaults.requests, help="per arm, over all tenants")
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--system-tokens", type=int, default=defaults.system_tokens,
                        help="each tenant's system prompt holds at least this many of SmolLM2's tokens")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--redis", action=argparse.BooleanOptionalAction, default=defaults.redis,
                        help="the nodes of an arm share one redis-server (the default), or keep their own stores")
    parser.add_argument("--json", type=Path, help="write every arm's figures and checks here")
    parser.add_argument("--keep", type=Path, help="keep the nodes' data dirs and logs here")
    args = parser.parse_args()
    cfg = fleet_router.FleetConfig(nodes=args.nodes, tenants=args.tenants, requests=args.requests,
                                   concurrency=args.concurrency, system_tokens=args.system_tokens,
                                   max_tokens=args.max_tokens, seed=args.seed, redis=args.redis)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        result = fleet_router.run(cfg, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-fleet-router-") as tmp:
            result = fleet_router.run(cfg, Path(tmp))
    print(fleet_router.table(result))
    if args.json:
        args.json.write_text(json.dumps({**result, "config": asdict(cfg)}, indent=1, default=str))
    sys.exit(0 if all(all(a["checks"].values()) for a in result["arms"].values()) else 1)


if __name__ == "__main__":
    main()
