"""A `PublishShards` call's manifests checked in the replica's checking processes: the
shards whose manifest check is deferred there, each chunk's verdicts, and the staging of a
chunk in a worker.

A group call checks each shard on the event loop but its manifest, which a checking
process (`ros.hub.manifest_processes`) decides for a whole chunk at once; a shard that
passed is staged as checked, one that did not (or that no process answered) is checked
again as it is staged and refused with its own error. This plumbing is apart from the
publish handlers (`ros.hub.rpc_publish`), which only hand it their stagings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ros.hub.manifest_processes import ManifestCheck, ManifestProcesses
from ros.hub.shard_publish import ShardJob
from ros.manifest_check import check_manifest_bytes

# A checked shard's staging: called (in a worker), it stages the shard and returns its job.
Staging = Callable[[], tuple[str, int, ShardJob]]


@dataclass(frozen=True)
class Deferred:
    """A group call's shard checked but for its manifest, which a checking process decides
    before its chunk is staged (`verified`): `check`, that manifest;
    `then`, its staging once it passed. Called itself, it checks the manifest here first,
    as an undeferred shard's staging follows its check: a refusal is the one its own
    Publish would get, and nothing is staged."""

    check: ManifestCheck
    then: Staging

    def __call__(self) -> tuple[str, int, ShardJob]:
        check_group_manifest(self.check)
        return self.then()


def check_group_manifest(check: ManifestCheck) -> None:
    """Every rule of a group call's manifest, from its bytes (`check_manifest_bytes`)."""
    manifest, what, model, version = check
    check_manifest_bytes(manifest, what, model=model, version=version)


def stage_all(stagings: list[Staging]) -> list[tuple[str, int, ShardJob] | BaseException]:
    """A chunk of a group call's checked shards staged, in a worker: each one's job, or the
    error that refuses it alone."""
    staged: list[tuple[str, int, ShardJob] | BaseException] = []
    for staging in stagings:
        try:
            staged.append(staging())
        except Exception as exc:  # the shard's own refusal, as its Publish would name it
            staged.append(exc)
    return staged


async def verified(processes: ManifestProcesses, stagings: list[Staging]) -> list[Staging]:
    """A chunk of a group call's checked shards, their manifests left to a checking
    process (`Deferred`) decided there: one that passed is staged as checked, one that
    did not is checked again as it is staged, which refuses it with its own error (as is
    every one, where no process answers)."""
    checks = [s.check for s in stagings if isinstance(s, Deferred)]
    verdicts = await processes.passes(checks) if checks else None
    if verdicts is None:
        return stagings
    passed = iter(verdicts)
    return [s.then if isinstance(s, Deferred) and next(passed) else s for s in stagings]
