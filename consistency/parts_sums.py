"""The publisher checksums of a declared block set added up from a sharded version's parts
(`block_set_sums`), and what a version's parts add up to kept (`PartsSums`), so that its
layout readers' resolves neither read every shard's parts nor add them up again.

A version's parts (`lb/{model}/{version}/_parts/{i}`, one key a shard) are written with its
shards and never change while the version exists: retention and `DeleteModel` delete them
with it, in one range delete. So what they add up to is a function of the version's
incarnation, named by its first part key's create revision (a version deleted and
published again under the same number has new keys, so other revisions): a resolve of a
sharded version reads the first `PARTS_PAGE` part keys in its own transaction (all of them
for a version of at most that many shards), and the rest, and the adding up of every
declared block set's sums, once per incarnation (`PartsSums.get_or_add`); its next ones
look the sums up (a ResolveLayout of a 2 MiB layout, in-process hub, medians of 15 in
interleaved rounds, 2 cores, load average 2.6-3.6: 512 shards of 4 KiB 2.2-2.8 ms with the
sums kept, 100-111 ms reading and adding every page each time; 64 shards 2.3-2.5 ms kept,
3.9-4.4 ms adding their parts at each resolve). One resolve adds
them up at a time per incarnation: the readers of a rollout resolving at once wait for its
sums rather than each reading the parts.

Bounded: `MAX_SUMS` checksums in all (8 bytes each, kept as `array('Q')`), least recently
used dropped first; a version whose sums alone pass it is not kept (its resolves add them
up each time, each bounded by `MAX_PARTS_READ_BYTES`).
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from consistency.etcd import Etcd
from tensorhub.declared_records import (
    MAX_PARTS_READ_BYTES,
    MAX_PARTS_SHARDS,
    PARTS_PAGE,
    add_all_parts,
    add_parts,
)
from tensorhub.errors import DeadlineExceeded
from tensorhub.lru import SizedLru

log = logging.getLogger(__name__)

MAX_SUMS = 1 << 21
"""Checksums kept in all (16 MiB), a version weighed as its checksums and 1,024 more (its
keys, its dict): a few versions at `MAX_PUBLISHER_SUMS` chunks a layout, or 2,048 versions
without any (a version whose parts do not add up, kept as such)."""

Key = tuple[str, str, int, int]
"""(tenant, model, version, the create revision of its first part key)."""

Sums = dict[tuple[str, str], "array[int]"]
"""Per (layout, block set), its chunks' checksums."""


def _weight(sums: Sums) -> int:
    return 1024 + sum(len(values) for values in sums.values())


class PartsSums:
    """Per version incarnation (`Key`), the publisher checksums of every declared block set
    its shards' parts add up to (`tensorhub.lru.SizedLru`, least recently used dropped
    first). Thread-safe; one caller adds up a key's sums at a time, the others wait."""

    def __init__(self, max_sums: int = MAX_SUMS) -> None:
        self._kept: SizedLru[Key, Sums] = SizedLru(max_sums, _weight)
        self._loading: dict[Key, threading.Lock] = {}
        self._lock = threading.Lock()

    def get_or_add(
        self,
        key: Key,
        add: Callable[[], Mapping[tuple[str, str], list[int]]],
        timeout: float | None = None,
    ) -> Mapping[tuple[str, str], Sequence[int]]:
        """The sums kept for `key`, else `add()`'s (kept within the bound). Callers of one
        key wait for the one that adds them up, at most `timeout` seconds (None: as long as
        it takes, itself bounded by its reads' timeouts): `DeadlineExceeded` past it."""
        found = self._kept.get(key)
        if found is not None:
            return found
        with self._lock:
            gate = self._loading.setdefault(key, threading.Lock())
        if not gate.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            raise DeadlineExceeded(
                f"the publisher checksums of {key[1]}@{key[2]} are being added up by another "
                f"resolve, not done within {timeout:.1f} s"
            )
        try:
            found = self._kept.get(key)
            if found is not None:
                return found
            try:
                sums: Sums = {at: array("Q", values) for at, values in add().items()}
                self._kept.put(key, sums)
            finally:
                with self._lock:
                    self._loading.pop(key, None)
        finally:
            gate.release()
        return sums

    def __len__(self) -> int:
        return len(self._kept)


def block_set_sums(
    etcd: Etcd,
    prefix: str,
    first: Any,
    revision: int,
    cache: PartsSums | None,
    version: tuple[str, str, int],
    layout: str,
    block_set: str,
    timeout: float | None = None,
) -> list[int]:
    """The publisher checksums of `block_set` of `layout` from the parts under `prefix`
    (`Keys.publisher_parts` of `version`: tenant, model, number), [] if they do not add
    up (`add_parts`). `first`: the first `PARTS_PAGE` part keys as the resolve's
    transaction read them at `revision` (an etcd RangeResponse); the others, if any, are
    read a page at a time at that revision. With `cache`, they are added up once per
    version incarnation, all block sets at once."""
    if not first.kvs:  # no shard wrote parts
        return []
    values = [bytes(kv.value) for kv in first.kvs]
    if cache is None and not first.more:
        return add_parts(values, layout, block_set)

    def add() -> dict[tuple[str, str], list[int]]:
        if not first.more:
            return add_all_parts(values)
        rest = _rest(etcd, prefix, bytes(first.kvs[-1].key), sum(map(len, values)),
                     revision, timeout)  # fmt: skip
        return {} if rest is None else add_all_parts(values + rest)

    key = (*version, int(first.kvs[0].create_revision))
    found = cache.get_or_add(key, add, timeout) if cache is not None else add()
    return list(found.get((layout, block_set), []))


def _rest(
    etcd: Etcd, prefix: str, last: bytes, read: int, revision: int, timeout: float | None
) -> list[bytes] | None:
    """The values of the part keys under `prefix` after `last`, a page at a time, at
    `revision`; None (logged) past `MAX_PARTS_READ_BYTES` (`read` of them read already) or
    `MAX_PARTS_SHARDS` keys."""
    out: list[bytes] = []
    count = PARTS_PAGE
    more = True
    while more:
        after = last[len(prefix) :].decode()
        kvs, more = etcd.page(prefix, after, PARTS_PAGE, revision=revision, timeout=timeout)
        out += (bytes(kv.value) for kv in kvs)
        read += sum(len(kv.value) for kv in kvs)
        count += len(kvs)
        if read > MAX_PARTS_READ_BYTES or count > MAX_PARTS_SHARDS:
            log.warning(
                "%s: parts of publisher checksums over %d bytes or %d shards: no sums",
                prefix, MAX_PARTS_READ_BYTES, MAX_PARTS_SHARDS,
            )  # fmt: skip
            return None
        if not kvs:
            break
        last = kvs[-1].key
    return out
