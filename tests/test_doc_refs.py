"""Every reference the docs make to the repository resolves: files, links and tests.

`tests/test_docs.py` holds the docs to the CLI, the RPCs and the errors; this holds them to
the tree. In README.md, deploy/README.md and docs/*.md:

- a path that starts at the top of the repository (`ros/client/hub.py`, `tests/ros/`,
  `scripts/setup-system.sh`, `docs/sdk.md`; a `:LINE` after it is ignored) exists;
- a Markdown link to a file of the repository (`[sdk.md](sdk.md#errors)`, relative to the
  doc) points at a file that exists, and its `#anchor` at a heading of that file;
- a test named `tests/x.py::test_name` is defined in that file; a test named alone in
  backticks (`test_name`) is defined in a test file its paragraph names, or, when the
  paragraph names none, in some file under tests/.

Paths with a placeholder (`scripts/lock-NAME.txt`, `tests/ros/test_*.py`, `{...}`) are
patterns, not references, and are skipped. The checks run on made-up docs too
(`test_a_made_up_reference_is_caught`), so this test can fail.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md")))

# Top-level folders of the repository: a path that starts with one is a repository path.
TOP = ("bench", "chaos", "consistency", "deploy", "docs", "ros", "scripts", "tensorhub",
       "tests", "transport")  # fmt: skip
PATH = re.compile(
    rf"(?<![\w./-])((?:{'|'.join(TOP)})/[\w.@/*{{}}<>…-]*[\w/*}}>…])(?::\d+(?:-\d+)?)?(?![\w/])"
)
PLACEHOLDER = re.compile(r"[*{}<>…]|\.\.\.|(?:^|[/_.-])[A-Z]{2,}(?:$|[/_.-])")
# Names the docs give that look like repository paths and are not: verl's sync metrics.
NOT_PATHS = {"tensorhub/version", "tensorhub/send_s", "tensorhub/send_mb", "tensorhub/delta_mb"}
LINK = re.compile(r"\]\(([^)\s]+)\)")
TEST_IN_FILE = re.compile(r"(tests/[\w/]+\.py)::(?:(\w+)::)?(test_\w+)")
TEST_FILE = re.compile(r"(?<![\w/])((?:tests/(?:[\w/]+/)?)?test_\w+\.py)\b")
TEST_NAME = re.compile(r"`(test_\w+)(?:\[[^\]`]*\])?`")


@dataclass(frozen=True)
class Wrong:
    """One reference that does not resolve."""

    doc: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.what}"


def paragraphs(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, text) of each blank-line-separated block of `text`."""
    start, lines = 1, list[str]()
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            if not lines:
                start = number
            lines.append(line)
        elif lines:
            yield start, "\n".join(lines)
            lines = []
    if lines:
        yield start, "\n".join(lines)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors_of(text: str) -> frozenset[str]:
    """Every heading anchor of the Markdown `text` (repeats get `-1`, `-2`, ...)."""
    counts: dict[str, int] = {}
    found: set[str] = set()
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#{1,6}\s+(.*?)\s*#*$", line)):
            base = slug(match.group(1))
            count = counts.get(base, 0)
            counts[base] = count + 1
            found.add(f"{base}-{count}" if count else base)
    return frozenset(found)


@cache
def defined_tests(path: Path) -> frozenset[str]:
    """The test functions (and test classes' methods) defined in `path`."""
    return frozenset(re.findall(r"^\s*(?:async\s+)?def\s+(test_\w+)", path.read_text(), re.M))


@cache
def all_test_files(root: Path) -> tuple[Path, ...]:
    return tuple(sorted((root / "tests").rglob("*.py")))


def _test_file(name: str, root: Path) -> list[Path]:
    """The files a test file's name in a doc stands for: its path from the root, or, for a
    bare `test_x.py`, every file of that name under tests/."""
    if "/" in name:
        return [root / name] if (root / name).is_file() else []
    return [p for p in all_test_files(root) if p.name == name]


def check(doc: Path, text: str, root: Path = ROOT) -> Iterator[Wrong]:
    """Every reference of `text` (the doc `doc`'s) that does not resolve under `root`."""
    name = str(doc.relative_to(root)) if doc.is_relative_to(root) else doc.name
    for number, line in enumerate(text.splitlines(), 1):
        for match in PATH.finditer(line):
            path = match.group(1)
            if PLACEHOLDER.search(path) or path in NOT_PATHS or (root / path).exists():
                continue
            yield Wrong(name, number, f"no such file or folder: {path}")
        for match in LINK.finditer(line):
            target = match.group(1)
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            linked, _, anchor = target.partition("#")
            if not linked:  # a heading of this doc
                if anchor not in anchors_of(text):
                    yield Wrong(name, number, f"link to no such heading: {target}")
                continue
            where = (doc.parent / linked).resolve()
            if not where.exists():
                yield Wrong(name, number, f"link to no such file: {target}")
            elif anchor and where.suffix == ".md" and anchor not in anchors_of(where.read_text()):
                yield Wrong(name, number, f"link to no such heading: {target}")
        for match in TEST_IN_FILE.finditer(line):
            test_file, test = root / match.group(1), match.group(3)
            if test_file.is_file() and test not in defined_tests(test_file):
                yield Wrong(name, number, f"{match.group(1)} defines no {test}")
    for start, block in paragraphs(text):
        named = TEST_FILE.findall(block)
        for bare in (n for n in named if "/" not in n and not _test_file(n, root)):
            at = start + block[: block.index(bare)].count("\n")
            yield Wrong(name, at, f"no test file {bare} under tests/")
        files = [p for n in named for p in _test_file(n, root)]
        pool = files or list(all_test_files(root))
        for test in TEST_NAME.findall(block):
            if not any(test in defined_tests(p) for p in pool):
                named_in = ", ".join(sorted({str(p.relative_to(root)) for p in files}))
                at = start + block[: block.index(test)].count("\n")
                suffix = f" in {named_in}" if named_in else ""
                yield Wrong(name, at, f"no test {test}{suffix}")


def _wrong(docs: Iterable[Path]) -> list[str]:
    return [str(w) for doc in docs for w in check(doc, doc.read_text())]


def test_every_reference_of_the_docs_resolves() -> None:
    wrong = _wrong(DOCS)
    assert not wrong, "references to nothing in the repository:\n" + "\n".join(wrong)


def test_a_made_up_reference_is_caught(tmp_path: Path) -> None:
    """The checks on a doc of the real tree that names a real file, link and test of each
    kind, then a made-up one of each: only the made-up ones are reported."""
    real = (
        "# A heading\n"
        "See `ros/client/hub.py:70`, `tests/ros/`, [the SDK](sdk.md#errors) and\n"
        "[this](#a-heading); the test\n"
        "`tests/test_doc_refs.py::test_a_made_up_reference_is_caught` and, in\n"
        "`tests/test_docs.py`, `test_hub_md_lists_every_rpc`; in `test_floors.py`, a bare\n"
        "file name. A pattern:\n"
        "`scripts/lock-NAME.txt`, `tests/ros/test_*.py`.\n"
    )
    doc = ROOT / "docs" / "made-up.md"  # never written: `check` reads only the text given
    assert list(check(doc, real)) == []
    made_up = (
        "See `ros/client/nowhere.py` and [the SDK](sdk.md#no-such-heading), [gone](gone.md),\n"
        "[above](#no-heading-here).\n"
        "`tests/test_docs.py::test_that_does_not_exist`.\n"
        "\n"
        "In `tests/test_docs.py`: `test_of_another_file_is_not_here`.\n"
        "\n"
        "Alone: `test_named_nowhere_at_all`, and a file `test_nowhere.py`.\n"
    )
    found = [w.what for w in check(doc, made_up)]
    assert found == [
        "no such file or folder: ros/client/nowhere.py",
        "link to no such heading: sdk.md#no-such-heading",
        "link to no such file: gone.md",
        "link to no such heading: #no-heading-here",
        "tests/test_docs.py defines no test_that_does_not_exist",
        "no test test_of_another_file_is_not_here in tests/test_docs.py",
        "no test file test_nowhere.py under tests/",
        "no test test_named_nowhere_at_all",
    ]
    # A test that exists, but in another file than the paragraph names, is caught too.
    elsewhere = "In `tests/test_docs.py`: `test_a_made_up_reference_is_caught`.\n"
    assert [w.what for w in check(doc, elsewhere)] == [
        "no test test_a_made_up_reference_is_caught in tests/test_docs.py"
    ]


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Publisher checksums: `xxh3-64` or `wsum64`", "publisher-checksums-xxh3-64-or-wsum64"),
        ("Compaction, NOSPACE, recovery", "compaction-nospace-recovery"),
        ("Deadlines of `fetch` and `close`", "deadlines-of-fetch-and-close"),
    ],
)
def test_anchors_are_github_s(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor
