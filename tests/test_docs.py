"""The docs stay true to the code: the front page is short, no page of docs/ is over 5,000 words, no page tells how or
when it was built, every link, section and file a page (or a file in deploy/ and profiles/) names exists, README's
commands parse, the generated tables (settings, metrics, commands) are what the code says, and every tenants-file
field, header and pinned version the code has is on a page."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from edgecache.cli.reference import CLI_BEGIN, CLI_END, METRICS_BEGIN, METRICS_END, cli_reference, metrics_table
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
    re.compile(r"\bfor the lead\b|\bthe lead,|\blead['’]s\b", re.IGNORECASE),
    # first-person process: "I did", "I have not checked", "we tried", "my estimate"
    re.compile(r"(?<![\w/])I (?!/)[a-z']+\b|\bI['’](ve|d|m|ll)\b"),
    re.compile(r"\b[Ww]e(['’]ve)? (tried|did|chose|found|measured|ran|kept|added|built|decided|used|picked|saw|"
               r"wrote|changed|fixed|moved|made|checked|left|followed)\b"),
    re.compile(r"\bmy\b", re.IGNORECASE),
    # the docs' own versions: "first version", "before this change", "an earlier version", "one-off script"
    re.compile(r"\b(a|an|the|its|this|our) (first|earlier|previous|older|old|former) (version|draft|reading)\b",
               re.IGNORECASE),
    re.compile(r"\bbefore (this|these|the) changes?\b", re.IGNORECASE),
    re.compile(r"\b(one-off|throwaway|throw-away) scripts?\b", re.IGNORECASE),
    # goals and issues: "Goal status", "Left to know", "#46", "the brief's examples"
    re.compile(r"\bgoals?\b|\bleft to know\b|\bhonestly\b", re.IGNORECASE),
    re.compile(r"\bthe (issue|brief)\b|\bbrief['’]s\b", re.IGNORECASE),
    re.compile(r"(?<![\w/.#-])#\d+\b"),  # an issue number; another project's (vllm-project/vllm#17045) is a citation
    re.compile(r"\bnot (run|tested|measured|checked) on (a |the )?(GPU|hardware) (here|yet)\b", re.IGNORECASE),
]


@pytest.mark.parametrize("line", [
    "I did not measure it", "I have not checked that", "I chose it over the brief's examples",
    "I followed the guidance",
    "we tried two cuts", "My estimate of the total", "A first version reached 1.24x", "before this change: 13.3",
    "an earlier version read two keys", "a one-off script on the loaded box", "a throwaway script, not in the repo",
    "Goal status, honestly:", "**Left to know.**", "see #46", "fixed in issue 46", "(lead's file)",
    "It has not run on a GPU yet", "not run on a GPU here",
])
def test_the_narration_check_catches(line: str) -> None:
    assert any(pattern.search(line) for pattern in HISTORY), line


@pytest.mark.parametrize("line", [
    "I/O errors", "an ONNX session", "the session id", "vllm-project/vllm#17045", "LMCache#4825", "the version key",
    "the model's version", "a first-turn request", "`X-EdgeCache: miss`",
])
def test_the_narration_check_passes(line: str) -> None:
    assert not any(pattern.search(line) for pattern in HISTORY), line


def test_the_front_page_is_short() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; reference belongs in docs/"


#: The most words a page of docs/ holds: a longer page mixes concerns, and is split by concern.
MAX_PAGE_WORDS = 5_000


def words(text: bytes) -> int:
    """Words as `wc -w` counts them: runs of characters between whitespace."""
    return len(text.split())


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_no_page_is_over_5000_words(page: Path) -> None:
    count = words(page.read_bytes())
    assert count <= MAX_PAGE_WORDS, f"docs/{page.name} has {count} words; split it by concern"


def test_words_are_counted_as_wc_counts_them() -> None:
    pages = sorted((ROOT / "docs").glob("*.md"))
    wc = subprocess.run(["wc", "-w", *map(str, pages)], capture_output=True, text=True, check=True,
                        env={"LC_ALL": "C.UTF-8", "PATH": "/usr/bin:/bin"}).stdout
    counted = {line.split()[1]: int(line.split()[0]) for line in wc.splitlines() if not line.endswith(" total")}
    assert counted == {str(page): words(page.read_bytes()) for page in pages}
    assert words(b"one two\tthree\n  four\n") == 4


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_tells_how_or_when_it_was_built(page: Path) -> None:
    found = [f"line {n}: {m.group(0)!r}" for n, line in enumerate(unquoted(page.read_text().splitlines()), 1)
             for pattern in HISTORY for m in [pattern.search(line)] if m]
    assert found == []


def unquoted(lines: list[str]) -> list[str]:
    """Each line without what it quotes in double quotes (a user's question, "How can I cancel my subscription?", is
    not the page speaking); a quote may run on to the next line, and a blank line ends one left open."""
    out, inside = [], False
    for line in lines:
        inside = inside and bool(line.strip())
        parts = line.split('"')
        kept = [part for i, part in enumerate(parts) if (i % 2 == 1) == inside]
        inside = inside != (len(parts) % 2 == 0)
        out.append(" ".join(kept))
    return out


def test_quoted_text_is_not_narration() -> None:
    lines = ['They ask "How can I', 'cancel my subscription?" and I did it.', "", 'We "tried" it']
    assert unquoted(lines) == ["They ask ", " and I did it.", "", "We   it"]


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


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings as GitHub makes them: lower case, punctuation but `-` and `_` dropped, spaces
    as hyphens, a repeated heading numbered (-1, -2, ...); headings inside fenced code are not headings."""
    found: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"#{1,6} (.+)", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            n, candidate = 0, slug
            while candidate in found:
                n += 1
                candidate = f"{slug}-{n}"
            found.add(candidate)
    return found


def headings(page: Path) -> set[str]:
    return {re.sub(r"^#+ ", "", line).strip() for line in page.read_text().splitlines() if re.match(r"#{1,6} ", line)}


def reference_problem(target: str, base: Path) -> str | None:
    """Why ``target`` (a path, a path#anchor or #anchor, relative to the folder ``base``) does not resolve."""
    path_text, _, anchor = target.partition("#")
    path = (base / path_text).resolve() if path_text else None
    if path is not None and not path.exists():
        return "no such file"
    if anchor and (path is None or path.suffix == ".md") and anchor not in anchors(path or base):
        return f"no section #{anchor}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_named_file_exists(page: Path) -> None:
    text = page.read_text()
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        problem = reference_problem(target, page.parent) if not target.startswith("#") else (
            None if target[1:] in anchors(page) else f"no section {target}")
        if problem:
            missing.append(f"link {target}: {problem}")
    for named in NAMED_PATH.findall(text):
        cleaned = named.rstrip("/.").split("::", 1)[0]
        if any(ch in cleaned for ch in "*<>{}") or cleaned.endswith(("-", "_")):
            continue  # a pattern or a placeholder, not a file
        if not (ROOT / cleaned).exists():
            missing.append(f"path {named}")
    assert missing == []


#: Files in deploy/ and profiles/ that name pages, sections and files of the repository in their comments.
CONFIG_FILES = [path for path in sorted((ROOT / "deploy").rglob("*")) + sorted((ROOT / "profiles").rglob("*"))
                if path.is_file() and path.suffix not in (".json", ".pyc") and path.name != "__init__.py"]
#: Names those files use for what a user creates or a model holds, not for a file of the repository.
NOT_REPOSITORY_FILES = {"tenants.toml", "config.json"}
#: A repository path (a folder of the repository, then more), or a page with an optional #anchor.
REPO_PATH = re.compile(r"(?<![\w/.~$-])((?:" + "|".join(re.escape(t) for t in sorted(TOP) if "." not in t) +
                       r")/[\w./-]*[\w/](?:#[\w-]+)?|[\w./-]+\.md(?:#[\w-]+)?|README(?:\.md)?#[\w-]+)")
#: A section named by its heading: README, "Heading" / docs/x.md's "Heading" / (docs/x.md, "Heading").
SECTION = re.compile(r"\b(README(?:\.md)?|docs/[\w-]+\.md)(?:['’]s|,)? \"([^\"]+)\"")


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_deploy_and_profiles_name_what_exists(path: Path) -> None:
    """The paths, pages, anchors and sections the comments of deploy/ and profiles/ name all exist: a path from the
    repository's root, or from the file's own folder (and, for deploy/README.md, deploy/)."""
    text = path.read_text(errors="replace")
    missing = []
    for target in REPO_PATH.findall(text):
        target = target.rstrip(".")
        name = target.split("#", 1)[0]
        if Path(name).name in NOT_REPOSITORY_FILES:
            continue
        if name.startswith("README") and not name.endswith(".md"):
            target = target.replace("README", "README.md", 1)
        problems = [reference_problem(target, base) for base in (ROOT, path.parent, path.parent.parent)]
        if all(problems):
            missing.append(f"{target}: {problems[0]}")
    for page, heading in SECTION.findall(text):
        page_path = ROOT / (page if page.endswith(".md") else "README.md")
        if heading not in headings(page_path):
            missing.append(f'{page}, "{heading}": no such section')
    assert missing == []


def readme_commands() -> list[str]:
    """The `edgecache ...` lines of README's quickstart, install and serve sections' code blocks."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for section in ("## Quickstart", "## Install and test", "## Serve"):
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


@pytest.mark.parametrize(("page", "begin", "end", "make"), [
    ("configuration.md", CONFIGURATION_BEGIN, CONFIGURATION_END, configuration_table),
    ("operations.md", METRICS_BEGIN, METRICS_END, metrics_table),
    ("cli.md", CLI_BEGIN, CLI_END, cli_reference),
], ids=["settings", "metrics", "commands"])
def test_the_generated_tables_are_what_the_code_says(page: str, begin: str, end: str, make) -> None:  # noqa: ANN001
    text = (ROOT / "docs" / page).read_text()
    table = text.split(begin, 1)[1].split(end, 1)[0].strip()
    assert table == make(), "run python scripts/gen_reference.py"


def test_every_metric_family_the_app_exports_is_in_the_table() -> None:
    """The table's generator against what a scrape of a live registry returns, as tests/test_deploy.py builds it (a
    GPU that NVML reports, the ledger with a price and a fitted cost per token)."""
    from tests.test_deploy import exported_metrics

    documented = {re.sub(r"_total$", "", name) for name in
                  re.findall(r"^\| `(edgecache_\w+)`", (ROOT / "docs" / "operations.md").read_text(), re.MULTILINE)}
    exported = {re.sub(r"_(total|bucket|sum|count|created)$", "", name) for name in exported_metrics()}
    assert exported - documented == set()


def test_every_shipped_scenario_is_in_the_settings_table() -> None:
    from edgecache.settings import profile_names, resolve_settings

    table = configuration_table()
    for name in profile_names():
        for scenario, settings in resolve_settings(name, {"data_dir": "D"}, environ={}).scenarios.items():
            assert f"`scenarios.{scenario}.target_false_hit_rate`" in table, (name, scenario)
            for field in ("threshold", "ttl_s"):
                if getattr(settings, field) is not None:
                    assert f"`scenarios.{scenario}.{field}`" in table, (name, scenario, field)


def test_every_variable_the_command_reads_is_on_a_page() -> None:
    from edgecache.settings import NOT_OVERRIDES

    page = (ROOT / "docs" / "cli.md").read_text()
    for name in sorted(NOT_OVERRIDES):
        assert f"`{name}`" in page, name


def test_every_tenants_file_field_is_on_the_tenants_page() -> None:
    """Each section and field of the tenants file (plans and their fields, tenants, admin, metrics), from the structs
    the file is read into, is named in docs/tenants.md."""
    import msgspec

    from edgecache.tenants import TenantsFile

    page = (ROOT / "docs" / "tenants.md").read_text()
    missing = []
    for section in msgspec.structs.fields(TenantsFile):
        if f"[{section.name}" not in page and f"[[{section.name}]]" not in page:
            missing.append(f"section [{section.name}]")
        inner = section.type
        for arg in getattr(inner, "__args__", ()) or (inner,):
            if isinstance(arg, type) and issubclass(arg, msgspec.Struct):
                missing += [f"{section.name}.{field.name}" for field in msgspec.structs.fields(arg)
                            if f"`{field.name}`" not in page and f"{field.name} =" not in page]
    assert missing == []


def code_headers() -> set[str]:
    """The EdgeCache headers the code reads or writes (any X-EdgeCache-* spelled in a source file), and those a
    reply carries (what :func:`reply_headers` writes for a reply with every part set) and an error (Retry-After)."""
    import msgspec

    from edgecache.errors import Overloaded
    from edgecache.http.replies import reply_headers
    from edgecache.pipeline import Reply

    names = {m.lower() for path in sorted((ROOT / "edgecache").rglob("*.py")) + sorted((ROOT / "cli").rglob("*.py"))
             for m in re.findall(r"\b[xX]-[eE]dge[cC]ache(?:-[A-Za-z]+)*", path.read_text())}
    # A reply with every optional text and number set (a field added later too), served from a hit.
    hints = typing.get_type_hints(Reply)
    given = {field.name: ("1/3" if str in typing.get_args(hints[field.name]) else 0.97)
             for field in msgspec.structs.fields(Reply) if field.default is None
             and {str, float} & set(typing.get_args(hints[field.name]))}
    names |= {name.decode() for name, _ in reply_headers(Reply(served="semantic", **given))}
    names |= {name.lower() for name in Overloaded("busy", retry_after_s=1).headers()}
    return names


def test_every_header_is_on_the_api_page() -> None:
    page = (ROOT / "docs" / "api.md").read_text().lower()
    assert sorted(name for name in code_headers() if f"`{name}" not in page) == []


def test_the_pages_name_the_pinned_sglang_release() -> None:
    """A page that cites an SGLang release cites one within the pinned range (the wheel tests/test_sglang_contract.py
    reads), unless the sentence says it is another ("older", "earlier", "since")."""
    from edgecache.engines.sglang import sglang_version_supported

    wrong = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for version in re.findall(r"\bsglang v?(\d+\.\d+\.\d+)", line, re.IGNORECASE):
                if not sglang_version_supported(version) and not re.search(r"older|earlier|since|before", line):
                    wrong.append(f"{page.relative_to(ROOT)}:{n}: {version}")
    assert wrong == []
