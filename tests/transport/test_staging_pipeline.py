"""The double-buffered staging's bookkeeping on the CPU (transport/pipeline.py): the send
side's `GatherAhead` and the receive side's `ScatterBehind`, through `LaterCopies`
(tests/transport/_later_copies.py), which runs copies only when waited for, as a copy
stream would. `HeldVersion`, the server and the channel through a staging are in
test_staging_transfer.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from tensorhub.errors import InvalidArgument
from tests.transport._later_copies import LaterCopies
from transport.copies import DONE, Event, Pair
from transport.pipeline import GatherAhead, ScatterBehind


class HostCopies:
    """Plain host buffers and synchronous copies: every copy is done when it returns."""

    def host_buffer(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8)

    def copy(self, pairs: Sequence[Pair]) -> Event:
        for dst, src in pairs:
            dst.copy_(src)
        return DONE


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 255, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def _parts(*tensors: torch.Tensor) -> Callable[[], list[torch.Tensor]]:
    return lambda: list(tensors)


# -- send side: GatherAhead ----------------------------------------------------------------


def test_gather_starts_the_next_copy_before_this_one_is_waited_for() -> None:
    copies = LaterCopies()
    g = GatherAhead(copies, 64)
    a, b, c = _bytes(40, 1), _bytes(64, 2), _bytes(10, 3)
    view = g.take("a", _parts(a[:25], a[25:]), then=("b", _parts(b)))
    assert bytes(view) == a.numpy().tobytes()
    assert copies.issued == 3
    assert len(copies.queue) == 1
    view = g.take("b", _parts(b), then=("c", _parts(c)))  # b was staged: not copied again
    assert bytes(view) == b.numpy().tobytes()
    assert copies.issued == 4
    assert len(copies.queue) == 1
    assert bytes(g.take("c", _parts(c))) == c.numpy().tobytes()
    assert copies.issued == 4


def test_gather_hands_out_the_current_chunk_again_without_copying() -> None:
    copies = LaterCopies()
    g = GatherAhead(copies, 64)
    a, b = _bytes(64, 1), _bytes(64, 2)
    first = bytes(g.take("a", _parts(a), then=("b", _parts(b))))
    assert bytes(g.take("a", _parts(a))) == first  # the checksum path: same staged bytes
    assert copies.issued == 2


def test_gather_a_buffer_is_reused_only_after_its_copy_completed() -> None:
    copies = LaterCopies()  # asserts on reuse of a busy buffer
    g = GatherAhead(copies, 64)
    chunks = {k: _bytes(64, i) for i, k in enumerate("abcdef")}
    g.take("a", _parts(chunks["a"]), then=("b", _parts(chunks["b"])))
    # the caller skipped b: c goes to a's buffer, d displaces the pending b (waited first)
    assert bytes(g.take("c", _parts(chunks["c"]), then=("d", _parts(chunks["d"])))) == bytes(
        chunks["c"].numpy()
    )
    assert bytes(g.take("d", _parts(chunks["d"]), then=("e", _parts(chunks["e"])))) == bytes(
        chunks["d"].numpy()
    )
    assert bytes(g.take("f", _parts(chunks["f"]))) == bytes(chunks["f"].numpy())


def test_gather_drain_waits_for_every_copy_and_forgets_the_chunks() -> None:
    copies = LaterCopies()
    g = GatherAhead(copies, 64)
    a, b = _bytes(64, 1), _bytes(64, 2)
    g.take("a", _parts(a), then=("b", _parts(b)))
    g.drain()
    assert not copies.queue  # no copy outlives the read
    b.fill_(7)  # the memory may change once the read ended
    assert bytes(g.take("b", _parts(b))) == bytes([7]) * 64  # copied again, not stale


def test_gather_a_failed_copy_raises_and_stages_nothing() -> None:
    copies = LaterCopies()
    g = GatherAhead(copies, 64)
    a = _bytes(64, 1)
    copies.fail = True
    with pytest.raises(RuntimeError, match="simulated"):
        g.take("a", _parts(a))
    assert bytes(g.take("a", _parts(a))) == bytes(a.numpy())  # copied again


def test_gather_refuses_a_chunk_larger_than_its_buffers() -> None:
    g = GatherAhead(HostCopies(), 16)
    with pytest.raises(InvalidArgument, match="does not fit"):
        g.take("a", _parts(_bytes(17, 1)))


# -- receive side: ScatterBehind -----------------------------------------------------------


class Commits:
    """on_done callbacks that record which chunk committed, and what its memory held then."""

    def __init__(self, dest: torch.Tensor) -> None:
        self.dest, self.done, self.seen = dest, list[int](), dict[int, bytes]()

    def of(self, index: int, span: slice) -> Callable[[], None]:
        def commit() -> None:
            self.done.append(index)
            self.seen[index] = bytes(self.dest[span].numpy())

        return commit


def _receive(s: ScatterBehind, data: torch.Tensor) -> None:
    view = s.sink(data.numel())
    view[:] = data.numpy().tobytes()


def test_scatter_commits_a_chunk_only_once_its_copy_completed() -> None:
    copies = LaterCopies()
    s = ScatterBehind(copies, 32)
    dest = torch.zeros(96, dtype=torch.uint8)
    log = Commits(dest)
    data = [_bytes(32, i) for i in range(3)]
    spans = [slice(32 * i, 32 * (i + 1)) for i in range(3)]
    _receive(s, data[0])
    s.issue([dest[spans[0]]], 0, log.of(0, spans[0]))
    assert s.settled() == []
    assert log.done == []
    assert s.pending == 1
    _receive(s, data[1])  # the other buffer: no wait
    assert log.done == []
    s.issue([dest[spans[1]]], 1, log.of(1, spans[1]))
    _receive(s, data[2])  # both busy: waits for chunk 0's copy, commits it, reuses its buffer
    assert log.done == [0]
    assert s.settled() == [0]
    s.issue([dest[spans[2]]], 2, log.of(2, spans[2]))
    assert s.flush() == [1, 2]
    assert s.pending == 0
    for i in range(3):  # every commit saw its chunk's bytes already in place
        assert log.seen[i] == bytes(data[i].numpy())
    assert bytes(dest.numpy()) == b"".join(bytes(d.numpy()) for d in data)


def test_scatter_commits_in_order_as_copies_finish_on_a_fast_device() -> None:
    s = ScatterBehind(LaterCopies(fast=True), 16)
    dest = torch.zeros(64, dtype=torch.uint8)
    log = Commits(dest)
    for i in range(4):
        _receive(s, _bytes(16, i))
        s.issue([dest[16 * i : 16 * (i + 1)]], i, log.of(i, slice(16 * i, 16 * (i + 1))))
        assert s.settled() == [i]  # polled: done at once, committed at once
    assert s.flush() == []
    assert log.done == [0, 1, 2, 3]


def test_scatter_a_buffer_received_into_but_never_issued_is_reused() -> None:
    copies = LaterCopies()
    s = ScatterBehind(copies, 16)
    dest = torch.zeros(16, dtype=torch.uint8)
    _receive(s, _bytes(16, 1))  # failed its checksum: never issued
    _receive(s, _bytes(16, 2))
    s.issue([dest], 7, lambda: None)
    assert s.flush() == [7]
    assert bytes(dest.numpy()) == bytes(_bytes(16, 2).numpy())
    with pytest.raises(InvalidArgument, match="sink"):
        s.issue([dest], 8, lambda: None)  # nothing received since


def test_scatter_a_failed_copy_commits_nothing_and_leaves_nothing_pending() -> None:
    copies = LaterCopies()
    s = ScatterBehind(copies, 16)
    dest = torch.zeros(32, dtype=torch.uint8)
    log = Commits(dest)
    for i in range(2):
        _receive(s, _bytes(16, i))
        s.issue([dest[16 * i : 16 * (i + 1)]], i, log.of(i, slice(16 * i, 16 * (i + 1))))
    copies.fail = True
    with pytest.raises(RuntimeError, match="simulated"):
        s.flush()
    assert log.done == []
    assert s.pending == 0
    assert s.settled() == []


def test_scatter_refuses_a_chunk_larger_than_its_buffers() -> None:
    s = ScatterBehind(HostCopies(), 16)
    with pytest.raises(InvalidArgument, match="does not fit"):
        s.sink(17)
