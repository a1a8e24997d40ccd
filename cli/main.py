"""The ``edgecache`` command: serve, stats, profiles. Flags become dotted overrides of one Settings object."""

from __future__ import annotations

import logging
import sys
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


def _settings(profile: str | None, overrides: dict[str, Any]):
    try:
        return resolve_settings(profile, overrides)
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
) -> None:
    """Serve the OpenAI API with the caches and the model runtime in this one process."""
    settings = _settings(profile, {"server.host": host, "server.port": port, "data_dir": data_dir,
                                   "engine.model": model, "engine.kind": "openai" if upstream else None,
                                   "engine.upstream_url": upstream, "engine.upstream_key": upstream_key})
    import uvicorn

    from edgecache.app import create_app

    logging.basicConfig(level=settings.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    typer.echo(f"edgecache: profile {settings.profile}, engine {settings.engine.kind} ({settings.engine.model}), "
               f"data in {settings.data_dir}, serving on http://{settings.server.host}:{settings.server.port}/v1",
               err=True)
    config = uvicorn.Config(create_app(settings), host=settings.server.host, port=settings.server.port,
                            loop="uvloop" if sys.platform != "win32" else "asyncio", http="httptools",
                            log_level=settings.server.log_level, access_log=False, lifespan="on")
    uvicorn.Server(config).run()


@app.command()
def stats(
    url: Annotated[str, typer.Option(help="The server's base URL.")] = "http://127.0.0.1:8000",
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw JSON.")] = False,
) -> None:
    """Show hit rates, engine figures and store size of a running server."""
    import httpx

    try:
        body = httpx.get(url.rstrip("/") + "/stats", timeout=10).json()
    except httpx.HTTPError as exc:
        typer.secho(f"error: cannot reach {url}: {exc}", fg="red", err=True)
        raise typer.Exit(1) from exc
    if as_json:
        import json
        typer.echo(json.dumps(body, indent=2))
        return
    from rich.console import Console

    from edgecache.cli.render import stats_tables

    console = Console()
    for table in stats_tables(body):
        console.print(table)


@profiles_app.command("list")
def profiles_list() -> None:
    """The shipped profiles."""
    for name in profile_names():
        typer.echo(name)


@profiles_app.command("show")
def profiles_show(
    name: Annotated[str, typer.Argument(help="Profile name or .toml path.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the settings and the split as JSON.")] = False,
) -> None:
    """The resolved settings of a profile (with EDGECACHE_* overrides applied) and the GPU memory split they imply:
    weights, KV pool, the KV tokens it buys, the embedder's share and the headroom. Exits 2 when the profile is
    invalid or its split cannot work."""
    import msgspec

    from edgecache.hardware import memory_split, split_inputs_missing, split_rows

    settings = _settings(name, {})
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
        resolved.add_column("setting")
        resolved.add_column("value")
        for key, value in _flatten(settings_to_dict(settings)):
            resolved.add_row(key, _show_value(value))
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
