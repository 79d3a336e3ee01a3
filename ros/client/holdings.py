"""What one client holds, with one owner: the versions it serves, their fences and shards.

`Holdings` is the one object that changes what is held: each of its methods works under one
lock, so a version cannot be forgotten in one table and kept in another (a failed publish
drops its shard with it). `reregister` is how a new session takes every held version over
after a loss (`ros.client.session` drives it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

import torch

from consistency.retry import is_retryable
from tensorhub.errors import (
    AlreadyExists,
    InvalidArgument,
    OutcomeUnknown,
    SessionExpired,
    TensorHubError,
)
from transport.store import HeldVersion, HolderStore, Key

log = logging.getLogger(__name__)

# Registers one held version under the current session: (model, version, complete, shard)
# -> the fence the hub gave the record.
Register = Callable[[str, int, bool, int | None], int]


class Holdings:
    """The versions this client serves (the holder server reads `store`), with the fence of
    each one's holder record and the shard it holds. Thread-safe."""

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        self.store = HolderStore()  # what the holder server serves: read it, change it here
        self._lock = threading.Lock()
        self._fences: dict[tuple[str, int], int] = {}
        self._shards: dict[tuple[str, int], int] = {}  # model-parallel versions held: shard
        self._layouts: set[Key] = set()  # blocks in a layout (`ros.client.layouts`)
        # registers a layout holding under the current session (set by `Hub`): (model, version)
        self.register_layout: Callable[[str, int], None] | None = None

    # -- reading -----------------------------------------------------------------------------

    def get(self, key: Key) -> HeldVersion | None:
        return self.store.get(key)

    def held(self) -> list[HeldVersion]:
        """Every version held and not released, in the order they were taken."""
        found = (self.store.get(key) for key in self.store.keys())  # noqa: SIM118  (a method)
        return [h for h in found if h is not None and not h.released]

    def fence(self, model: str, version: int, default: int = 0) -> int:
        """The fence of our holder record of `model@version` (it changes on re-registration)."""
        with self._lock:
            return self._fences.get((model, version), default)

    def shard(self, model: str, version: int) -> int | None:
        with self._lock:
            return self._shards.get((model, version))

    def check_free(self, into: Mapping[str, torch.Tensor]) -> None:
        """Refuse to fetch into memory that still serves another version (the mutability
        contract): `InvalidArgument` naming that version."""
        targets = {t.data_ptr() for t in into.values() if t.numel()}
        for held in self.held():
            if targets & {t.data_ptr() for t in held.tensors.values() if t.numel()}:
                _, model, version = held.key
                raise InvalidArgument(
                    f"`into` still serves {model}@{version}: release it before overwriting it"
                )

    # -- changing ----------------------------------------------------------------------------

    def hold(self, held: HeldVersion, shard: int | None) -> None:
        """Serve `held` (as shard `shard`, None: the whole version). A client holds one copy
        (one shard) of a version, so a second one is refused with what to do instead."""
        _, model, version = held.key
        with self._lock:
            if self.store.get(held.key) is not None:
                what = f"{model}@{version}" + ("" if shard is None else f" (asked: shard {shard})")
                raise AlreadyExists(
                    f"this client already holds {what}: release it first; model-parallel "
                    "ranks use one client each"
                )
            self.store.add(held)
            if shard is not None:
                self._shards[(model, version)] = shard

    def _reregister_layout(self, pending: set[Key], key: Key) -> None:
        """`reregister` for blocks in a layout: as for a version (a refusal for good is
        logged and dropped; what another try may get past is raised)."""
        _, model, version = key
        try:
            if self.register_layout is not None:
                self.register_layout(model, version)
        except TensorHubError as exc:
            if is_retryable(exc) or isinstance(exc, (SessionExpired, OutcomeUnknown)):
                raise
            log.error("could not re-register the blocks of %s@%d: %s", model, version, exc)
        pending.discard(key)

    def hold_layout(self, held: HeldVersion) -> None:
        """Serve a reader's blocks in a layout (`ros.client.layouts`): their record is no
        holder record of the version, so a session recovery registers them with
        `register_layout`, not as a holder of the version."""
        self.hold(held, None)
        with self._lock:
            self._layouts.add(held.key)

    def registered(self, model: str, version: int, fence: int) -> None:
        """Our holder record of `model@version` now has `fence` (forgotten if the version
        was dropped meanwhile: a record of it is left to the session's lease)."""
        with self._lock:
            if self.store.get((self.tenant, model, version)) is not None:
                self._fences[(model, version)] = fence

    def replace(self, held: HeldVersion, timeout: float) -> None:
        """Serve `held` in place of the copy with its key (a spill), no gap in between."""
        self.store.replace(held, timeout)

    def drop(self, key: Key, timeout: float) -> None:
        """Stop serving `key` (waiting up to `timeout` for reads in flight) and forget it,
        its fence and its shard with it."""
        try:
            self.store.release(key, timeout)
        finally:
            with self._lock:
                self._fences.pop((key[1], key[2]), None)
                self._shards.pop((key[1], key[2]), None)
                self._layouts.discard(key)

    def drop_all(self, timeout: float) -> None:
        """Stop serving everything (close): each version waits up to `timeout` for its reads
        in flight; one that does not is logged, and the others are released all the same."""
        for key in self.store.keys():  # noqa: SIM118  (a method, not a dict)
            try:
                self.drop(key, timeout)
            except TensorHubError as exc:
                log.warning("closing: %s", exc)

    # -- after a session loss ----------------------------------------------------------------

    def reregister(self, pending: set[Key], register: Register) -> None:
        """Register every version of `pending` under the current session, removing each from
        `pending` as it is done, so that a retry does only the rest.

        A version released meanwhile is dropped from `pending`; one the hub refuses for good
        (deleted meanwhile: `VersionNotFound`, or any other refusal) is logged and dropped,
        so it does not keep the others unregistered. A failure another try may get past (the
        hub unreachable, the new session lost too, a reply lost) is raised: the caller's
        retry loop tries again."""
        taken = self.store.keys()  # the order the versions were taken in
        pending.intersection_update(taken)  # those released meanwhile are done with
        for key in [k for k in taken if k in pending]:
            held = self.store.get(key)
            if held is None or held.released:
                pending.discard(key)
                continue
            _, model, version = key
            if key in self._layouts:  # blocks in a layout: a record of their own
                self._reregister_layout(pending, key)
                continue
            try:
                fence = register(model, version, held.complete, self.shard(model, version))
            except TensorHubError as exc:
                if is_retryable(exc) or isinstance(exc, (SessionExpired, OutcomeUnknown)):
                    raise
                log.error("could not re-register %s@%d: %s", model, version, exc)
                pending.discard(key)
                continue
            self.registered(model, version, fence)
            pending.discard(key)
