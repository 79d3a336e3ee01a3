"""A fetch's read token, renewed before it expires.

The hub issues a read token at Resolve, valid for `READ_TOKEN_TTL` (300 s; the hub's
`read_token_ttl`), and holders check it on every GET. A fetch that takes longer (a large
model over slow links) would be refused part-way by every holder. So the data plane asks a
`RenewingToken` for the token before each GET (transport.reader's token source), and it
fetches a fresh one — a Resolve without the manifest — once the current one is within
`margin` of its expiry: `RENEW_MARGIN` (60 s, room for clock skew between hosts), but at
most half the token's life as received (a short-lived token is renewed in its second half).

A renewal that fails (the hub is down for a moment) keeps the current token, which is
still valid, and is tried again after the wait of `RENEWAL_POLICY` (`RETRY_AFTER`, 1 s);
only the caller's deadline ends the fetch. This is no loop: the next GET that wants the
token makes the next try, so the policy gives the wait, not the sleep. One renewal runs at a
time: other workers keep sending the current token meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from consistency.retry import RENEWAL_POLICY, RENEWAL_WAIT, RetryPolicy
from tensorhub.errors import TensorHubError

log = logging.getLogger(__name__)

RENEW_MARGIN = 60.0  # seconds before expiry a token is renewed (at most half its life)
RETRY_AFTER = RENEWAL_WAIT  # seconds between attempts when a renewal failed

Renew = Callable[[], tuple[bytes, int]]
"""Obtain a fresh token and its expiry (unix seconds): a Resolve with omit_manifest."""


class RenewingToken:
    """The current read token of one fetch; call it for the token to send now. Thread-safe."""

    def __init__(
        self,
        token: bytes,
        expiry: int,
        renew: Renew,
        *,
        margin: float = RENEW_MARGIN,
        clock: Callable[[], float] = time.time,
        policy: RetryPolicy = RENEWAL_POLICY,
    ) -> None:
        self._renew, self._margin_cap, self._clock = renew, margin, clock
        self._policy = policy
        self._failures = 0  # failed renewals since the last success
        self._lock = threading.Lock()
        self._renewing = False
        self._next_try = 0.0
        self.renewals = 0  # tokens obtained by renewal (not counting `offer`)
        self._set(token, expiry)

    def _set(self, token: bytes, expiry: int) -> None:
        """Adopt `token` (caller holds the lock, or is the constructor)."""
        self._token, self._expiry = token, expiry
        life = expiry - self._clock()
        self._margin = min(self._margin_cap, max(life, 0.0) / 2)

    @property
    def expiry(self) -> int:
        return self._expiry

    def offer(self, token: bytes, expiry: int) -> None:
        """A token that came anyway (a Resolve to refresh the holders): adopt it if it
        lives longer than the current one."""
        if token:
            with self._lock:
                if expiry > self._expiry:
                    self._set(token, expiry)

    def __call__(self) -> bytes:
        with self._lock:
            now = self._clock()
            due = self._expiry - now <= self._margin
            if not due or self._renewing or now < self._next_try:
                return self._token
            self._renewing = True
        renewed: tuple[bytes, int] | None = None
        failed: BaseException | None = None
        try:
            renewed = self._renew()
        except TensorHubError as exc:
            failed = exc
            log.warning("read token not renewed (%s); the current one expires at %d", exc,
                        self._expiry)  # fmt: skip
        finally:  # whatever happened, the next call may try again, after the policy's wait
            with self._lock:
                self._renewing = False
                self._failures = 0 if failed is None else self._failures + 1
                # never sooner than the first wait, even after a renewal that did not extend
                self._next_try = now + self._policy.delay(max(self._failures, 1), failed)
                if renewed is not None and renewed[1] > self._expiry:
                    self._set(*renewed)
                    self.renewals += 1
        return self._token
