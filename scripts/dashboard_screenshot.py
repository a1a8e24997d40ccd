"""The picture of the operator's page in docs/operations.md: a real `edgecache serve --profile cpu` with the headline
benchmark's tenants (edgecache.bench.workload) and a box price, the benchmark's workload replayed against it at
a slow rate for some minutes, one tenant flushed half way (its hit rate falls, and its misses read `flushed`), then
the admin's page shot in Chromium (Debian's, headless, through Playwright).

    python scripts/dashboard_screenshot.py docs/img/dashboard.png [--minutes 16] [--rate 0.8] [--width 1360]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

from edgecache.bench.harness import free_port, start_server, stop_process, wait_ready
from edgecache.bench.workload import ADMIN_KEY, TENANTS, WorkloadConfig, generate, send, tenants_toml

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
FLUSHED = TENANTS[0].id


async def replay(url: str, minutes: float, rate: float) -> None:
    reqs = [r for r in generate(WorkloadConfig(requests=int(minutes * 60 * rate * 1.2), rate=rate, seed=1))
            if r.t < minutes * 60]
    started = time.monotonic()
    flushed = False
    async with httpx.AsyncClient(timeout=120) as client:
        tasks = []
        for req in reqs:
            wait = req.t - (time.monotonic() - started)
            if wait > 0:
                await asyncio.sleep(wait)
            if not flushed and req.t >= minutes * 30:
                await client.post(url + "/admin/flush", json={"tenant": FLUSHED},
                                  headers={"Authorization": f"Bearer {ADMIN_KEY}"})
                flushed = True
                print(f"flushed {FLUSHED} at {req.t / 60:.1f} min", file=sys.stderr)
            tasks.append(asyncio.create_task(send(client, url, req, None)))
        await asyncio.gather(*tasks)
    print(f"{len(reqs)} requests in {(time.monotonic() - started) / 60:.1f} min", file=sys.stderr)


def until(page, expression: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 60
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise SystemExit(f"the page never came to {expression}")
        time.sleep(0.1)


def shoot(url: str, out: Path, width: int, window: str) -> None:
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    try:
        with sync_playwright() as p:
            context = p.chromium.launch_persistent_context(
                profile, executable_path=shutil.which("chromium"), headless=True, args=CHROMIUM_ARGS,
                viewport={"width": width, "height": 900}, device_scale_factor=1)
            page = context.new_page()
            page.goto(url + f"/dashboard#key={ADMIN_KEY}")
            until(page, "() => Number(document.body.dataset.historySeq || 0) >= 1")
            page.select_option("#window", window)  # the page asks /stats/history for that window
            until(page, "() => Number(document.body.dataset.historySeq || 0) >= 2")
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out), full_page=True)
            context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--minutes", type=float, default=16.0)
    parser.add_argument("--rate", type=float, default=0.8, help="mean requests per second")
    parser.add_argument("--width", type=int, default=1360)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="edgecache-dashboard-"))
    (work / "tenants.toml").write_text(tenants_toml())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(work / "server.log", "ab") as log:
        proc = start_server(["--profile", "cpu", "--port", str(port), "--data-dir", str(work / "data"),
                             "--tenants", str(work / "tenants.toml")],
                            env={"EDGECACHE_LEDGER__PRICE_PER_HOUR": "1.23"}, log=log, clean_env=True)
        try:
            wait_ready(url, proc, timeout=300)
            asyncio.run(replay(url, args.minutes, args.rate))
            time.sleep(6)  # the housekeeping's next minute mark and ledger tick
            shoot(url, args.out, args.width, "60:1" if args.minutes > 30 else "30:1")
        finally:
            stop_process(proc)
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
