"""Write docs/configuration.md's settings table from the settings structs and the shipped profiles.

    python scripts/gen_configuration.py          # rewrite the table in place
    python scripts/gen_configuration.py --check  # exit 1 when the page's table is not what the code says
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edgecache.settings import CONFIGURATION_BEGIN, CONFIGURATION_END, configuration_table

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    text = PAGE.read_text()
    head, rest = text.split(CONFIGURATION_BEGIN, 1)
    _, tail = rest.split(CONFIGURATION_END, 1)
    new = f"{head}{CONFIGURATION_BEGIN}\n{configuration_table()}\n{CONFIGURATION_END}{tail}"
    if args.check:
        return 0 if new == text else 1
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
