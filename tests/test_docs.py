"""README.md and docs/ against the code, both ways: what they name exists, and what exists is
named.

- CLI flags: a `--flag` the docs give after `tensorhub COMMAND` is a flag of that command
  (of `tensorhub bench NAME`'s own parser for a benchmark); one named alone or in prose is a
  flag of some command, or of another program named in `FOREIGN_FLAGS`. Every public flag of
  every command (what `tensorhub COMMAND --help` and `tensorhub bench NAME --help` show)
  appears in the docs.
- RPCs: hub.md's table of calls lists exactly the methods of `tensorhub.v1.TensorHub`, and
  an RPC the docs name (`` `X` RPC ``) is one of them.
- Errors: a name the docs give that reads as an error (`...Error`, `...Exceeded`, ...) is a
  class of `tensorhub.errors` or a Python or gRPC one, and every class of the tree appears.
- consistency.md's and transport.md's tables of modules list exactly the modules of their
  package.
"""

from __future__ import annotations

import builtins
import re

import pytest

from tests.doc_claims import (
    DOCS,
    FLAG,
    ROOT,
    Path_,
    cli_flags,
    error_names,
    flag_uses,
    mentions,
    rpc_names,
    table_cells,
)

# Flags of other programs that the docs name in prose: the program, for the reader of this.
FOREIGN_FLAGS = {
    "--auth-token-ttl": "etcd",
    "--cert-file": "etcd",
    "--client-cert-auth": "etcd",
    "--key-file": "etcd",
    "--peer-cert-file": "etcd",
    "--peer-client-cert-auth": "etcd",
    "--peer-key-file": "etcd",
    "--peer-trusted-ca-file": "etcd",
    "--quota-backend-bytes": "etcd",
    "--trusted-ca-file": "etcd",
    "--ipc": "docker run",
    "--ulimit": "docker run",
    "--strict": "mypy",
    "--resolution": "uv pip install",
    "--updates": "python -m tests.engines.vllm_cpu.memory",
    "--modes": "python -m tests.engines.vllm_cpu.memory",
    "--second": "python -m tests.engines.vllm_cpu.memory",
    "--changed": "python -m tests.engines.vllm_cpu.memory",
}
# Flags the docs name to say that they do not exist (security.md: no password on a command line).
ABSENT_FLAGS = {"--etcd-password"}
# RPCs the docs name as removed (design-notes.md records the decision).
REMOVED_RPCS = {"ElectSeed"}
# A name that reads as an error: CamelCase ending in one of these words, or `Invalid...`.
ERROR_LIKE = re.compile(
    r"\b([A-Z][A-Za-z]*(?:Error|Exception|Exceeded|NotFound|Denied|Unavailable|Unknown|"
    r"Failed|Lost|Expired|Closed|Compacted|Violation|Busy|Full|Ineligible|Retired|"
    r"Unconfirmed|Overloaded|NotReady|Gone|Refused|Rejected|Mismatch)|Invalid[A-Z][A-Za-z]*)\b"
)
# Errors of other libraries the docs name (grpc's, vLLM's, and the stdlib's beyond builtins).
OTHER_ERRORS = {"RpcError", "EngineDeadError"}
RPC_NAMED = re.compile(r"`([A-Z][A-Za-z]+)` RPC\b")


@pytest.fixture(scope="module")
def tree() -> dict[Path_, set[str]]:
    return cli_flags()


def _flags_under(tree: dict[Path_, set[str]], command: Path_) -> set[str]:
    """The flags of `command`, of its subcommands (`bench` stands for every `bench NAME`),
    and the top-level ones."""
    under = {f for path, flags in tree.items() if path[: len(command)] == command for f in flags}
    return under | tree[()]


def test_the_cli_is_introspected(tree: dict[Path_, set[str]]) -> None:
    """The tree holds every command and the benchmarks' own parsers (a guard on the test)."""
    from bench.cli import NAMES
    from ros.cli import COMMANDS

    assert {(c,) for c in COMMANDS} | {("bench", n) for n in NAMES} <= set(tree)
    assert "--listen" in tree[("serve",)]
    assert "--max-models" in tree[("tenant", "create")]
    assert "--parts" in tree[("bench", "scale")]
    assert "--plot" in tree[("bench", "fanout")]


def test_every_flag_the_docs_name_exists(tree: dict[Path_, set[str]]) -> None:
    everywhere = set().union(*tree.values())
    assert not ABSENT_FLAGS & everywhere, "a flag the docs call absent exists"
    assert not set(FOREIGN_FLAGS) & everywhere, "a foreign flag is TensorHub's: drop it here"
    wrong = []
    for path in DOCS:
        for use in flag_uses(path, tree):
            if use.foreign is not None:
                continue  # a line of another program, e.g. `etcd --client-cert-auth ...`
            if use.command is not None:
                if use.flag not in _flags_under(tree, use.command):
                    wrong.append(f"{use.doc}:{use.line}: tensorhub {' '.join(use.command)} "
                                 f"has no {use.flag}")  # fmt: skip
            elif use.flag not in everywhere | set(FOREIGN_FLAGS) | ABSENT_FLAGS:
                wrong.append(f"{use.doc}:{use.line}: no command has {use.flag}")
    assert not wrong, "\n".join(wrong)


def test_every_public_flag_is_documented(tree: dict[Path_, set[str]]) -> None:
    """Every long flag of every command, the benchmarks' own included (short ones are
    aliases: `-o` of `--output`)."""
    named = {flag for path in DOCS for flag in FLAG.findall(path.read_text())}
    missing = sorted(
        f"tensorhub {' '.join(path)} {flag}".replace("  ", " ")
        for path, flags in tree.items()
        for flag in flags
        if flag.startswith("--") and flag not in named and flag != "--help"
    )
    assert not missing, "undocumented flags:\n" + "\n".join(missing)


def test_hub_md_lists_every_rpc() -> None:
    listed: dict[str, int] = {}
    for line, cells in table_cells(ROOT / "docs" / "hub.md", "RPC"):
        for name in re.findall(r"`([A-Za-z]+)`", cells[0]):
            listed[name] = line
    assert set(listed) == rpc_names(), (
        f"hub.md's calls table misses {sorted(rpc_names() - set(listed))}, "
        f"names no such RPC: {sorted(set(listed) - rpc_names())}"
    )


def test_every_rpc_the_docs_name_exists() -> None:
    assert not REMOVED_RPCS & rpc_names(), "a removed RPC is back: drop it from REMOVED_RPCS"
    known = rpc_names() | REMOVED_RPCS
    wrong = [f"{doc}:{line}: {name}" for doc, line, name in mentions(RPC_NAMED)
             if name not in known]  # fmt: skip
    assert not wrong, "not an RPC of tensorhub.v1.TensorHub:\n" + "\n".join(wrong)
    every_rpc_named = {name for name in rpc_names()
                       if any(re.search(rf"\b{name}\b", p.read_text()) for p in DOCS)}  # fmt: skip
    assert every_rpc_named == rpc_names()


def test_every_error_the_docs_name_exists() -> None:
    known = error_names() | OTHER_ERRORS
    known |= {name for name in dir(builtins) if isinstance(getattr(builtins, name), type)}
    wrong = [f"{doc}:{line}: {name}" for doc, line, name in mentions(ERROR_LIKE)
             if name not in known]  # fmt: skip
    assert not wrong, "no such error class:\n" + "\n".join(wrong)


def test_every_error_class_is_documented() -> None:
    text = "\n".join(path.read_text() for path in DOCS)
    missing = sorted(name for name in error_names() if not re.search(rf"\b{name}\b", text))
    assert not missing, f"errors of tensorhub.errors no doc names: {missing}"


@pytest.mark.parametrize("package", ["consistency", "transport"])
def test_a_package_doc_lists_every_module(package: str) -> None:
    """docs/PACKAGE.md's table of modules names each module of the package, and no other."""
    listed = {
        name
        for _, cells in table_cells(ROOT / "docs" / f"{package}.md", "module")
        for name in re.findall(r"`([a-z_]+\.py)`", cells[0])
    }
    modules = {p.name for p in (ROOT / package).glob("*.py") if p.name != "__init__.py"}
    assert listed == modules, (
        f"{package}.md's table misses {sorted(modules - listed)}, "
        f"lists no such module: {sorted(listed - modules)}"
    )
