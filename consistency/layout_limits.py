"""The bounds of the layout holder registry (`consistency.layouts`): what one Resolve or
cover reads, and how many layouts and block sets one version records.

Apart from the registry's etcd requests and from a block set's encoding: each figure of
the cost model of docs/design-notes.md ("Readers in another layout") in one place, read by
the registry when it checks a registration and ranges a block set's keys, and by the
encoding for the longest value a block set's key may hold.
"""

from __future__ import annotations

MAX_BLOCK_SUMS = 1 << 16
"""The most chunks one block set's checksums may name (512 KiB in etcd): a worker's blocks
at the default 4 MiB chunks up to 256 GiB; more answers `InvalidArgument`."""

MAX_LAYOUT_HOLDERS_READ = 64
"""How many holder keys one Resolve of a block set reads (the range's limit): the cost of
a Resolve is bounded by it, however many holders the block set has."""

MAX_BLOCK_SETS_PER_LAYOUT = 4096
"""The most block sets one layout of a version records (one per worker of a TP-4096 layout,
the bound on a version's shards); a reader whose block set would pass it is refused with
`QuotaExceeded`."""

MAX_LAYOUTS_PER_VERSION = 16
"""The most layouts whose block sets one version records: an RL job's rollouts take a few
layouts (a TP per rollout size, one per engine), and an elastic job that changes TP adds
one each time, all within a version's life of a few steps. A reader whose block set would
open one more is refused with `QuotaExceeded` (it keeps its bytes and serves none). With
`MAX_BLOCK_SETS_PER_LAYOUT`, it bounds a version's block-set keys; the tenant's etcd budget
bounds their bytes."""

MAX_BLOCK_SETS_READ = 64
"""How many block sets of a layout a reader covered by it is told of (a TP-64 layout)."""

COVER_HOLDERS_EACH = 4
"""How many holders of each of them it is told of: COMPLETE ones only (the `c/` keys), a
range of at most 4 x `MAX_BLOCK_SETS_READ` = 256 records in the cover's second read. A
cover reads each block set in one pass, not pipelined, so a PARTIAL holder (missing chunks)
is of no use to it (what no COMPLETE holder covers is read from the trainer's shards)."""

MAX_BLOCKS_BYTES = 256 * 1024
"""The longest description of a block set (its blocks' names, dtypes, boxes)."""
