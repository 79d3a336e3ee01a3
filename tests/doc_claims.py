"""What README.md and docs/ claim, and what the code has, for `tests/test_docs.py`.

The code's side is introspected, never scraped: the CLI flags from the real argparse tree
(`ros.cli.build_parser`, and each benchmark's own parser, which `tensorhub bench NAME` builds
when it runs), the RPCs from the proto's descriptor, the errors from `tensorhub.errors`'
registry. The docs' side is read from their Markdown: inline code spans and the lines of
fenced blocks ("snippets"), where a flag after `tensorhub COMMAND` belongs to that command.
"""

from __future__ import annotations

import argparse
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

Path_ = tuple[str, ...]  # a command path: ("tenant", "create"), ("bench", "scale"), () the top

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE = re.compile(r"(`+)(.+?)\1")
_SHELL_BREAK = {"|", "||", "&&", ";", "&", "#"}


# -- the code's side -----------------------------------------------------------------------


def _walk(parser: argparse.ArgumentParser, path: Path_, tree: dict[Path_, set[str]]) -> None:
    """Every public option string of `parser` and its subcommands, by command path."""
    flags = tree.setdefault(path, set())
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                _walk(sub, (*path, name), tree)
        elif action.help != argparse.SUPPRESS:
            flags.update(action.option_strings)


class _Built(Exception):
    """Raised from `parse_args` to hand back the parser a benchmark built."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _bench_parsers() -> dict[str, argparse.ArgumentParser]:
    """The parser each `tensorhub bench NAME` parses its own flags with, as `bench.cli.run`
    builds it: the run is stopped at its first `parse_args`, before it does anything."""
    from bench import cli as bench_cli

    def built(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Built(self)

    original = argparse.ArgumentParser.parse_args
    sigterm = signal.getsignal(signal.SIGTERM)  # `bench scale` installs its own first
    parsers: dict[str, argparse.ArgumentParser] = {}
    argparse.ArgumentParser.parse_args = built  # type: ignore[method-assign]
    try:
        for name in bench_cli.NAMES:
            try:
                bench_cli.run(argparse.Namespace(name=name, rest=[]))
            except _Built as caught:
                parsers[name] = caught.parser
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
        if sigterm is not None:  # None: a handler not set from Python, left as it is
            signal.signal(signal.SIGTERM, sigterm)
    return parsers


def cli_flags() -> dict[Path_, set[str]]:
    """Every public flag of `tensorhub`, by command path (`()`: the top-level flags)."""
    from ros.cli import COMMANDS, build_parser

    tree: dict[Path_, set[str]] = {}
    for command in COMMANDS:  # only the wanted command's module is loaded into a parser
        whole: dict[Path_, set[str]] = {}
        _walk(build_parser(command), (), whole)
        for path, flags in whole.items():
            if path[:1] in ((), (command,)):
                tree.setdefault(path, set()).update(flags)
    for name, parser in _bench_parsers().items():
        _walk(parser, ("bench", name), tree)
    return tree


def rpc_names() -> set[str]:
    """The methods of the `tensorhub.v1.TensorHub` service, from the proto's descriptor."""
    from ros.proto.tensorhub.v1 import hub_pb2

    service = hub_pb2.DESCRIPTOR.services_by_name["TensorHub"]
    return {method.name for method in service.methods}


def error_names() -> set[str]:
    """Every class of the one error tree (`tensorhub.errors`, re-exported by `ros`)."""
    from tensorhub.errors import registered

    return set(registered())


# -- the docs' side ------------------------------------------------------------------------


@dataclass(frozen=True)
class Snippet:
    """An inline code span, or one (continued) line of a fenced block, of one doc."""

    doc: str
    line: int
    text: str
    block: bool


def _logical_lines(lines: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """Fenced lines joined where a command goes on: after a trailing `\\`, and usage lines
    that start with `[--` or `--`."""
    start, pending, goes_on = 0, "", False
    for number, line in lines:
        stripped = line.strip()
        if pending and not goes_on and not stripped.startswith(("[-", "--")):
            yield start, pending
            pending = ""
        if not pending:
            start = number
        goes_on = stripped.endswith("\\")
        pending = (pending + " " + stripped.rstrip("\\")).strip()
    if pending:
        yield start, pending


def snippets(path: Path) -> Iterator[Snippet]:
    """The code of `path`: each (logical) line of a fenced block, and each inline span
    outside fences."""
    block: list[tuple[int, str]] | None = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if _FENCE.match(line):
            if block is not None:
                for start, text in _logical_lines(block):
                    yield Snippet(path.name, start, text, True)
            block = [] if block is None else None
        elif block is not None:
            block.append((number, line))
        else:
            for match in _INLINE.finditer(line):
                yield Snippet(path.name, number, match.group(2).strip(), False)


def prose(path: Path) -> Iterator[tuple[int, str]]:
    """Each line of `path` outside fences, inline code removed."""
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            yield number, _INLINE.sub(" ", line)


@dataclass(frozen=True)
class FlagUse:
    """A flag the docs name: `command` is the `tensorhub` command it follows (None: a flag
    named alone, or in prose), `foreign` the other program a snippet runs (etcd, pytest...)."""

    doc: str
    line: int
    flag: str
    command: Path_ | None
    foreign: str | None


def _command(words: list[str], start: int, tree: dict[Path_, set[str]]) -> Path_:
    """The longest command path of `tree` spelled by `words[start:]`."""
    path: Path_ = ()
    for word in words[start:]:
        if (*path, word) not in tree:
            break
        path = (*path, word)
    return path


def flag_uses(path: Path, tree: dict[Path_, set[str]]) -> Iterator[FlagUse]:
    """Every `--flag` of `path`, with the command it belongs to where a snippet says."""
    for snippet in snippets(path):
        words = snippet.text.lstrip("$ ").split()
        command: Path_ | None = None
        foreign: str | None = None
        first = words[0] if words else ""
        if (first,) in tree and not first.startswith("-") and not snippet.block:
            command = _command(words, 0, tree)  # `publish --until-replicated N`
        elif first and not first.startswith("-") and first != "tensorhub" and snippet.block:
            foreign = first  # a line of another program (or of output)
        for index, word in enumerate(words):
            if word == "tensorhub" or word.endswith("/tensorhub"):
                command, foreign = _command(words, index + 1, tree), None
            elif word in _SHELL_BREAK:
                command, foreign = None, None
            for flag in FLAG.findall(word.split("=", 1)[0]):
                yield FlagUse(snippet.doc, snippet.line, flag, command, foreign)
    for number, line in prose(path):
        for flag in FLAG.findall(line):
            yield FlagUse(path.name, number, flag, None, None)


def mentions(pattern: re.Pattern[str]) -> Iterator[tuple[str, int, str]]:
    """(doc, line, match) of `pattern` over every doc, code and prose alike."""
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in pattern.finditer(line):
                yield path.name, number, match.group(1) if pattern.groups else match.group(0)


def table_cells(path: Path, first_header: str) -> Iterator[tuple[int, list[str]]]:
    """The rows (line, cells) of every table in `path` whose first header cell is
    `first_header`."""
    table: bool | None = None  # None: not in a table; else whether it is one of those
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.startswith("|"):
            table = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if table is None:
            table = cells[0] == first_header
        elif table and not set(cells[0]) <= {"-", ":", " "}:
            yield number, cells
