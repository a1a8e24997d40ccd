"""The ``edgecache`` command: serve, warmup, stats, flush, tune, profiles.

Flags become dotted overrides of one Settings object (the same road as ``EDGECACHE_*`` variables and the profile).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Optional

import typer

from edgecache.settings import SettingsError, profile_names, resolve_settings, settings_to_dict

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="EdgeCache: an inference cache that co-hosts the model runtime.")
profiles_app = typer.Typer(no_args_is_help=True, help="List and inspect hardware profiles.")
app.add_typer(profiles_app, name="profiles")

ProfileOpt = Annotated[Optional[str], typer.Option(
    "--profile", "-p", envvar="EDGECACHE_PROFILE", help="A profile name (cpu, t4, ...) or a .toml path; "
    "default: picked for this machine.")]


OverlayOpt = Annotated[Optional[list[str]], typer.Option(
    "--overlay", metavar="FILE", envvar="EDGECACHE_OVERLAY", help="A TOML settings overlay merged over the profile "
    "(e.g. the thresholds `edgecache tune --write` wrote); may be given more than once.")]


def _settings(profile: str | None, overrides: dict[str, Any], overlays: list[str] | None = None):
    try:
        return resolve_settings(profile, overrides, overlays=overlays or ())
    except SettingsError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from exc


@app.command()
def serve(
    profile: ProfileOpt = None,
    host: Annotated[Optional[str], typer.Option(help="Address to bind (server.host).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port to bind (server.port).")] = None,
    data_dir: Annotated[Optional[str], typer.Option(help="Where caches live (data_dir).")] = None,
    model: Annotated[Optional[str], typer.Option(help="Model: a GGUF path or a shipped name (engine.model).")] = None,
    upstream: Annotated[Optional[str], typer.Option(
        metavar="URL", help="Use an upstream OpenAI-compatible server as the engine, e.g. http://HOST:PORT/v1 "
        "(engine.kind=openai, engine.upstream_url).")] = None,
    upstream_key: Annotated[Optional[str], typer.Option(
        metavar="KEY", help="API key sent to the upstream (engine.upstream_key).")] = None,
    tenants: Annotated[Optional[str], typer.Option(
        metavar="FILE", help="Tenants, plans and API keys (tenants_file); without it, one open tenant.")] = None,
    insecure: Annotated[bool, typer.Option(
        help="Allow a non-loopback address without a tenants file (anyone who reaches it may use it).")] = False,
    redis: Annotated[Optional[str], typer.Option(
        metavar="URL", help="Share results, flights and vectors with a fleet through this Redis "
        "(store.backend=redis, store.redis_url).")] = None,
    overlay: OverlayOpt = None,
) -> None:
    """Serve the OpenAI API with the caches and the model runtime in this one process."""
    settings = _settings(profile, {"server.host": host, "server.port": port, "data_dir": data_dir,
                                   "engine.model": model, "engine.kind": "openai" if upstream else None,
                                   "engine.upstream_url": upstream, "engine.upstream_key": upstream_key,
                                   "tenants_file": tenants, "store.backend": "redis" if redis else None,
                                   "store.redis_url": redis}, overlay)
    if settings.tenants_file is None and not insecure and not _is_loopback(settings.server.host):
        typer.secho(f"error: refusing to serve on {settings.server.host} with no tenants file: anyone who reaches "
                    "it could use the model and read the cache. Give --tenants FILE, or --insecure.",
                    fg="red", err=True)
        raise typer.Exit(2)

    from edgecache.http.app import create_app
    from edgecache.canary import CanaryFailed, settle
    from edgecache.data_dir import ensure_free
    from edgecache.engines import engine_from_settings
    from edgecache.errors import EdgeCacheError
    from edgecache.hardware import validate_memory
    from edgecache.http.server import EdgeCacheServer, uvicorn_config
    from edgecache.tenants import TenantDirectory

    def refuse(message: str) -> typer.Exit:
        typer.secho(f"error: {message}", fg="red", err=True)
        return typer.Exit(2)

    # Every check that can refuse runs before the banner and before any model loads, each as one line: the
    # tenants file, the memory split, the data dir (one server per dir), the port (bound here and handed to uvicorn,
    # so nothing can take it in between), the model file.
    try:
        if settings.tenants_file is not None:
            TenantDirectory.from_file(settings.tenants_file)
        split = validate_memory(settings)
        ensure_free(settings.data_path)
    except SettingsError as exc:
        raise refuse(str(exc)) from exc
    for warning in split.warnings if split is not None else ():
        typer.secho(f"warning: {warning}", fg="yellow", err=True)
    try:
        listening = _bind(settings.server.host, settings.server.port)
    except OSError as exc:
        raise refuse(f"cannot listen on {settings.server.host}:{settings.server.port}: {exc.strerror or exc} "
                     "(another server on that port? give --port another)") from exc
    logging.basicConfig(level=settings.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = engine_from_settings(settings)  # a model that is not there is refused here, before the canary
        report = None
        if settings.canary.enabled:
            # A native fault of the engine or the embedder shows here, in a child, not on a user's first request.
            settled, report = settle(settings)
            if settled is not settings:
                settings, engine = settled, engine_from_settings(settled)
        application = create_app(settings, engine=engine, canary=report)
    except (SettingsError, EdgeCacheError) as exc:  # a bad tenants file, a model that is not there
        listening.close()
        raise refuse(str(exc)) from exc
    except CanaryFailed as exc:
        listening.close()
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(1) from exc

    engine = settings.engine.upstream_url if settings.engine.kind == "openai" else settings.engine.model
    base = f"http://{_url_host(settings.server.host)}:{settings.server.port}"
    typer.echo(f"edgecache: profile {settings.profile}, engine {settings.engine.kind} ({engine}), "
               f"data in {settings.data_dir}, serving on {base}/v1", err=True)
    typer.echo(f"edgecache: the operator's page: {base}/dashboard (an admin key shows every tenant, a tenant's "
               "key its own)", err=True)
    EdgeCacheServer(uvicorn_config(application, settings)).run(sockets=[listening])


def _bind(host: str, port: int):  # type: ignore[no-untyped-def]
    """A listening socket on (host, port), as uvicorn would make it: bound now, so a busy port is found before
    the model loads."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    """``host`` as a URL names it (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


DEFAULT_URL = "http://127.0.0.1:8000"
UrlOpt = Annotated[str, typer.Option(envvar="EDGECACHE_URL", help="The server's base URL (env EDGECACHE_URL).")]
KeyOpt = Annotated[Optional[str], typer.Option(
    "--key", envvar="EDGECACHE_ADMIN_KEY", help="An admin key from the tenants file (env EDGECACHE_ADMIN_KEY).")]


def _admin_client(url: str, key: str | None):
    import httpx

    return httpx.Client(base_url=url.rstrip("/"), timeout=30,
                        headers={"Authorization": f"Bearer {key}"} if key else {})


def _fail_http(url: str, exc: Exception) -> typer.Exit:
    typer.secho(f"error: cannot reach {url}: {exc}", fg="red", err=True)
    return typer.Exit(1)


def _check(resp) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text
        typer.secho(f"error: {resp.status_code}: {message}", fg="red", err=True)
        raise typer.Exit(1)
    return resp.json()  # type: ignore[no-any-return]


@app.command()
def stats(
    url: UrlOpt = DEFAULT_URL,
    key: KeyOpt = None,
    tenant: Annotated[Optional[str], typer.Option(help="Only this tenant's figures.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the /stats JSON once, for scripts.")] = False,
    watch: Annotated[bool, typer.Option(help="A live view, refreshed every --interval seconds.")] = False,
    interval: Annotated[float, typer.Option(help="Refresh interval of --watch.")] = 2.0,
) -> None:
    """What the cache saved (engine time, tokens, money; since the ledger began and in the last hour), why misses
    missed, hit rates by layer, TTFT, engine and store figures of a running server, per tenant. An admin key sees
    every tenant; a tenant's key its own."""
    import json
    import time

    import httpx
    from edgecache.cli.render import stats_tables
    from rich.console import Console, Group
    from rich.live import Live

    def fetch(client: httpx.Client) -> dict[str, Any]:
        try:
            body = _check(client.get("/stats", params={"tenant": tenant} if tenant else None))
        except httpx.HTTPError as exc:
            raise _fail_http(url, exc) from exc
        return body

    with _admin_client(url, key) as client:
        body = fetch(client)
        if as_json:
            typer.echo(json.dumps(body, indent=2))
            return
        console = Console()
        if not watch:
            for table in stats_tables(body, tenant=tenant):
                console.print(table)
            return
        previous, previous_at = body, time.monotonic()
        if not console.is_terminal:
            # Piped or redirected (a log file, `| tee`, a CI step): a live view draws nothing there, so print one
            # timestamped snapshot per interval instead.
            try:
                while True:
                    console.print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}")
                    for table in stats_tables(body, tenant=tenant, previous=previous, seconds=time.monotonic()
                                              - previous_at if body is not previous else None):
                        console.print(table)
                    console.file.flush()
                    time.sleep(interval)
                    previous, previous_at = body, time.monotonic()
                    body = fetch(client)
            except KeyboardInterrupt:
                pass
            return
        with Live(Group(*stats_tables(body, tenant=tenant)), console=console, refresh_per_second=4) as live:
            try:
                while True:
                    time.sleep(interval)
                    body, now = fetch(client), time.monotonic()
                    live.update(Group(*stats_tables(body, tenant=tenant, previous=previous,
                                                    seconds=now - previous_at)))
                    previous, previous_at = body, now
            except KeyboardInterrupt:
                pass


@app.command()
def flush(
    url: UrlOpt = DEFAULT_URL,
    key: KeyOpt = None,
    tenant: Annotated[Optional[str], typer.Option(help="Drop this tenant's entries.")] = None,
    scenario: Annotated[Optional[str], typer.Option(help="Drop this scenario's entries (of --tenant, or of all).")]
    = None,
    all_: Annotated[bool, typer.Option("--all", help="Drop everything, the engine's prefix cache included.")] = False,
) -> None:
    """Drop cached entries across every layer of a running server."""
    import httpx

    if not (all_ or tenant or scenario):
        typer.secho("error: name --tenant, --scenario, or --all", fg="red", err=True)
        raise typer.Exit(2)
    with _admin_client(url, key) as client:
        try:
            body = _check(client.post("/admin/flush", json={"tenant": tenant, "scenario": scenario, "all": all_}))
        except httpx.HTTPError as exc:
            raise _fail_http(url, exc) from exc
    states = f", {body['prefix_states']} KV prefix states" if "prefix_states" in body else ""
    typer.echo(f"flushed tenant={tenant or '*'} scenario={scenario or '*'}: "
               f"{body['result_entries']} stored answers{states} dropped")


@app.command()
def warmup(
    prompts: Annotated[str, typer.Argument(help="JSON lines: messages or prompt, and optional scenario, tenant, "
                                                "ttl, max_tokens, temperature, seed, answer.")],
    url: Annotated[Optional[str], typer.Option(envvar="EDGECACHE_URL", help="Warm a running server (its "
                                               "/admin/warmup route; env EDGECACHE_URL).")] = None,
    key: KeyOpt = None,
    profile: ProfileOpt = None,
    data_dir: Annotated[Optional[str], typer.Option(help="Warm this data dir offline (no server running on it).")]
    = None,
    tenant: Annotated[Optional[str], typer.Option(help="Tenant for lines that name none.")] = None,
    tenants: Annotated[Optional[str], typer.Option(metavar="FILE", help="Tenants file, offline.")] = None,
) -> None:
    """Fill the result store, the semantic index and the engine's prefix cache before traffic arrives."""
    from pathlib import Path

    import httpx
    from edgecache.cli.warmup import warm_offline, warm_over_http
    from rich.console import Console

    path = Path(prompts)
    if not path.is_file():
        typer.secho(f"error: no such file: {prompts}", fg="red", err=True)
        raise typer.Exit(2)
    console = Console(stderr=True)
    if url is not None:
        try:
            summary = warm_over_http(path, url, key, tenant, console)
        except httpx.HTTPError as exc:
            raise _fail_http(url, exc) from exc
    else:
        from edgecache.canary import CanaryFailed, settle

        settings = _settings(profile, {"data_dir": data_dir, "tenants_file": tenants})
        logging.basicConfig(level="WARNING")
        if settings.canary.enabled:
            try:
                settings, _ = settle(settings)
            except CanaryFailed as exc:
                typer.secho(f"error: {exc}", fg="red", err=True)
                raise typer.Exit(1) from exc
        summary = warm_offline(path, settings, tenant, console)
    typer.echo(f"warmup: {summary.written} written, {summary.skipped} skipped, {summary.failed} failed "
               f"in {summary.seconds:.1f} s")
    for line in summary.taught_lines():
        typer.echo(line)
    if summary.failed and not (summary.written or summary.skipped):
        raise typer.Exit(1)


@app.command()
def tune(
    log: Annotated[str, typer.Argument(help="A decision-log file, or the decisions folder (<data_dir>/decisions).")],
    target_error: Annotated[float, typer.Option(
        min=0.0, max=0.5, help="The false-hit rate the cut must meet, as an upper confidence bound.")] = 0.01,
    confidence: Annotated[float, typer.Option(
        min=0.0, max=0.9999, help="One-sided confidence of that bound (Wilson); 0 uses the plain rate.")] = 0.95,
    tenant: Annotated[Optional[str], typer.Option(help="Only this tenant's decisions.")] = None,
    scenario: Annotated[Optional[str], typer.Option(help="Only this scenario's decisions.")] = None,
    per: Annotated[str, typer.Option(
        help="served: false hits as a share of the labelled decisions the cut serves; lookup: as a share of all "
        "lookups (for a fully labelled replay).")] = "served",
    write: Annotated[Optional[str], typer.Option(
        metavar="FILE", help="Write the per-scenario cuts as a TOML overlay for `serve --overlay FILE`.")] = None,
    unverified: Annotated[str, typer.Option(
        help="Labels whose answers were compared but no labeler could tell: bad (a cut is backed only by verified "
        "labels) or skip (left out, as if they were missing at random).")] = "bad",
) -> None:
    """Replay a decision log: per tenant and scenario, the lowest similarity cut whose false-hit rate among the
    decisions it would serve meets --target-error, the hit rate it would have given, and its labels. Hits are never
    labelled: the learner's audits and budget refusals stand for them (weighted); on a log without those, the hits
    at or above a cut are shown as unlabelled."""
    from pathlib import Path

    from edgecache.semantic.decision_log import log_files, read_records
    from edgecache.semantic.tuning import ALL, overlay_toml
    from edgecache.semantic.tuning import tune as tune_cuts
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn
    from rich.table import Table

    if per not in ("served", "lookup"):
        typer.secho("error: --per is served or lookup", fg="red", err=True)
        raise typer.Exit(2)
    if unverified not in ("bad", "skip"):
        typer.secho("error: --unverified is bad or skip", fg="red", err=True)
        raise typer.Exit(2)
    files = log_files(Path(log))
    if not files:
        typer.secho(f"error: no decision log at {log}", fg="red", err=True)
        raise typer.Exit(2)
    bad_lines = [0]
    with Progress("replaying", BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("replay", total=sum(f.stat().st_size for f in files))
        records = read_records(Path(log), on_bad_line=lambda *_: bad_lines.__setitem__(0, bad_lines[0] + 1),
                               on_bytes=lambda n: progress.advance(task, n))
        cuts = tune_cuts(records, target=target_error, confidence=confidence, tenant=tenant, scenario=scenario,
                         per=per, unverified=unverified)  # type: ignore[arg-type]
    console = Console()
    table = Table(title=f"Cuts at <= {target_error:.2%} false hits per {per} ({confidence:.0%} bound)")
    # Decisions at or above a cut whose stratum has no label (hits on a log without audits): a column only when
    # there are some, so the usual table stays narrow.
    unlabelled = any(cut.unlabelled for cut in cuts if cut.cut is not None)
    for column in ("tenant", "scenario", "lookups", "labels", "cut", "false hits (bound)", "hit rate", "backing",
                   *(("unlabelled",) if unlabelled else ())):
        table.add_column(column, justify="left" if column in ("tenant", "scenario") else "right")
    for cut in cuts:
        name = cut.tenant  # "*": every tenant pooled, the row --write uses
        if cut.cut is None:
            table.add_row(name, cut.scenario, str(cut.lookups), str(cut.labels), "-", "too few labels", "-", "0",
                          *(("-",) if unlabelled else ()))
        else:
            # Labels weighed up for the decisions they stand for (audits for hits) back the bound with fewer
            # effective labels than their count: shown beside it.
            backing = str(cut.backing) if abs(cut.effective - cut.backing) < 0.5 else \
                f"{cut.backing} (eff. {cut.effective:.0f})"
            table.add_row(name, cut.scenario, str(cut.lookups), str(cut.labels), f"{cut.cut:.4f}",
                          f"{cut.false_hit_rate:.2%} ({cut.false_hit_upper:.2%})", f"{cut.hit_rate:.1%}",
                          backing, *((str(cut.unlabelled),) if unlabelled else ()))
    console.print(table)
    if unlabelled:
        console.print("[yellow]warning:[/yellow] some decisions at or above a cut have no label in their stratum "
                      "(hits on a log without audits): their false hits are not in the estimate (column "
                      "unlabelled).", markup=True, highlight=False)
    console.print("tenant * pools every tenant's decisions: --write writes its cuts per scenario, and each "
                  "tenant's own as tenant_thresholds.")
    if bad_lines[0]:
        typer.secho(f"warning: {bad_lines[0]} lines did not decode and were skipped", fg="yellow", err=True)
    if write is not None:
        Path(write).write_text(overlay_toml(cuts, pooled=tenant is None))
        pooled = sum(1 for c in cuts if c.tenant == ALL and c.cut is not None) if tenant is None else 0
        own = sum(1 for c in cuts if c.tenant != ALL and c.cut is not None)
        typer.echo(f"wrote {pooled} scenario thresholds and {own} tenant thresholds to {write} "
                   f"(load with: edgecache serve --overlay {write})")


@app.command()
def doctor(
    profile: ProfileOpt = None,
    data_dir: Annotated[Optional[str], typer.Option(help="The data dir serve would use (data_dir).")] = None,
    redis: Annotated[Optional[str], typer.Option(metavar="URL", help="Check that this Redis answers (a fleet's "
                                                 "store.redis_url).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print every check as JSON, for scripts.")] = False,
    overlay: OverlayOpt = None,
) -> None:
    """Check this box before serving: Python and packages, the CPU and llama.cpp, the GPU and whether /metrics has
    its utilisation gauges (NVML), RAM, the data dir, Redis, the profile serve would pick, and the start-up canary. One line per check; exits 1 when any check fails."""
    import json

    from edgecache.doctor import run_checks

    settings = _settings(profile, {"data_dir": data_dir}, overlay)
    logging.basicConfig(level="ERROR", format="%(levelname)s %(name)s: %(message)s")
    colours = {"ok": "green", "warn": "yellow", "fail": "red"}

    def show(check) -> None:  # type: ignore[no-untyped-def]
        if not as_json:
            typer.secho(f"{check.status:<5}", fg=colours[check.status], nl=False)
            typer.echo(f"{check.name:<10} {check.detail}")

    redis_url = redis or (settings.store.redis_url if settings.store.backend == "redis" else None)
    checks = run_checks(settings, profile_given=profile, redis_url=redis_url, on_check=show)
    failed = [c.name for c in checks if c.status == "fail"]
    if as_json:
        typer.echo(json.dumps({"ok": not failed, "checks": [
            {"name": c.name, "status": c.status, "detail": c.detail} for c in checks]}, indent=2))
    elif failed:
        typer.secho(f"{len(failed)} failed: {', '.join(failed)}", fg="red", err=True)
    if failed:
        raise typer.Exit(1)


@profiles_app.command("list")
def profiles_list() -> None:
    """The shipped profiles."""
    for name in profile_names():
        typer.echo(name)


@profiles_app.command("show")
def profiles_show(
    name: Annotated[str, typer.Argument(help="Profile name or .toml path.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the settings and the split as JSON.")] = False,
    overlay: OverlayOpt = None,
) -> None:
    """The resolved settings of a profile (with EDGECACHE_* overrides applied) and the GPU memory split they imply:
    weights, KV pool, the KV tokens it buys, the embedder's share and the headroom. Exits 2 when the profile is
    invalid or its split cannot work."""
    import msgspec

    from edgecache.hardware import memory_split, split_inputs_missing, split_rows

    settings = _settings(name, {}, overlay)
    split = memory_split(settings)
    if as_json:
        import json
        typer.echo(json.dumps({"settings": settings_to_dict(settings),
                               "memory_split": msgspec.to_builtins(split) if split is not None else None}, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        console = Console()
        resolved = Table(title=f"Profile {settings.profile}: {settings.description}")
        rows = [(key, _show_value(value)) for key, value in _flatten(settings_to_dict(settings))]
        # A setting's name is what the reader copies into a profile or an EDGECACHE_* variable: never cut it (a
        # narrow terminal, or a pipe, which rich sizes at 80 columns); the value folds instead.
        resolved.add_column("setting", no_wrap=True, min_width=max((len(key) for key, _ in rows), default=7))
        resolved.add_column("value", overflow="fold")
        for key, value in rows:
            resolved.add_row(key, value)
        console.print(resolved)
        if split is not None:
            table = Table(title=f"GPU memory split ({settings.engine.model})")
            for column in ("figure", "value", "from"):
                table.add_column(column, justify="right" if column == "value" else "left")
            for row in split_rows(split):
                table.add_row(*row)
            console.print(table)
            for warning in split.warnings:
                console.print(f"[yellow]warning:[/yellow] {warning}", markup=True, highlight=False)
        elif settings.engine.kind == "sglang":
            console.print("no GPU memory split: set " + ", ".join(split_inputs_missing(settings)))
        else:
            console.print(f"no GPU memory split: the {settings.engine.kind} engine keeps no model on this GPU")
    if split is not None and split.errors:
        for error in split.errors:
            typer.secho(f"error: {error}", fg="red", err=True)
        raise typer.Exit(2)


def _show_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list) and len(value) > 6:  # the TTL tier term lists run to dozens of entries
        return f"{len(value)} entries: {', '.join(map(str, value[:4]))}, ..."
    return str(value)


def _flatten(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            rows.extend(_flatten(value, f"{prefix}{key}."))
        else:
            rows.append((f"{prefix}{key}", value))
    return rows


def main() -> None:
    app()


if __name__ == "__main__":
    main()
