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

from edgecache.errors import EdgeCacheError
from edgecache.settings import Settings
from edgecache.http.warmup_lines import (NumberedLine, WarmupBatch, WarmupReply, check_line_groups, read_lines,
                                         warm_lines)
from edgecache.semantic.learner import TaughtState
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
    #: What each teaching allows after the last send that taught it (one per tenant and scenario).
    taught: list[TaughtState] = msgspec.field(default_factory=list)

    def taught_lines(self) -> list[str]:
        """One line per teaching: :meth:`TaughtState.describe`, naming the tenant and scenario unless both are
        ``default``."""
        return [(state.describe() if (state.tenant, state.scenario) == ("default", "default") else
                 f"tenant {state.tenant}, scenario {state.scenario}: {state.describe()}") for state in self.taught]


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("warming"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[rate]:.1f} lines/s"), TimeRemainingColumn(), console=console)


def _batches(path: Path, tenant: str | None = None) -> tuple[int, Iterator[list[NumberedLine | LineResult]]]:
    """The file's lines in sends. A group's lines go in one send (the server finds a group's answer among the
    lines of one send; what the groups teach is worked out against every line sent before), unless the group alone
    is over a send's size; a file that contradicts itself is refused whole
    (:func:`edgecache.warmup.check_groups`), before anything is sent."""
    with path.open(encoding="utf-8") as f:
        lines = f.readlines()
    items = list(zip(read_lines(lines), (t for t in lines if t.strip())))
    try:
        check_line_groups([item for item, _ in items if isinstance(item, NumberedLine)], tenant)
    except EdgeCacheError as exc:
        raise SystemExit(f"error: {path}: {exc.message}") from exc
    units: dict[object, list[tuple[NumberedLine | LineResult, str]]] = {}
    for n, (item, text) in enumerate(items):
        group = item.request.group if isinstance(item, NumberedLine) else None
        units.setdefault(n if group is None else (item.request.tenant, item.request.scenario, group),  # type: ignore[union-attr]
                         []).append((item, text))

    def gen() -> Iterator[list[NumberedLine | LineResult]]:
        batch: list[NumberedLine | LineResult] = []
        unanswered = size = 0
        for unit in units.values():
            unit_size = sum(len(text) for _, text in unit)
            # One engine call for a line with no answer, and for a group none of whose lines gives it.
            calls = int(all(isinstance(item, NumberedLine) and item.request.answer is None for item, _ in unit))
            if batch and (len(batch) + len(unit) > ANSWERED or unanswered + calls > UNANSWERED
                          or size + unit_size > MAX_SEND_BYTES):
                yield batch
                batch, unanswered, size = [], 0, 0
            unanswered += calls
            for item, text in unit:  # a unit over a send's size alone is cut
                batch.append(item)
                size += len(text)
                if len(batch) >= ANSWERED or size >= MAX_SEND_BYTES:
                    yield batch
                    batch, unanswered, size = [], 0, 0
            if unanswered >= UNANSWERED:
                yield batch
                batch, unanswered, size = [], 0, 0
        if batch:
            yield batch

    return sum(1 for text in lines if text.strip()), gen()


def _run(path: Path, console: Console, send: Callable[[list[NumberedLine]], WarmupReply],
         tenant: str | None = None) -> Summary:
    total, batches = _batches(path, tenant)
    summary = Summary()
    taught: dict[tuple[str, str], TaughtState] = {}
    started = time.perf_counter()
    with _progress(console) as progress:
        task = progress.add_task("warmup", total=total, rate=0.0)
        for batch in batches:
            good = [item for item in batch if isinstance(item, NumberedLine)]
            results = [item for item in batch if isinstance(item, LineResult)]
            if good:
                reply = send(good)
                results.extend(reply.results)
                taught.update(((state.tenant, state.scenario), state) for state in reply.taught)
            for result in sorted(results, key=lambda r: r.line):
                setattr(summary, result.outcome, getattr(summary, result.outcome) + 1)
                if result.outcome == "failed":
                    progress.console.print(f"[red]line {result.line}: {result.detail}[/red]")
            elapsed = time.perf_counter() - started
            progress.update(task, advance=len(batch), rate=(summary.written + summary.skipped + summary.failed)
                            / elapsed if elapsed else 0.0)
    summary.seconds = time.perf_counter() - started
    summary.taught = list(taught.values())
    return summary


def warm_over_http(path: Path, url: str, key: str | None, tenant: str | None, console: Console) -> Summary:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=600) as client:
        def send(lines: list[NumberedLine]) -> WarmupReply:
            resp = client.post("/admin/warmup", content=msgspec.json.encode(WarmupBatch(tenant=tenant, lines=lines)),
                               headers={"content-type": "application/json"})
            if resp.status_code != 200:
                message = resp.json().get("error", {}).get("message", resp.text)
                return WarmupReply(results=[LineResult(line=n.line, outcome="failed",
                                                       detail=f"{resp.status_code}: {message}") for n in lines])
            return msgspec.convert(resp.json(), WarmupReply)

        return _run(path, console, send, tenant)


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

            def send(lines: list[NumberedLine]) -> WarmupReply:
                job = warm_lines(rt.pipeline, lines, tenants=rt.tenants, settings=rt.settings, tenant=tenant,
                                 prefilled=prefilled)
                return asyncio.run_coroutine_threadsafe(job, loop).result()

            return await asyncio.to_thread(_run, path, console, send, tenant)

    return asyncio.run(main())
