"""Views committed in their version's own publish transaction (docs/views.md).

A publish of `model@v` with views writes, for each view model `{model}.{fmt}` (named by
`tensorhub.view_rules`), what a whole publish of that model's version v writes: its
manifest header (and pages), the publisher's holder record under its session, and its
`latest` moved to v. All of it joins the one transaction that publishes `model@v`
(`consistency.publishing.Publisher.publish_staged`), so etcd makes a version and its views
visible at one revision, or none of them: a watcher of either model, a Resolve or a listing
never sees one without the other. The transaction compares each view's header absent, so a
view version is written once; and each view's `latest` only follows its model's, which
only moves up.

What a view costs the tenant is charged in the same transaction: its manifest bytes in the
etcd budget (`ViewsCharge` adds them to the version's charge), and a new view model counts
against the model quota (`admit`, asked at every attempt; nothing once the view model
exists).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from consistency import ops
from consistency.keys import Keys
from consistency.manifests import ManifestStore, Staged
from consistency.publishing import Charge
from consistency.records import HolderRecord

Guard = tuple[list[ops.Cmp], list[ops.Op]]
Admit = Callable[[float], Guard]


@dataclass(frozen=True)
class StagedView:
    """One view's manifest staged under the publisher's lease, and the view model's name."""

    model: str
    staged: Staged


class StagedViews:
    """The views of one publish, staged: the compares and writes they add to its
    transaction (module docstring)."""

    def __init__(self, keys: Keys, manifests: ManifestStore, tenant: str, version: int) -> None:
        self._keys = keys
        self._manifests = manifests
        self._tenant = tenant
        self._version = version
        self.views: list[StagedView] = []

    def stage(
        self,
        views: Sequence[tuple[str, bytes]],
        holder: HolderRecord,
        *,
        timeout: float,
        owner: str | None,
    ) -> None:
        """Stage each (view model, manifest) under `holder`'s session (pages only for a
        manifest too large to stay inline). A failure discards what was staged."""
        try:
            for model, manifest in views:
                staged = self._manifests.stage(
                    self._tenant, model, self._version, None, manifest, holder.session,
                    timeout=timeout, owner=owner,
                )  # fmt: skip
                self.views.append(StagedView(model, staged))
        except BaseException:
            self.discard(timeout)
            raise

    def compares(self) -> list[ops.Cmp]:
        """Each view version absent, and each staged page still there."""
        found: list[ops.Cmp] = []
        for view in self.views:
            found.append(ops.absent(self._keys.manifest(self._tenant, view.model, self._version)))
            found.extend(view.staged.compares)
        return found

    def writes(self, holder: HolderRecord) -> list[ops.Op]:
        """Each view's header, its holder record (under the publisher's lease), its pages'
        commits, and its `latest` moved to the version."""
        out: list[ops.Op] = []
        for view in self.views:
            header = replace(view.staged.header, session=holder.session)
            out += [
                ops.put(
                    self._keys.manifest(self._tenant, view.model, self._version), header.encode()
                ),
                ops.put(
                    self._keys.holder(self._tenant, view.model, self._version, holder.holder),
                    holder.encode(),
                    lease=holder.session,
                ),
                *view.staged.commits,
                ops.put(self._keys.latest(self._tenant, view.model), str(self._version)),
            ]
        return out

    def discard(self, timeout: float) -> None:
        """Delete the pages of views whose header is not there (a publish that failed)."""
        for view in self.views:
            own_key = self._keys.manifest(self._tenant, view.model, self._version)
            self._manifests.discard(view.staged, own_key, view.staged.header.encode(), timeout)

    @property
    def models(self) -> list[str]:
        return [view.model for view in self.views]


class ViewsCharge:
    """A publish's `Charge` with its views': the version's own charge (if any), the view
    models' quota admission and the views' compares, asked at every attempt."""

    def __init__(self, charge: Charge | None, admit: Admit | None, views: StagedViews) -> None:
        self._charge = charge
        self._admit = admit
        self._views = views

    def __call__(self, timeout: float) -> Guard:
        compares, puts = self._charge(timeout) if self._charge is not None else ([], [])
        if self._admit is not None:
            more, bump = self._admit(timeout)
            compares, puts = [*compares, *more], [*puts, *bump]
        return [*compares, *self._views.compares()], puts

    def settle(self, revision: int | None) -> None:
        if self._charge is not None:
            self._charge.settle(revision)
