"""The one exception tree of TensorHub (DESIGN.md §5).

Every error a caller can see derives from `TensorHubError`. The `code` attribute names the
gRPC status code the hub maps the error to; `ros.errors` turns codes back into these classes
on the client side, so both directions live in one table.

Outcome rule: errors raised before anything reached etcd (`InvalidName`, `InvalidArgument`,
`PermissionDenied`, `QuotaExceeded`, `StaleVersion`) guarantee that nothing was written.
`OutcomeUnknown` (and a `DeadlineExceeded` raised during a write) means the write may or may
not have happened; read back (`latest()`, `inspect`) to find out.
"""

from __future__ import annotations


class TensorHubError(Exception):
    """Root of every TensorHub error."""

    code: str = "UNKNOWN"


class InvalidArgument(TensorHubError):
    """The request is malformed; nothing was changed."""

    code = "INVALID_ARGUMENT"


class InvalidName(InvalidArgument):
    """A tenant, model or holder name does not match the strict name pattern."""


class InvalidManifest(InvalidArgument):
    """A manifest breaks a rule of `ros.manifest_check` (dtype, offsets, chunks, checksums,
    names, sizes, metadata): refused by the hub before any write, by the SDK before it
    publishes, and by a reader before it uses a manifest it received."""


class StaleVersion(TensorHubError):
    """A publish names a version that is not newer than the current latest."""

    code = "FAILED_PRECONDITION"


class AlreadyExists(TensorHubError):
    """The object (a version, a tenant, a holder record) already exists."""

    code = "ALREADY_EXISTS"


class TenantNotFound(TensorHubError):
    """An admin call names a tenant that does not exist (never created, or deleted)."""

    code = "NOT_FOUND"


class VersionNotFound(TensorHubError):
    """The model or version was never published, or is no longer retained."""

    code = "NOT_FOUND"


class VersionUnavailable(TensorHubError):
    """The version exists, but no live holder is left to read it from."""

    code = "UNAVAILABLE"


class RetentionViolation(TensorHubError):
    """Releasing would drop the last complete holder of a retained version."""

    code = "FAILED_PRECONDITION"


class SpillBudgetExceeded(RetentionViolation):
    """Releasing the last complete holder of a retained version needs a spill to host memory
    that this client's spill budget cannot hold; nothing was changed. Raise the budget
    (`ros.connect(..., spill_budget=...)`), spill to a file (`release(spill=path)`), or drop
    the version knowingly (`release(force=True)`)."""


class PermissionDenied(TensorHubError):
    """The caller's token does not allow this call."""

    code = "PERMISSION_DENIED"


class QuotaExceeded(TensorHubError):
    """A tenant quota (models, retained versions, sessions) would be exceeded."""

    code = "RESOURCE_EXHAUSTED"


class Overloaded(TensorHubError):
    """A hub replica refused a stream at one of its stream limits (per replica or per
    tenant): nothing was opened. Back off with jitter and retry, possibly on another replica.
    Not a `QuotaExceeded`: no tenant quota is full, the replica is."""

    code = "RESOURCE_EXHAUSTED"


class StorageFull(TensorHubError):
    """etcd raised its NOSPACE alarm: it refuses every write until compaction and a defrag
    free space (the hub's compactor does both, then disarms the alarm). Nothing was written."""

    code = "RESOURCE_EXHAUSTED"


class OutOfMemory(TensorHubError):
    """This process could not allocate the tensors of a version it is about to fetch (the
    manifest is valid, the version larger than this machine's memory): nothing was
    registered. Fetch `into=` memory of your own, or fetch one shard at a time."""

    code = "RESOURCE_EXHAUSTED"


class ManifestTooLarge(InvalidArgument):
    """A manifest is larger than the documented maximum (`consistency.manifests`): nothing
    was written. Use larger chunks, or publish the model in shards."""


class DeadlineExceeded(TensorHubError):
    """The call's deadline passed before it completed."""

    code = "DEADLINE_EXCEEDED"


class OutcomeUnknown(TensorHubError):
    """A write's reply was lost: it may or may not have been applied."""

    code = "UNKNOWN"


class Unavailable(TensorHubError):
    """No etcd member or hub replica could be reached within the deadline."""

    code = "UNAVAILABLE"


class InternalError(TensorHubError):
    """The hub failed with an unexpected error (a bug, logged there): not the caller's
    fault, and not a lost write either; retrying may or may not help."""

    code = "INTERNAL"


class LeaseLost(TensorHubError):
    """The session's lease expired or was revoked; its records are gone."""

    code = "FAILED_PRECONDITION"


class SessionExpired(LeaseLost):
    """The session a call presented no longer exists (expired or revoked).

    A `LeaseLost` about the session itself, not about one record: the SDK starts its
    recovery (a new session, every held version re-registered) when it sees this.
    """


class TransportError(TensorHubError):
    """A data-plane connection failed, or a peer broke the wire protocol."""

    code = "UNAVAILABLE"


class SlowHolder(TransportError):
    """A holder sent a chunk it has below the fetch's rate floor for longer than the stall
    window (a trickler): suspected for this fetch like a silent one, its chunks moved to
    other holders (transport/pace.py)."""

    rate: float = 0.0  # the bytes/s it delivered over the window it was judged on


class IntegrityError(TensorHubError):
    """Bytes failed their checksum or carried the wrong version, and no holder had good ones."""

    code = "DATA_LOSS"
