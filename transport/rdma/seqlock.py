"""The epoch word that guards one-sided reads (docs/design.md, "The mutability contract").

A holder cannot see RDMA readers, so it cannot wait for them before overwriting. Instead it
keeps an 8-byte epoch next to the weights: it bumps the epoch to an odd value before it
changes any advertised byte and to the next even value when it is done. A reader reads the
epoch before and after each chunk; the chunk is good only if both reads saw the same even
value, and that value is the one the holder advertised with the version (so a chunk of
v+1, fully written after a completed overwrite, is not mistaken for v).
"""

from __future__ import annotations

__all__ = ["EPOCH_BYTES", "EPOCH_MODULUS", "bump_epoch", "epoch_ok"]

EPOCH_BYTES = 8
EPOCH_MODULUS = 1 << 64


def bump_epoch(epoch: int) -> int:
    """The epoch after one bump; wraps at 2**64, which keeps parity (2**64 is even)."""
    return (epoch + 1) % EPOCH_MODULUS


def epoch_ok(before: int, after: int, expected: int | None = None) -> bool:
    """Whether a chunk read between epoch reads `before` and `after` is clean.

    Clean means: no writer was active when the read began (`before` is even), none started
    before it ended (`after == before`), and, when given, the epoch is the one the version
    was advertised under (`expected`). Values are 64-bit words as read from the wire.
    """
    if before != after or before % 2:
        return False
    return expected is None or before == expected
