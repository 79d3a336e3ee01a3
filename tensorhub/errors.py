"""The one exception tree of TensorHub (docs/design.md, "Errors and outcomes"), and its
registry of gRPC codes.

Every error a caller can see derives from `TensorHubError`, and every such class is defined
here. Each one is registered where it is defined, with the gRPC status code the hub answers
it with (`@_code(...)`, after kazoo's `exceptions.py`): the hub sends the code and the class
name (`ros.errors`), and the SDK rebuilds the same class from `registered()`, so both
directions read one table and no list is kept by hand elsewhere. `default_for` names the
class a status code stands for when a reply names no class (gRPC's own refusals, a proxy).
Extra attributes named in `fields` (e.g. `RevisionCompacted.compact_revision`) travel with
the name and are set again on the client.

Outcome rule: errors raised before anything reached etcd (`InvalidName`, `InvalidArgument`,
`PermissionDenied`, `QuotaExceeded`, `StaleVersion`) guarantee that nothing was written.
`OutcomeUnknown` (and a `DeadlineExceeded` raised during a write) means the write may or may
not have happened; read back (`latest()`, `inspect`) to find out. It is only ever raised for
a write: a read that fails in an unexpected way is an `InternalError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import ClassVar, TypeVar

_BY_NAME: dict[str, type[TensorHubError]] = {}
_DEFAULTS: dict[str, type[TensorHubError]] = {}

E = TypeVar("E", bound="type[TensorHubError]")


def _code(code: str, *, default_for: tuple[str, ...] = ()) -> Callable[[E], E]:
    """Register the decorated class under its name with gRPC status `code` (a
    `grpc.StatusCode` name); it is also what a bare reply with a status in `default_for`
    becomes. A name or default registered twice is a programming error, raised at import."""

    def register(cls: E) -> E:
        if cls.__name__ in _BY_NAME:
            raise TypeError(f"two TensorHub errors are named {cls.__name__}")
        cls.code = code
        _BY_NAME[cls.__name__] = cls
        for status in default_for:
            if status in _DEFAULTS:
                raise TypeError(f"{status} already defaults to {_DEFAULTS[status].__name__}")
            _DEFAULTS[status] = cls
        return cls

    return register


def registered() -> Mapping[str, type[TensorHubError]]:
    """Every registered error class by name (read-only): what the SDK rebuilds from."""
    return MappingProxyType(_BY_NAME)


def default_for(status: str) -> type[TensorHubError] | None:
    """The class a reply with gRPC status `status` (a name) and no class name stands for."""
    return _DEFAULTS.get(status)


class TensorHubError(Exception):
    """Root of every TensorHub error."""

    code: ClassVar[str] = "UNKNOWN"
    # Attributes (int, float or str, with a class-level default) that travel with the name.
    fields: ClassVar[tuple[str, ...]] = ()


_code("UNKNOWN")(TensorHubError)


@_code("INVALID_ARGUMENT", default_for=("INVALID_ARGUMENT",))
class InvalidArgument(TensorHubError):
    """The request is malformed; nothing was changed."""


@_code("INVALID_ARGUMENT")
class NoUsableTransport(InvalidArgument):
    """A holder advertises no transport this reader can use (e.g. only `rdma`, and this
    machine has no RDMA device); the message gives each kind's reason. The SDK skips such a
    holder and reads the others (`transport.selection`)."""


@_code("INVALID_ARGUMENT")
class InvalidName(InvalidArgument):
    """A tenant, model or holder name does not match the strict name pattern."""


@_code("INVALID_ARGUMENT")
class InvalidManifest(InvalidArgument):
    """A manifest breaks a rule of `ros.manifest_check` (dtype, offsets, chunks, checksums,
    names, sizes, metadata): refused by the hub before any write, by the SDK before it
    publishes, and by a reader before it uses a manifest it received."""


@_code("INVALID_ARGUMENT")
class ManifestTooLarge(InvalidArgument):
    """A manifest is larger than the documented maximum (`consistency.manifests`): nothing
    was written. Use larger chunks, or publish the model in shards."""


@_code("FAILED_PRECONDITION", default_for=("FAILED_PRECONDITION",))
class StaleVersion(TensorHubError):
    """A publish names a version that is not newer than the current latest."""


@_code("ALREADY_EXISTS", default_for=("ALREADY_EXISTS",))
class AlreadyExists(TensorHubError):
    """The object (a version, a tenant, a holder record) already exists."""


@_code("INVALID_ARGUMENT")
class BadRange(InvalidArgument):
    """A GET_RANGES frame's byte ranges are unacceptable: none or more than
    `transport.wire.MAX_RANGES_PER_GET`, an empty one, or one past the end of its chunk."""


@_code("NOT_FOUND")
class TenantNotFound(TensorHubError):
    """An admin call names a tenant that does not exist (never created, or deleted)."""


@_code("NOT_FOUND", default_for=("NOT_FOUND",))
class VersionNotFound(TensorHubError):
    """The model or version was never published, or is no longer retained."""


@_code("NOT_FOUND")
class VersionRetired(VersionNotFound):
    """The version was removed (by retention, or with its model) while a holder still had
    a record for it: the record went with it. Not a `LeaseLost`: the session is fine and
    nothing needs re-registering; fetch a version that is still published."""


@_code("UNAVAILABLE")
class VersionUnavailable(TensorHubError):
    """The version exists, but no live holder is left to read it from."""


@_code("FAILED_PRECONDITION")
class RetentionViolation(TensorHubError):
    """Releasing would drop the last complete holder of a retained version."""


@_code("FAILED_PRECONDITION")
class SpillBudgetExceeded(RetentionViolation):
    """Releasing the last complete holder of a retained version needs a spill to host memory
    that this client's spill budget cannot hold; nothing was changed. Raise the budget
    (`ros.connect(..., spill_budget=...)`), spill to a file (`release(spill=path)`), or drop
    the version knowingly (`release(force=True)`)."""


@_code("PERMISSION_DENIED", default_for=("PERMISSION_DENIED", "UNAUTHENTICATED"))
class PermissionDenied(TensorHubError):
    """The caller's token does not allow this call."""


@_code("PERMISSION_DENIED")
class EtcdAuthFailed(PermissionDenied):
    """etcd refused the hub's credentials, or asked for credentials the hub was not given.

    A configuration error of the hub's operator, not of any tenant: the message says which
    setting to look at (`consistency.credentials`).
    """


@_code("RESOURCE_EXHAUSTED")
class QuotaExceeded(TensorHubError):
    """A tenant quota (models, retained versions, sessions) would be exceeded."""


@_code("RESOURCE_EXHAUSTED")
class TooManyDeclaredLayouts(QuotaExceeded):
    """A model has as many declared layouts as it may (`MAX_DECLARED_LAYOUTS`): retire one
    (`Hub.retire_layout`) before declaring another. Nothing was written."""


@_code("ABORTED")
class LayoutsChanged(TensorHubError):
    """A whole publish carried checksums for other declared layouts than the model has now
    (one was declared or retired since the publisher read them). Nothing was written; the
    SDK reads the declarations again and publishes once more."""


# Without a class name a RESOURCE_EXHAUSTED is not the hub's quota refusal (that always
# names its class) but gRPC's own: its concurrent-call limit, or a message too large.
# Overloaded, so the SDK backs off and retries instead of reporting a quota it did not reach.
@_code("RESOURCE_EXHAUSTED", default_for=("RESOURCE_EXHAUSTED",))
class Overloaded(TensorHubError):
    """A hub replica refused a stream at one of its stream limits (per replica or per
    tenant): nothing was opened. Back off with jitter and retry, possibly on another replica.
    Not a `QuotaExceeded`: no tenant quota is full, the replica is."""


@_code("RESOURCE_EXHAUSTED")
class StorageFull(TensorHubError):
    """etcd raised its NOSPACE alarm: it refuses every write until compaction and a defrag
    free space (the hub's compactor does both, then disarms the alarm). Nothing was written."""


@_code("RESOURCE_EXHAUSTED")
class OutOfMemory(TensorHubError):
    """This process could not allocate the tensors of a version it is about to fetch (the
    manifest is valid, the version larger than this machine's memory): nothing was
    registered. Fetch `into=` memory of your own, or fetch one shard at a time."""


@_code("DEADLINE_EXCEEDED", default_for=("DEADLINE_EXCEEDED",))
class DeadlineExceeded(TensorHubError):
    """The call's deadline passed before it completed."""


@_code("UNKNOWN", default_for=("UNKNOWN",))
class OutcomeUnknown(TensorHubError):
    """A write's reply was lost: it may or may not have been applied."""


@_code("UNAVAILABLE", default_for=("UNAVAILABLE",))
class Unavailable(TensorHubError):
    """No etcd member or hub replica could be reached within the deadline."""


@_code("UNAVAILABLE")
class WriteUnconfirmed(Unavailable):
    """etcd did not confirm the request in time (request timed out, leader changed): a
    write may or may not have been applied. `Etcd.txn` raises `OutcomeUnknown` for a
    transaction that writes (`consistency.refusals`); a read may simply be retried."""


@_code("UNAVAILABLE")
class StaleRead(TensorHubError):
    """An answer was read at a revision older than one this client has already seen
    (`consistency.floor`). Retryable: another replica (or a moment later) answers fresh."""


@_code("UNAVAILABLE")
class EtcdStartError(TensorHubError):
    """An embedded etcd member did not become healthy in time (`consistency.embedded`)."""


@_code("FAILED_PRECONDITION")
class EtcdNotFound(TensorHubError):
    """No etcd server binary could be found (`consistency.etcdbin`)."""


@_code("OUT_OF_RANGE")
class RevisionCompacted(TensorHubError):
    """A read or watch asked for a revision that etcd has already compacted;
    `compact_revision` is the oldest one still kept, where etcd said (else 0)."""

    fields = ("compact_revision",)
    compact_revision: int = 0

    def __init__(self, message: str, compact_revision: int = 0) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


@_code("NOT_FOUND")
class LeaseNotFound(TensorHubError):
    """etcd does not know the lease (it expired or was revoked)."""


@_code("CANCELLED")
class StreamClosed(TensorHubError):
    """The stream was closed; no more items will come (`consistency.stream`)."""


@_code("INTERNAL", default_for=("INTERNAL",))
class InternalError(TensorHubError):
    """The hub failed with an unexpected error (a bug, logged there), or a read was answered
    UNKNOWN: not the caller's fault, and not a lost write either; retrying may or may not
    help."""


@_code("FAILED_PRECONDITION")
class EngineNotReady(TensorHubError):
    """An engine integration was used before its set-up or out of order (vLLM's `tensorhub`
    engine: an update before `init_weight_transfer_engine`, or two versions in one update;
    the Ray example's actors before their `start`)."""


@_code("INTERNAL")
class DemoFailed(TensorHubError):
    """A demo worker failed or the run could not go on (the report says why; `ros.demo`)."""


@_code("FAILED_PRECONDITION")
class LeaseLost(TensorHubError):
    """The session's lease expired or was revoked; its records are gone."""


@_code("FAILED_PRECONDITION")
class SessionExpired(LeaseLost):
    """The session a call presented no longer exists (expired or revoked).

    A `LeaseLost` about the session itself, not about one record: the SDK starts its
    recovery (a new session, every held version re-registered) when it sees this.
    """


@_code("UNAVAILABLE")
class TransportError(TensorHubError):
    """A data-plane connection failed, or a peer broke the wire protocol."""


@_code("UNAVAILABLE")
class SlowHolder(TransportError):
    """A holder sent a chunk it has below the fetch's rate floor for longer than the stall
    window (a trickler): suspected for this fetch like a silent one, its chunks moved to
    other holders (transport/pace.py)."""

    fields = ("rate",)
    rate: float = 0.0  # the bytes/s it delivered over the window it was judged on


@_code("UNAVAILABLE")
class RangesUnsupported(TransportError):
    """The holder does not know the GET_RANGES frame (it answered `BAD_FRAME`): the reader
    asks it for whole chunks instead (`transport.ranged`)."""


@_code("UNAVAILABLE")
class IpcIneligible(TransportError):
    """Same-host CUDA IPC cannot be used with this holder (another IPC namespace, driver or
    process; handles that do not open; a failed probe); the message says why. The reader
    reads the same holder over TCP instead and records the reason (`transport.ipc`)."""


@_code("DATA_LOSS", default_for=("DATA_LOSS",))
class IntegrityError(TensorHubError):
    """Bytes failed their checksum or carried the wrong version, and no holder had good ones."""


@_code("DATA_LOSS")
class WeightSyncError(IntegrityError):
    """A run of the Ray weight-sync example (deploy/ray) did not end with every live rollout
    on the trainer's bytes."""


@_code("DATA_LOSS")
class TornRead(IntegrityError):
    """The holder overwrote (or began to overwrite) the memory while a chunk was read
    (`transport.rdma.seqlock`).

    The chunk's bytes in the destination are garbage and must be fetched again, from this
    holder's next version or from another holder of this one.
    """


@_code("DATA_LOSS")
class DeltaRefused(IntegrityError):
    """A delta's bytes are not what the version's manifest says they must be, and are not
    used: an encoded chunk whose zstd frame declares another size than its chunk must decode
    to (or none), or a companion (`{model}.delta`@v) of another size than the encoded sizes
    v's manifest states. Found before anything is decoded or downloaded; the chunks are read
    whole (ros/client/delta_fetch.py)."""


@_code("UNAVAILABLE")
class HolderBusy(TransportError):
    """A holder answered BUSY: its data port is at its connection bounds with readers that
    presented read tokens (or it evicted this connection, which had not presented one yet,
    to admit another). The holder is full, not faulty: the SDK asks it again after a
    backoff, within the fetch's deadline, instead of suspecting it (transport/reader.py)."""


@_code("RESOURCE_EXHAUSTED")
class DiskFull(TensorHubError):
    """The local file system a command writes to is full (ENOSPC) or the user's quota is
    (EDQUOT): `tensorhub fetch` raises it when the free space is too small before fetching
    and when a write fails, and removes its partial output either way. Not `StorageFull`,
    which is etcd's own space on the hub's side."""
