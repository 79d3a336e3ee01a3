"""Fault injection comes from outside: a planted bug is a wrapper handed to the client when
it is built (around its floor, or its round reader), or a `ChunkChecks` handed to the
reader; no environment variable (TENSORHUB_PLANTED_BUG, once read here) reaches production
code.
"""

from __future__ import annotations

import time

import pytest

from chaos.holder_faults import Fault
from chaos.planted import UNCHECKED, LaxFloor, hooks_for, unchecked
from consistency.floor import RevisionFloor
from ros.client.hooks import PRODUCTION
from tensorhub.errors import IntegrityError, StaleRead
from tests.transport._model import MODEL, TENANT, make_model
from tests.transport.conftest import StartHolder
from transport.checks import STRICT, ChunkChecks
from transport.layout import Layout
from transport.reader import FetchStats, Source, fetch
from transport.store import HeldVersion
from transport.topology import Topology

CHUNK = 64 * 1024
OLD_ENV = "TENSORHUB_PLANTED_BUG"  # what switched the bugs on before


def _fetch(layout: Layout, source: Source, checks: ChunkChecks = STRICT) -> FetchStats:
    dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate())
    return fetch(
        TENANT, MODEL, 1, layout, dest, [source], token=b"t",
        deadline=time.monotonic() + 20, me=Topology(), checks=checks,
    )  # fmt: skip


@pytest.mark.parametrize("fault", [Fault(corrupt=True), Fault(wrong_version=True)])
def test_the_environment_cannot_switch_the_reader_checks_off(
    holders: StartHolder, fault: Fault, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(OLD_ENV, "no-version-check,no-revision-floor")
    model = make_model(3, tiny=50)
    layout = Layout.from_tensors(model, chunk_size=CHUNK)
    bad = holders(model, layout, name="bad", fault=fault)[2]
    with pytest.raises(IntegrityError):
        _fetch(layout, bad)


def test_the_planted_checks_take_a_corrupt_holders_bytes(holders: StartHolder) -> None:
    model = make_model(3, tiny=50)
    layout = Layout.from_tensors(model, chunk_size=CHUNK)
    bad = holders(model, layout, name="bad", fault=Fault(corrupt=True))[2]
    stats = _fetch(layout, bad, UNCHECKED)
    assert stats.failed_sources == {}
    assert stats.chunks == layout.num_chunks  # every chunk taken, the flipped bytes too


def test_the_environment_cannot_switch_the_floor_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OLD_ENV, "no-revision-floor")
    floor = RevisionFloor()
    floor.accept(10)
    with pytest.raises(StaleRead):
        floor.accept(9)
    lax = LaxFloor(floor)  # the planted bug, wrapped around the client's floor
    lax.accept(10)
    assert lax.accept(9) == 9
    assert lax.value == 9


def test_chaos_hooks_are_production_but_for_the_planted_bug() -> None:
    assert hooks_for("") == PRODUCTION
    assert hooks_for("no-version-check").read is unchecked
    assert hooks_for("no-version-check").floor is PRODUCTION.floor
    assert hooks_for("no-revision-floor").floor is LaxFloor
    assert hooks_for("no-revision-floor").read is PRODUCTION.read
    fault = Fault()
    assert hooks_for("", send=fault).send is fault


def test_the_planted_reader_runs_every_round_unchecked() -> None:
    """`unchecked` wraps the real round reader and changes nothing but its checks."""
    seen: list[dict[str, object]] = []

    def read(*args: object, **kwargs: object) -> str:
        seen.append(dict(kwargs, args=args))
        return "round"

    assert unchecked(read)(1, 2, tls=None) == "round"
    assert seen == [{"args": (1, 2), "tls": None, "checks": UNCHECKED}]
    assert PRODUCTION.read(read) is read  # production's hook is the reader itself
