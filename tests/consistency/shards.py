"""Publishing one rank's shard in a test the way the hub publishes it: staged
(`VersionRegistry.stage_shard`), then committed as a batch of one by the version's
`ShardCommitter` (`VersionRegistry.shard_committer`), a refusal raised by its error."""

from __future__ import annotations

from consistency.publishing import DEFAULT_TIMEOUT, Admit, Published
from consistency.records import HolderRecord
from consistency.shard_guards import Budget
from consistency.versions import VersionRegistry
from tensorhub.errors import TensorHubError


def publish_shard(
    versions: VersionRegistry,
    tenant: str,
    model: str,
    version: int,
    index: int,
    count: int,
    manifest: bytes,
    holder: HolderRecord,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    admit_model: Admit | None = None,
    budget: Budget | None = None,
) -> Published:
    """Shard `index` of `count` of `model@version`: what the transaction did
    (`Published.visible` once it counted the last shard), or its error raised."""
    entry = versions.stage_shard(
        tenant, model, version, index, count, manifest, holder, timeout=timeout
    )
    committer = versions.shard_committer(
        tenant, model, version, admit_model=admit_model, budget=budget
    )
    outcome = committer.commit([entry])[0]
    if isinstance(outcome, TensorHubError):
        raise outcome
    return outcome
