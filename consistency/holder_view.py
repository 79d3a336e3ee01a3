"""What the hub's holder index (`ros.hub.holder_index`) reads of one model in etcd, decoded:
which versions are published (the create revision of each manifest key) and their live
holder records, read whole at one revision, read for one version, or told by one watch
event of the model's prefix.

The key schema (`Keys.parse_version_key`) and the record encoding (`HolderRecord.decode`)
stay here, in `consistency`; the index keeps only what the records say.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from consistency.etcd import Etcd
from consistency.keys import Keys
from consistency.ops import KV
from consistency.records import HolderRecord
from consistency.retry import COMPACTION_RACES, LostRace
from tensorhub.errors import InvalidArgument, RevisionCompacted, Unavailable, VersionNotFound

MANIFEST, HOLDER = "manifest", "h"


@dataclass(frozen=True)
class Change:
    """One key of a model's versions, decoded: a manifest key (`kind` MANIFEST; `published`
    its create revision, 0 when deleted) or a holder record (`kind` HOLDER; `record` None
    when deleted)."""

    version: int
    kind: str
    name: str = ""
    published: int = 0
    record: HolderRecord | None = None


@dataclass
class ModelRead:
    """A model's versions read at `revision`: the published ones (version -> create
    revision of its manifest key) and the live holder records of each version that has any."""

    revision: int
    published: dict[int, int] = field(default_factory=dict)
    holders: dict[int, list[HolderRecord]] = field(default_factory=dict)


@dataclass(frozen=True)
class VersionRead:
    """One version's holder records read at `revision`, with `published`: the create
    revision of its manifest key."""

    published: int
    records: list[HolderRecord]
    revision: int


class ModelHolders:
    """Reads of one model's version and holder records (unfenced: reads only)."""

    def __init__(self, etcd: Etcd, keys: Keys, tenant: str, model: str) -> None:
        self._etcd, self._keys = etcd, keys
        self.tenant, self.model = tenant, model

    @property
    def prefix(self) -> str:
        """The model's prefix: what a watch of the model follows."""
        return self._keys.model(self.tenant, self.model)

    def change(self, kv: KV, deleted: bool) -> Change | None:
        """What one key of the model's prefix says (None: a key of no interest here, such as
        `latest`, a shard or a pin). `InvalidArgument` for a malformed holder record."""
        parsed = self._parse(kv)
        if parsed is None:
            return None
        version, kind, name = parsed
        if kind == MANIFEST:
            return Change(version, MANIFEST, published=0 if deleted else kv.create_revision)
        if kind != HOLDER:
            return None
        if deleted:
            return Change(version, HOLDER, name)
        return Change(
            version, HOLDER, name, record=HolderRecord.decode(kv.value, kv.create_revision)
        )

    def read(self, at: int) -> ModelRead:
        """One keys-only range read of the model's versions (at revision `at`; 0: now), then
        each version's holder records at that same revision; a compaction between the two
        reads starts both again (bounded: `COMPACTION_RACES`)."""

        def attempt() -> ModelRead:
            listing = self._etcd.range(
                self._keys.versions(self.tenant, self.model), prefix=True, keys_only=True,
                revision=at,
            )  # fmt: skip
            read = ModelRead(at or listing.revision)
            with_holders: set[int] = set()
            for kv in listing.kvs:
                parsed = self._parse(kv)
                if parsed is None:
                    continue
                number, kind, _ = parsed
                if kind == MANIFEST:
                    read.published[number] = kv.create_revision
                elif kind == HOLDER:
                    with_holders.add(number)
            try:
                for number in sorted(with_holders):
                    result = self._etcd.range(
                        self._keys.holders(self.tenant, self.model, number), prefix=True,
                        revision=read.revision,
                    )  # fmt: skip
                    read.holders[number] = [
                        HolderRecord.decode(kv.value, kv.create_revision) for kv in result.kvs
                    ]
            except RevisionCompacted as exc:  # compacted between the two reads: list again
                raise LostRace(f"{self.model}'s history was compacted while it was read") from exc
            return read

        return COMPACTION_RACES.compare_and_set(
            attempt,
            None,  # each read has the client's timeout; the races are bounded by count
            lambda: Unavailable(f"could not index {self.model}: its history is being compacted"),
        )

    def _parse(self, kv: KV) -> tuple[int, str, str] | None:
        """(version, kind, name) of a key under the model's versions; None for any other."""
        try:
            return self._keys.parse_version_key(self.tenant, self.model, kv.key.decode())
        except InvalidArgument:
            return None  # `latest`, or a key of no interest here

    def read_version(self, version: int, timeout: float) -> VersionRead:
        """One version's holder records read now (O(N)); `VersionNotFound` if it is not
        published."""
        manifest = self._etcd.range(
            self._keys.manifest(self.tenant, self.model, version), keys_only=True,
            timeout=timeout,
        )  # fmt: skip
        if not manifest.kvs:
            raise VersionNotFound(
                f"{self.model}@{version} is not published (or no longer retained)"
            )
        result = self._etcd.range(
            self._keys.holders(self.tenant, self.model, version), prefix=True, timeout=timeout
        )
        records = [HolderRecord.decode(kv.value, kv.create_revision) for kv in result.kvs]
        return VersionRead(manifest.kvs[0].create_revision, records, result.revision)
