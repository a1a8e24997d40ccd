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
) -> None:
    """Serve the OpenAI API with the caches and the model runtime in this one process."""
    settings = _settings(profile, {"server.host": host, "server.port": port, "data_dir": data_dir,
                                   "engine.model": model})
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
def profiles_show(name: Annotated[str, typer.Argument(help="Profile name or .toml path.")]) -> None:
    """The resolved settings of a profile (with EDGECACHE_* overrides applied)."""
    import json
    typer.echo(json.dumps(settings_to_dict(_settings(name, {})), indent=2))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
