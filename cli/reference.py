"""The reference docs/ carries, generated from the code: every metric family ``/metrics`` may expose and every
``edgecache`` command with its flags. ``python scripts/gen_reference.py`` writes them (with the settings table,
:func:`edgecache.settings.configuration_table`) between their markers; ``tests/test_docs.py`` fails when a page
differs from what these functions say. It sits on the command's floor, the top one, since it reads the command.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec

METRICS_BEGIN = "<!-- the metrics table: written by `python scripts/gen_reference.py`; do not edit by hand -->"
METRICS_END = "<!-- end of the metrics table -->"
CLI_BEGIN = "<!-- the command reference: written by `python scripts/gen_reference.py`; do not edit by hand -->"
CLI_END = "<!-- end of the command reference -->"

#: What a family is queried by: a counter's samples end in _total (a histogram's in _bucket, _sum and _count).
_EXPOSED = {"counter": "{name}_total"}


class MetricFamily(msgspec.Struct, frozen=True):
    name: str
    type: str
    labels: tuple[str, ...]
    help: str


def metric_families() -> list[MetricFamily]:
    """Every family an app's registry may expose, as the app builds it (:class:`~edgecache.metrics.Metrics`, the
    admission gate's gauges, the ledger's collector with a box price), with those exported only sometimes (the GPU
    gauges where NVML sees a GPU, the ledger's cost per token once fitted) read from their collectors' ``describe``."""
    from edgecache.admission import AdmissionGate
    from edgecache.ledger import Ledger
    from edgecache.metrics import Metrics

    metrics = Metrics()
    metrics.track_admission(AdmissionGate(max_running=1, max_queue=1, queue_timeout_s=1, retry_after_s=1))
    metrics.registry.register(Ledger(price_per_hour=1.0, currency="USD").collector())
    found: dict[str, MetricFamily] = {}
    # prometheus_client keeps a registry's collectors in _collector_to_names; a metric object's labels are in
    # _labelnames (families built by a collector carry theirs the same way).
    for collector in list(metrics.registry._collector_to_names):  # noqa: SLF001
        for family in _families(collector):
            found.setdefault(family.name, family)
    return sorted(found.values(), key=lambda f: f.name)


def _families(collector: Any) -> Iterator[MetricFamily]:
    from prometheus_client.metrics import MetricWrapperBase

    if isinstance(collector, MetricWrapperBase):
        described = collector.describe()
        labels = tuple(collector._labelnames)  # noqa: SLF001
        for family in described:
            yield MetricFamily(family.name, family.type, labels, family.documentation)
        return
    describe = getattr(collector, "describe", None)
    for family in (describe() if describe is not None else collector.collect()):
        yield MetricFamily(family.name, family.type, tuple(getattr(family, "_labelnames", ())), family.documentation)


def metrics_table() -> str:
    rows = ["| family | type | labels | what it counts |", "|---|---|---|---|"]
    for family in metric_families():
        exposed = _EXPOSED.get(family.type, "{name}").format(name=family.name)
        labels = ", ".join(f"`{label}`" for label in family.labels)
        rows.append(f"| `{exposed}` | {family.type} | {labels} | {_escape(family.help)} |")
    return "\n".join(rows)


def cli_reference() -> str:
    """Every ``edgecache`` command, its arguments and flags (with their variables and defaults), from the CLI."""
    import typer

    from edgecache.cli.main import app

    root = typer.main.get_command(app)
    sections: list[str] = []
    for path, command in _commands(root, "edgecache"):
        if getattr(command, "list_commands", None) is not None:
            continue  # a group: its commands follow
        lines = [f"### `{path}`", "", _paragraph(command.help or ""), ""]
        params = [p for p in command.params if not getattr(p, "hidden", False)]
        if params:
            lines += ["| argument or flag | variable | default | what it does |", "|---|---|---|---|"]
            for param in params:
                lines.append(f"| {_param_name(param)} | {_envvar(param)} | {_default(param)} | "
                             f"{_escape(_paragraph(getattr(param, 'help', None) or ''))} |")
            lines.append("")
        sections.append("\n".join(lines))
    return "\n".join(sections).rstrip()


def _commands(command: Any, path: str) -> Iterator[tuple[str, Any]]:
    yield path, command
    list_commands = getattr(command, "list_commands", None)
    if list_commands is None:
        return
    from typer._click.core import Context  # typer's own click, which its commands are built on

    context = Context(command)
    for name in list_commands(context):
        yield from _commands(command.get_command(context, name), f"{path} {name}")


def _param_name(param: Any) -> str:
    if param.param_type_name == "argument":
        return f"`{param.name.upper()}`" + ("" if param.required else " (optional)")
    names = [*param.opts, *param.secondary_opts]
    metavar = "" if param.is_flag else f" {param.metavar or param.name.upper()}"
    shown = " / ".join(f"`{name}{metavar if name.startswith('--') and name in param.opts else ''}`"
                       for name in names)
    return shown + (" (repeatable)" if param.multiple else "")


def _envvar(param: Any) -> str:
    envvar = getattr(param, "envvar", None)
    return f"`{envvar}`" if envvar else ""


def _default(param: Any) -> str:
    if param.param_type_name == "argument" or param.default is None or param.default == ():
        return ""
    if param.is_flag:
        return "off" if param.default is False else "on"
    return f"`{param.default}`"


def _paragraph(text: str) -> str:
    return " ".join(text.split())


def _escape(text: str) -> str:
    return text.replace("|", "\\|")
