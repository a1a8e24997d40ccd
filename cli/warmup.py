"""``edgecache warmup``: send a prompts file to a running server, or warm a data dir offline, with a progress bar.

Both roads end in :func:`edgecache.warmup.warm`: over HTTP through ``POST /admin/warmup`` in batches, or offline by
building the app from the profile on the data dir and running its lifespan in this process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from edgecache.settings import Settings
from edgecache.http.warmup_lines import NumberedLine, WarmupBatch, read_lines, warm_lines
from edgecache.warmup import LineResult, Prefilled

# One send carries up to ANSWERED lines with an answer (stored in one batch: the fast road) but only UNANSWERED
# lines without one (each is an engine call, so a send that held many would run for minutes), and stays well
# under the server's 1 MB body limit.
ANSWERED = 2048
UNANSWERED = 16
MAX_SEND_BYTES = 512 * 1024


class Summary(msgspec.Struct):
    written: int = 0
    skipped: int = 0
    failed: int = 0
    seconds: float = 0.0


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("warming"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[rate]:.1f} lines/s"), TimeRemainingColumn(), console=console)


def _batches(path: Path) -> tuple[int, Iterator[list[NumberedLine | LineResult]]]:
    with path.open(encoding="utf-8") as f:
        lines = f.readlines()

    def gen() -> Iterator[list[NumberedLine | LineResult]]:
        batch: list[NumberedLine | LineResult] = []
        unanswered = size = 0
        for item, text in zip(read_lines(lines), (t for t in lines if t.strip())):
            batch.append(item)
            size += len(text)
            unanswered += isinstance(item, NumberedLine) and item.request.answer is None
            if len(batch) >= ANSWERED or unanswered >= UNANSWERED or size >= MAX_SEND_BYTES:
                yield batch
                batch, unanswered, size = [], 0, 0
        if batch:
            yield batch

    return sum(1 for text in lines if text.strip()), gen()


def _run(path: Path, console: Console, send: Callable[[list[NumberedLine]], list[LineResult]]) -> Summary:
    total, batches = _batches(path)
    summary = Summary()
    started = time.perf_counter()
    with _progress(console) as progress:
        task = progress.add_task("warmup", total=total, rate=0.0)
        for batch in batches:
            good = [item for item in batch if isinstance(item, NumberedLine)]
            results = [item for item in batch if isinstance(item, LineResult)]
            if good:
                results.extend(send(good))
            for result in sorted(results, key=lambda r: r.line):
                setattr(summary, result.outcome, getattr(summary, result.outcome) + 1)
                if result.outcome == "failed":
                    progress.console.print(f"[red]line {result.line}: {result.detail}[/red]")
            elapsed = time.perf_counter() - started
            progress.update(task, advance=len(batch), rate=(summary.written + summary.skipped + summary.failed)
                            / elapsed if elapsed else 0.0)
    summary.seconds = time.perf_counter() - started
    return summary


def warm_over_http(path: Path, url: str, key: str | None, tenant: str | None, console: Console) -> Summary:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=600) as client:
        def send(lines: list[NumberedLine]) -> list[LineResult]:
            resp = client.post("/admin/warmup", content=msgspec.json.encode(WarmupBatch(tenant=tenant, lines=lines)),
                               headers={"content-type": "application/json"})
            if resp.status_code != 200:
                message = resp.json().get("error", {}).get("message", resp.text)
                return [LineResult(line=n.line, outcome="failed", detail=f"{resp.status_code}: {message}")
                        for n in lines]
            return msgspec.convert(resp.json()["results"], list[LineResult])

        return _run(path, console, send)


def warm_offline(path: Path, settings: Settings, tenant: str | None, console: Console) -> Summary:
    """Build the app from ``settings`` (its data dir), load it here, warm it, close it (which saves the indexes)."""
    from edgecache.http.app import create_app

    app = create_app(settings)

    async def main() -> Summary:
        async with app.lifespan():
            rt = app.state.runtime
            while not rt.ready:
                if rt.load_error:
                    raise SystemExit(f"error: {rt.load_error}")
                await asyncio.sleep(0.05)
            loop = asyncio.get_running_loop()
            prefilled: Prefilled = set()

            def send(lines: list[NumberedLine]) -> list[LineResult]:
                job = warm_lines(rt.pipeline, lines, tenants=rt.tenants, settings=rt.settings, tenant=tenant,
                                 prefilled=prefilled)
                return asyncio.run_coroutine_threadsafe(job, loop).result()

            return await asyncio.to_thread(_run, path, console, send)

    return asyncio.run(main())
