"""Write the reference tables generated from the code into their pages: the settings table (docs/configuration.md),
every metric family (docs/operations.md) and every command and flag (docs/cli.md).

    python scripts/gen_reference.py          # rewrite the tables in place
    python scripts/gen_reference.py --check  # exit 1 when a page's table is not what the code says
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from edgecache.cli.reference import CLI_BEGIN, CLI_END, METRICS_BEGIN, METRICS_END, cli_reference, metrics_table
from edgecache.settings import CONFIGURATION_BEGIN, CONFIGURATION_END, configuration_table

DOCS = Path(__file__).resolve().parent.parent / "docs"
#: page -> (begin marker, end marker, what goes between them)
TABLES: list[tuple[Path, str, str, Callable[[], str]]] = [
    (DOCS / "configuration.md", CONFIGURATION_BEGIN, CONFIGURATION_END, configuration_table),
    (DOCS / "operations.md", METRICS_BEGIN, METRICS_END, metrics_table),
    (DOCS / "cli.md", CLI_BEGIN, CLI_END, cli_reference),
]


def rewritten(text: str, begin: str, end: str, table: str) -> str:
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{table}\n{end}{tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    stale = []
    for page, begin, end, make in TABLES:
        text = page.read_text()
        new = rewritten(text, begin, end, make())
        if new != text:
            stale.append(page.name)
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print(f"not what the code says: {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
