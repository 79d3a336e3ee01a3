"""The etcd key schema (docs/design.md, "Keys in etcd"): every key TensorHub writes is built
here, nowhere else.

```
{p}/t/{tenant}/m/{model}/latest
{p}/t/{tenant}/m/{model}/v/{version:020d}/manifest               (header: size, digest, pages)
{p}/t/{tenant}/m/{model}/v/{version:020d}/shard/{i}
{p}/t/{tenant}/m/{model}/v/{version:020d}/h/{holder}
{p}/t/{tenant}/m/{model}/v/{version:020d}/pin/{id}
{p}/t/{tenant}/mp/{model}/{version:020d}/{part}/{writer}/{page:06d}   (manifest pages)
{p}/t/{tenant}/mp/{model}/{version:020d}/pack/{pack}   (a batch's shard manifests, compressed)
{p}/t/{tenant}/mp/{model}/{version:020d}/arrived       (shard counter: count, arrived)
{p}/t/{tenant}/lb/{model}/{version:020d}/{layout}/s/{block_set}   (its blocks and checksums)
{p}/t/{tenant}/lb/{model}/{version:020d}/{layout}/h/{block_set}/{holder}
{p}/t/{tenant}/lb/{model}/{version:020d}/{layout}/c/{block_set}/{holder}   (a COMPLETE one's mark)
{p}/t/{tenant}/lb/{model}/charged/{version:020d}       (its layouts' block sets, bytes charged)
{p}/t/{tenant}/lb/{model}/declared                     (its declared layouts)
{p}/t/{tenant}/lb/{model}/{version:020d}/{layout}/p    (the publisher's checksums of its block sets)
{p}/t/{tenant}/lb/{model}/{version:020d}/_parts/{i:06d}  (shard i's parts of those checksums)
{p}/t/{tenant}/s/{session:x}                           (marks a lease as the tenant's)
{p}/t/{tenant}/quota/{what}                            (fence of a counted create: models, sessions)
{p}/tenants/{tenant}
{p}/hub/secret
{p}/hub/compactor                                      (the elected compactor; under its lease)
```

Every name is validated before it becomes part of a key, so no input can escape its tenant's
prefix. Versions are zero-padded so that key order is version order.

Manifest pages (`consistency.manifests`) live under `mp/`, outside the model's prefix `m/{model}/`
that watches cover, so megabytes of pages never flow through a watch; `part` is `whole` or
the shard index (`{i:06d}`), `writer` a random id per publish attempt, so racing publishers of
one version never write the same page key. A pack (`consistency.manifest_packs`) holds the
manifests of one shard batch's shards, written in that batch's transaction under a random id.
Retention deletes `mp/{model}/{version}/` in the
same transaction as `v/{version}/`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from tensorhub.errors import InvalidArgument
from tensorhub.names import validate_name, validate_version

DEFAULT_PREFIX = "/tensorhub/v1"


@dataclass(frozen=True)
class Keys:
    """Key builder for one deployment prefix."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.prefix.startswith("/") or self.prefix.endswith("/") or "//" in self.prefix:
            raise InvalidArgument(
                f"invalid key prefix {self.prefix!r}: must start with '/' and not end with '/'"
            )

    # -- tenants ---------------------------------------------------------------------------

    def tenant_record(self, tenant: str) -> str:
        return f"{self.prefix}/tenants/{validate_name(tenant, 'tenant')}"

    def tenants(self) -> str:
        return f"{self.prefix}/tenants/"

    def hub_secret(self) -> str:
        """The hub replicas' shared secret (read-token keys derive from it)."""
        return f"{self.prefix}/hub/secret"

    def hub_compactor(self) -> str:
        """Names the one hub replica that compacts etcd; attached to that replica's lease."""
        return f"{self.prefix}/hub/compactor"

    def sessions(self, tenant: str) -> str:
        return f"{self.tenant(tenant)}s/"

    def quota_fence(self, tenant: str, what: str) -> str:
        """Bumped by every create counted against a quota (`consistency.quota`)."""
        return f"{self.tenant(tenant)}quota/{validate_name(what, 'quota')}"

    def session(self, tenant: str, session_id: int) -> str:
        """Marks a session (lease) as the tenant's; attached to that lease."""
        if isinstance(session_id, bool) or not isinstance(session_id, int) or session_id <= 0:
            raise InvalidArgument(f"invalid session id {session_id!r}")
        return f"{self.sessions(tenant)}{session_id:x}"

    def tenant(self, tenant: str) -> str:
        """Everything a tenant owns lives under this prefix."""
        return f"{self.prefix}/t/{validate_name(tenant, 'tenant')}/"

    # -- models ----------------------------------------------------------------------------

    def models(self, tenant: str) -> str:
        return f"{self.tenant(tenant)}m/"

    def model(self, tenant: str, model: str) -> str:
        return f"{self.models(tenant)}{validate_name(model, 'model')}/"

    def latest(self, tenant: str, model: str) -> str:
        return f"{self.model(tenant, model)}latest"

    def versions(self, tenant: str, model: str) -> str:
        return f"{self.model(tenant, model)}v/"

    # -- one version -----------------------------------------------------------------------

    def version(self, tenant: str, model: str, version: int) -> str:
        return f"{self.versions(tenant, model)}{validate_version(version):020d}/"

    def manifest(self, tenant: str, model: str, version: int) -> str:
        return f"{self.version(tenant, model, version)}manifest"

    def shards(self, tenant: str, model: str, version: int) -> str:
        return f"{self.version(tenant, model, version)}shard/"

    def shard(self, tenant: str, model: str, version: int, index: int) -> str:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise InvalidArgument(f"invalid shard index {index!r}: must be an integer >= 0")
        return f"{self.shards(tenant, model, version)}{index:06d}"

    def holders(self, tenant: str, model: str, version: int) -> str:
        return f"{self.version(tenant, model, version)}h/"

    def holder(self, tenant: str, model: str, version: int, holder: str) -> str:
        return f"{self.holders(tenant, model, version)}{validate_name(holder, 'holder')}"

    def pins(self, tenant: str, model: str, version: int) -> str:
        return f"{self.version(tenant, model, version)}pin/"

    def pin(self, tenant: str, model: str, version: int, pin_id: str) -> str:
        return f"{self.pins(tenant, model, version)}{validate_name(pin_id, 'pin id')}"

    # -- manifest pages (outside the watched model prefix) --------------------------------

    def model_pages(self, tenant: str, model: str) -> str:
        """Everything paged for every version of a model (`DeleteModel` removes it whole)."""
        return f"{self.tenant(tenant)}mp/{validate_name(model, 'model')}/"

    def manifest_pages(self, tenant: str, model: str, version: int) -> str:
        """Everything paged for one version: its manifest pages and its shard counter."""
        return (
            f"{self.tenant(tenant)}mp/{validate_name(model, 'model')}/"
            f"{validate_version(version):020d}/"
        )

    def manifest_part(self, tenant: str, model: str, version: int, part: int | None) -> str:
        """The pages of the whole version's manifest (`part` None) or of shard `part`'s."""
        if part is None:
            return f"{self.manifest_pages(tenant, model, version)}whole/"
        if isinstance(part, bool) or not isinstance(part, int) or part < 0:
            raise InvalidArgument(f"invalid shard index {part!r}: must be an integer >= 0")
        return f"{self.manifest_pages(tenant, model, version)}{part:06d}/"

    def manifest_writer(
        self, tenant: str, model: str, version: int, part: int | None, writer: str
    ) -> str:
        """One publish attempt's pages of a part (`writer`: its random id)."""
        part_prefix = self.manifest_part(tenant, model, version, part)
        return f"{part_prefix}{validate_name(writer, 'writer')}/"

    def manifest_pack(self, tenant: str, model: str, version: int, pack: str) -> str:
        """One shard batch's pack of manifests (`pack`: its random id)."""
        return f"{self.manifest_pages(tenant, model, version)}pack/{validate_name(pack, 'pack')}"

    def shard_arrivals(self, tenant: str, model: str, version: int) -> str:
        """The version's shard counter, `{"count": n, "arrived": k}`: put once by every
        batch of its shards (`consistency.shard_commit`)."""
        return f"{self.manifest_pages(tenant, model, version)}arrived"

    # -- readers in another layout (consistency.layouts) ----------------------------------

    def model_layouts(self, tenant: str, model: str) -> str:
        """Every layout block set of every version of a model (`DeleteModel` removes it)."""
        return f"{self.tenant(tenant)}lb/{validate_name(model, 'model')}/"

    def version_layouts(self, tenant: str, model: str, version: int) -> str:
        """Every layout block set of one version: retention deletes it with the version."""
        return f"{self.model_layouts(tenant, model)}{validate_version(version):020d}/"

    def layout_charges(self, tenant: str, model: str) -> str:
        """The tallies of every version's layout block sets (`consistency.layout_tally`):
        beside the versions' own prefixes (20 digits), so one range reads a model's."""
        return f"{self.model_layouts(tenant, model)}charged/"

    def layout_charge(self, tenant: str, model: str, version: int) -> str:
        """One version's tally: its layouts' block sets and the bytes charged for them."""
        return f"{self.layout_charges(tenant, model)}{validate_version(version):020d}"

    def declared_layouts(self, tenant: str, model: str) -> str:
        """The model's declared layouts (`consistency.declared_layouts`), one key: beside
        the versions' prefixes, so `DeleteModel` removes it with them."""
        return f"{self.model_layouts(tenant, model)}declared"

    def publisher_sums(self, tenant: str, model: str, version: int, layout: str) -> str:
        """The publisher's checksums of a declared layout's block sets for one version,
        written by the transaction that publishes it; retention deletes it with them."""
        return f"{self.layout(tenant, model, version, layout)}p"

    def publisher_parts(self, tenant: str, model: str, version: int) -> str:
        """The shards' parts of the publisher's checksums of a version's declared layouts,
        one key a shard (`_parts/{i:06d}`): beside the version's layouts (no layout name
        starts with `_`), so retention deletes them with them."""
        return f"{self.version_layouts(tenant, model, version)}_parts/"

    def publisher_part(self, tenant: str, model: str, version: int, shard: int) -> str:
        return f"{self.publisher_parts(tenant, model, version)}{shard:06d}"

    def layout(self, tenant: str, model: str, version: int, layout: str) -> str:
        """One layout of one version: its block sets and their holders."""
        return f"{self.version_layouts(tenant, model, version)}{validate_name(layout, 'layout')}/"

    def layout_block_sets(self, tenant: str, model: str, version: int, layout: str) -> str:
        """The block sets of a layout, one key each: their blocks and recorded checksums."""
        return f"{self.layout(tenant, model, version, layout)}s/"

    def layout_block_set(
        self, tenant: str, model: str, version: int, layout: str, block_set: str
    ) -> str:
        prefix = self.layout_block_sets(tenant, model, version, layout)
        return f"{prefix}{validate_name(block_set, 'block set')}"

    def layout_holders(
        self, tenant: str, model: str, version: int, layout: str, block_set: str
    ) -> str:
        """The holders of one block set (each under its lease)."""
        prefix = self.layout(tenant, model, version, layout)
        return f"{prefix}h/{validate_name(block_set, 'block set')}/"

    def layout_holder(
        self, tenant: str, model: str, version: int, layout: str, block_set: str, holder: str
    ) -> str:
        prefix = self.layout_holders(tenant, model, version, layout, block_set)
        return f"{prefix}{validate_name(holder, 'holder')}"

    def layout_complete_holders(
        self, tenant: str, model: str, version: int, layout: str, block_set: str
    ) -> str:
        """The COMPLETE holders of one block set, one key each (the record again, on the
        same lease, written and deleted in the transactions that write and delete its
        `h/` key): what a cover lists, so that a bounded range of it finds only holders
        that can serve every chunk, however many PARTIAL ones sort first under `h/`."""
        prefix = self.layout(tenant, model, version, layout)
        return f"{prefix}c/{validate_name(block_set, 'block set')}/"

    def layout_complete_holder(
        self, tenant: str, model: str, version: int, layout: str, block_set: str, holder: str
    ) -> str:
        prefix = self.layout_complete_holders(tenant, model, version, layout, block_set)
        return f"{prefix}{validate_name(holder, 'holder')}"

    # -- parsing ---------------------------------------------------------------------------

    def parse_version_key(self, tenant: str, model: str, key: str) -> tuple[int, str, str]:
        """Split a key under a model's `v/` prefix into (version, kind, name).

        `kind` is `manifest`, `shard`, `h` or `pin`; `name` is the last part (empty for the
        manifest). `seed` is still recognised, and read by nothing: a hub before ElectSeed
        was removed wrote `seed/{dc}` under a session's lease, and a key it left must not
        break a read of its version until the lease takes it (docs/design-notes.md, "The
        cross-dc seed"). Raises InvalidArgument for keys outside that shape.
        """
        return _parse_version_key(self.versions(tenant, model), key)

    def parse_version_keys(
        self, tenant: str, model: str, keys: Iterable[str]
    ) -> Iterator[tuple[int, str, str]]:
        """`parse_version_key` of each of `keys`, in order, with the model's prefix made
        once (a scan of a version's thousands of shard and holder records)."""
        base = self.versions(tenant, model)
        return (_parse_version_key(base, key) for key in keys)


def _parse_version_key(base: str, key: str) -> tuple[int, str, str]:
    """`Keys.parse_version_key` of `key` under a model's `v/` prefix `base`."""
    if not key.startswith(base):
        raise InvalidArgument(f"key {key!r} is not under {base!r}")
    parts = key[len(base) :].split("/")
    try:
        version = int(parts[0])
    except ValueError as exc:
        raise InvalidArgument(f"key {key!r} has no version") from exc
    if len(parts) == 2 and parts[1] == "manifest":
        return version, "manifest", ""
    if len(parts) == 3 and parts[1] in ("shard", "h", "seed", "pin"):
        return version, parts[1], parts[2]
    raise InvalidArgument(f"key {key!r} is not a version key")
