"""The docs stay true to the code: the front page is short, no page tells how or when it was built, every link and
every file a page names exists, README's commands parse, and the settings table is what the code says."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from edgecache.settings import CONFIGURATION_BEGIN, CONFIGURATION_END, configuration_table

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".git", ".venv", ".agent-clis", ".sglang-wheel", ".vllm-venv", "node_modules", "data", ".pytest_cache", "build", "dist"}


def repository_files(*suffixes: str) -> list[Path]:
    out = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.startswith(".venv") or part.endswith(".egg-info") for part in rel.parts):
            continue
        if path.is_file() and path.suffix in suffixes:
            out.append(path)
    return sorted(out)


PAGES = repository_files(".md")

#: How a page speaks of its own making rather than of the product: an issue's number, the stretch of work that
#: produced a figure, who did what when. The product's own words ("session ids", "an ONNX session") stay allowed.
HISTORY = [
    re.compile(r"\bissues? #?\d+", re.IGNORECASE),
    re.compile(r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|next|previous|earlier|last|"
               r"this|other|another) sessions?\b(?!['’]?s? (id|ids|header)\b)", re.IGNORECASE),
    re.compile(r"\bsessions['’] work\b", re.IGNORECASE),
    re.compile(r"\b(this|last|next) round\b", re.IGNORECASE),
    re.compile(r"\bwhat was built\b", re.IGNORECASE),
    re.compile(r"\bI (did|added|built|measured|found|left|kept|tried|ran)\b"),
    re.compile(r"\bfor the lead\b|\bthe lead,", re.IGNORECASE),
]


def test_the_front_page_is_short() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; reference belongs in docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_tells_how_or_when_it_was_built(page: Path) -> None:
    found = [f"line {n}: {m.group(0)!r}" for n, line in enumerate(page.read_text().splitlines(), 1)
             for pattern in HISTORY for m in [pattern.search(line)] if m]
    assert found == []


def test_no_source_file_cites_an_issue_number() -> None:
    pattern = HISTORY[0]
    found = [f"{path.relative_to(ROOT)}:{n}" for path in repository_files(".py", ".toml", ".yml", ".yaml", ".sh")
             if path.name != "test_docs.py"
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if pattern.search(line)]
    assert found == []


LINK = re.compile(r"\]\(([^)\s]+)\)")
TOP = {p.name for p in ROOT.iterdir()} - SKIP_DIRS
# A backticked path into the repository: its first segment is a top-level entry (edgecache/, docs/, tests/, ...).
NAMED_PATH = re.compile(r"`((?:" + "|".join(re.escape(t) for t in sorted(TOP) if not t.startswith(".")) +
                        r"|\.ci)/[\w./-]*)`")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_named_file_exists(page: Path) -> None:
    text = page.read_text()
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            missing.append(f"link {target}")
    for named in NAMED_PATH.findall(text):
        cleaned = named.rstrip("/.").split("::", 1)[0]
        if any(ch in cleaned for ch in "*<>{}") or cleaned.endswith(("-", "_")):
            continue  # a pattern or a placeholder, not a file
        if not (ROOT / cleaned).exists():
            missing.append(f"path {named}")
    assert missing == []


def readme_commands() -> list[str]:
    """The `edgecache ...` lines of README's install and serve sections' code blocks."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for section in ("## Install and test", "## Serve"):
        body = text.split(section, 1)[1].split("\n## ", 1)[0]
        for block in re.findall(r"```\n(.*?)```", body, flags=re.DOTALL):
            for line in block.splitlines():
                line = line.split("  #", 1)[0].strip()
                if line.startswith("edgecache "):
                    commands.append(line)
    return commands


@pytest.mark.parametrize("command", readme_commands())
def test_readme_commands_parse(command: str) -> None:
    words = shlex.split(command)
    subcommand = [w for w in words[1:3] if not w.startswith("-")][:1]
    flags = {w.split("=", 1)[0] for w in words if w.startswith("--")}
    helped = subprocess.run([sys.executable, "-m", "edgecache.cli.main", *subcommand, "--help"], capture_output=True,
                            text=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}, timeout=120, check=False)
    assert helped.returncode == 0, helped.stderr
    unknown = sorted(flag for flag in flags if not re.search(re.escape(flag) + r"\b", helped.stdout))
    assert unknown == [], f"`edgecache {' '.join(subcommand)} --help` does not list {unknown}"


def test_the_readme_names_commands_to_check() -> None:
    assert len(readme_commands()) >= 5


def test_the_settings_table_is_what_the_code_says() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    table = page.split(CONFIGURATION_BEGIN, 1)[1].split(CONFIGURATION_END, 1)[0].strip()
    assert table == configuration_table(), "run python scripts/gen_configuration.py"
