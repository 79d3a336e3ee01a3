"""The one loop that keeps a stream open: reopen it whenever it ends or breaks, with backoff,
bounded in tries and time.

Every long-lived stream of TensorHub runs in it: the watches (`consistency.stream.StreamPump`:
etcd's `WatchMux`, the SDK's `HubWatch`), the SDK's session keepalive (`ros.client.lease`) and
the hub's etcd lease keepalive (`consistency.keepalive`).

Each turn opens one stream and reads it to its end (`once`). `once` returning means the
stream ended cleanly: it is reopened at once. `once` raising means it broke. An *outage* is
the run of breaks since the stream last made progress (`progress()` moved: an event
delivered, a renewal answered): its n-th break waits the policy's backoff for try n
(`RetryPolicy.delay`: full jitter, an `Overloaded` refusal on its slower schedule), so the
clients of a server that died come back spread over the window, not in one instant. With
`at_once_after_progress` (the watches, which resume from their last event), a stream that
made progress before it broke is reopened at once instead, and the outage starts over.

Bounds:

- `stopped()` (closed, lost) ends the loop: checked after every stream, and the wait is the
  caller's `wait` (which stopping cuts short) unless the policy brings its own `sleep`;
- a failure the policy does not retry (`RetryPolicy.retryable`, `resumable`) ends the loop
  with that error;
- `policy.tries` breaks in one outage end the loop with the last one's error;
- `until()` (a lease's expiry): once past it the loop ends, and no wait takes more than
  half of what is left of it, so a try still fits before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from consistency.retry import RetryPolicy

__all__ = ["Broken", "keep_open"]

_MIN_WAIT = 0.01  # seconds: the shortest wait before an `until`-bounded reopening


class Broken(Exception):
    """A stream broke or ended, said by a caller whose streams end with no error of their
    own (a keepalive): its policy's `retry_on` names it."""


def keep_open(
    once: Callable[[], object],
    *,
    policy: RetryPolicy,
    stopped: Callable[[], bool],
    wait: Callable[[float], object],
    progress: Callable[[], int],
    resumable: bool = True,
    at_once_after_progress: bool = False,
    until: Callable[[], float] | None = None,
    on_reopen: Callable[[BaseException, float], None] | None = None,
) -> None:
    """Run `once()` until `stopped()`, reopening as the module docstring says; returns when
    stopped or past `until`, raises the failure that ended it otherwise. `on_reopen(error,
    seconds)` sees every break that is reopened, with the wait before it (0: at once)."""
    failures = 0  # breaks in this outage
    while not stopped():
        before = progress()
        try:
            once()
        except BaseException as exc:
            if stopped():
                return
            if not policy.retryable(exc, resumable=resumable):
                raise
            if progress() > before:
                failures = 0
                if at_once_after_progress:
                    if on_reopen is not None:
                        on_reopen(exc, 0.0)
                    continue
            failures += 1
            if policy.tries is not None and failures >= policy.tries:
                raise
            seconds = policy.delay(failures, exc)
            if until is not None:
                left = until() - time.monotonic()
                if left <= 0:
                    return
                seconds = max(min(seconds, left / 2), _MIN_WAIT)
            if on_reopen is not None:
                on_reopen(exc, seconds)
            (policy.sleep or wait)(seconds)
        else:
            failures = 0
