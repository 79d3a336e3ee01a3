"""`tensorhub bench scale`'s report: each part's figures as the rows of its table, with
their targets, from the dict the part's run returned (`bench.scale.runners`).

The rows are apart from the runs so that what a part measures and how its table reads
change on their own; the shards part's rows are `bench.scale.shard_rows`.
"""

from __future__ import annotations

from typing import Any

from bench.report import Result


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def fill_clients(res: Result, data: dict[str, Any]) -> None:
    rounds: list[dict[str, Any]] = data["rounds"]
    top = max(r["clients"] for r in rounds)
    for n in sorted({r["clients"] for r in rounds}):
        hub = next((r for r in rounds if r["clients"] == n and r["server"] == "hub"), {})
        ceil = next((r for r in rounds if r["clients"] == n and r["server"] == "ceiling"), {})
        target = n == top
        published = int(hub.get("versions_published", 0))
        errors = (
            int(hub.get("versions_missing_somewhere", 0))
            + sum(hub.get("publish_failures", {}).values())
            + sum(hub.get("stream_errors", {}).values())  # connect errors included
            + sum(hub.get("latest_errors", {}).values())
            + (1 if "failed" in hub else 0)
        )
        res.add(
            f"N={n}: versions seen by every open watch / asked",
            (published - int(hub.get("versions_missing_somewhere", 0)))
            / max(1, int(hub.get("versions_asked", 1))),
            ">= 1" if target else "",
        )
        res.add(
            f"N={n}: errors (publish, watch, keepalive, latest)", errors, "<= 0" if target else ""
        )
        res.add(
            f"N={n}: all-visible p99 / ceiling fan-out p99",
            ratio(hub.get("all_visible_p99_ms"), ceil.get("all_visible_p99_ms")),
            "<= 3" if target else "",
        )
        res.add(
            f"N={n}: Latest p99 / ceiling unary p99",
            ratio(hub.get("latest_p99_ms"), ceil.get("latest_p99_ms")),
            "<= 3" if target else "",
        )
        for label, key in (
            ("all-visible p50", "all_visible_p50_ms"),
            ("all-visible p99", "all_visible_p99_ms"),
            ("Latest p99", "latest_p99_ms"),
        ):
            res.add(f"N={n}: hub {label}", hub.get(key), unit="ms")
        res.add(f"N={n}: hub sessions all open after", hub.get("connect_s"), unit="s")
        res.add(f"N={n}: hub renewals later than ttl/3", hub.get("keepalive_late"), unit="renewals")
        res.add(f"N={n}: ceiling fan-out p50", ceil.get("all_visible_p50_ms"), unit="ms")
        res.add(f"N={n}: ceiling fan-out p99", ceil.get("all_visible_p99_ms"), unit="ms")
        res.add(f"N={n}: ceiling unary p99", ceil.get("latest_p99_ms"), unit="ms")
        for who, r in (("hub", hub), ("ceiling", ceil)):
            res.add(f"N={n}: {who} RSS", r.get("rss_mb"), unit="MB")
            res.add(f"N={n}: {who} threads", r.get("threads"), unit="threads")
            res.add(f"N={n}: {who} CPU per version", r.get("cpu_s_per_version"), unit="s")
            res.add(f"N={n}: {who} CPU between publishes (renewals)", r.get("idle_cpu_s_per_s"),
                    unit="s/s")  # fmt: skip


def fill_holders(res: Result, data: dict[str, Any]) -> None:
    small, large, step = data["small"], data["large"], data["step"]
    res.add(
        f"Resolve p50 at {large['total_holders']} / at {small['total_holders']} holders",
        ratio(large["p50_ms"], small["p50_ms"]),
        "<= 2",
    )
    res.add("Resolve p99 ratio (same)", ratio(large["p99_ms"], small["p99_ms"]))
    res.add(f"Resolve p50 at {small['total_holders']} holders", small["p50_ms"], unit="ms")
    res.add(f"Resolve p50 at {large['total_holders']} holders", large["p50_ms"], unit="ms")
    res.add("Resolve candidates returned at the large size", large["candidates"], unit="holders")
    res.add(
        f"step of {step['readers']} readers: failed readers", sum(step["failures"].values()), "<= 0"
    )
    res.add("step: etcd writes", step["etcd_writes"], unit="revisions")
    res.add("step: etcd writes per reader", step["etcd_writes"] / step["readers"], unit="revisions")
    res.add("step: hub CPU", step["hub_cpu_s"], unit="s")
    res.add("step: etcd CPU", step["etcd_cpu_s"], unit="s")
    res.add("step: wall time", step["seconds"], unit="s")


def fill_manifest(res: Result, data: dict[str, Any]) -> None:
    ok = "failed" not in data
    res.add(
        f"{data['tensors']} tensors / {data['chunks']} chunks published and fetched",
        1.0 if ok else 0.0,
        ">= 1",
    )
    if not ok:
        res.note = str(data["failed"])[:300]
    res.add("publish time", data.get("publish_s"), unit="s")
    res.add("fetch time", data.get("fetch_s"), unit="s")
    res.add("etcd writes for the version", data.get("etcd_writes"), unit="revisions")
    written = data.get("etcd_bytes_written")
    res.add("etcd bytes written for the version", None if written is None else written / 2**20,
            unit="MiB")  # fmt: skip
    res.add("etcd keys written for the version", data.get("etcd_keys_written"), unit="keys")


def fill_history(res: Result, data: dict[str, Any]) -> None:
    samples = data["samples"]
    res.add("DB in-use spread after the first compaction", data["flatness"], "<= 0.1")
    res.add("the same spread per revision of history kept", data.get("per_revision_flatness"))
    res.add("steps run", data["steps"], unit="steps")
    res.add("failed RPCs", sum(data["failures"].values()), "<= 0")
    res.add("DB in-use, first sample", samples[0]["db_size_in_use"] / 2**20, unit="MiB")
    res.add("DB in-use, last sample", samples[-1]["db_size_in_use"] / 2**20, unit="MiB")
    res.add("history kept at the last sample", samples[-1].get("retained_revisions"),
            unit="revisions")  # fmt: skip
    res.add("etcd keys, first sample", samples[0].get("keys"), unit="keys")
    res.add("etcd keys, last sample", samples[-1].get("keys"), unit="keys")
    res.add(
        "revisions per step",
        (samples[-1]["revision"] - samples[0]["revision"]) / max(1, data["steps"]),
        unit="revisions",
    )
    if not data["compactor_flag"]:
        res.note = "this hub has no --compact-interval: ran without a compactor"
    elif data["flatness"] is None:
        res.note = "fewer than two samples after the first compaction"


def limit_rows(res: Result, data: dict[str, Any]) -> None:
    """The etcd limits the part ran under, as rows of its table."""
    limits = data.get("limits", {})
    res.add("etcd --max-txn-ops (ran under)", limits.get("max_txn_ops"), unit="ops")
    size = limits.get("max_request_bytes")
    res.add("etcd --max-request-bytes (ran under)", None if size is None else size / 1024,
            unit="KiB")  # fmt: skip


def fill_herd(res: Result, data: dict[str, Any]) -> None:
    limit_rows(res, data)
    rounds: list[dict[str, Any]] = data["rounds"]
    for r in sorted({x["replicas"] for x in rounds}):
        hub = next((x for x in rounds if x["replicas"] == r and x["server"] == "hub"), {})
        ceil = next((x for x in rounds if x["replicas"] == r and x["server"] == "ceiling"), {})
        n = data["clients"]
        what = f"{n} at once, x{r}"
        errors = sum(hub.get("errors", {}).values()) + (1 if "failed" in hub else 0)
        if hub.get("sessions", 0) < n:
            errors = max(errors, 1)
        res.add(f"{what}: errors (open, keepalive, watch)", errors, "<= 0")
        res.add(f"{what}: sessions expired or renewed later than the TTL",
                hub.get("expired"), "<= 0")  # fmt: skip
        res.add(
            f"{what}: all open and watching / ceiling",
            ratio(hub.get("all_open_and_watching_s"), ceil.get("all_open_and_watching_s")),
            "<= 3",
        )
        one = hub.get("one_open_ms")
        res.add(
            f"{what}: all {n} OpenSessions answered / one open alone",
            ratio(hub.get("all_opened_s"), None if one is None else one / 1000),
        )
        res.add(f"{what}: hub all open and watching", hub.get("all_open_and_watching_s"),
                unit="s")  # fmt: skip
        res.add(f"{what}: ceiling all open and watching", ceil.get("all_open_and_watching_s"),
                unit="s")  # fmt: skip
        res.add(f"{what}: hub sessions opened", hub.get("sessions"), unit="sessions")
        res.add(f"{what}: hub all OpenSessions answered", hub.get("all_opened_s"), unit="s")
        res.add(f"{what}: hub last successful open", hub.get("last_open_s"), unit="s")
        res.add(f"{what}: hub one open alone, median", one, unit="ms")
        res.add(f"{what}: hub longest time between renewals", hub.get("max_renewal_gap_s"),
                unit="s")  # fmt: skip
        res.add(f"{what}: hub renewals later than ttl/3", hub.get("keepalive_late"),
                unit="renewals")  # fmt: skip
        res.add(f"{what}: hub RSS", hub.get("rss_mb"), unit="MB")
        notes = []
        if hub.get("watches_unavailable"):
            notes.append("the hub has no watches gauge: 'watching' not measured")
        for who, x in (("hub", hub), ("ceiling", ceil)):
            if "failed" in x:
                notes.append(f"{who} x{r}: {x['failed']}")
            elif x.get("error_details"):
                notes.append(f"{who} x{r}: {x['error_details']}")
        if notes:
            res.note = "; ".join([res.note, *notes] if res.note else notes)[:300]


def fill_reconnect(res: Result, data: dict[str, Any]) -> None:
    limit_rows(res, data)
    n = data["clients"]
    res.add(f"{n} SDK clients: sessions on the same lease after the kill / clients",
            ratio(data.get("same_session"), n), ">= 1")  # fmt: skip
    res.add("holder records intact, same session / clients",
            ratio(data.get("holders_intact"), n), ">= 1")  # fmt: skip
    res.add("renewed within the TTL across the kill / clients",
            ratio(data.get("renewed_within_ttl"), n), ">= 1")  # fmt: skip
    res.add("errors (connect, publish, lost sessions, recoveries)", data.get("errors"), "<= 0")
    res.add("clients connected and published", data.get("connected"), unit="clients")
    res.add("keepalive streams on the killed replica", data.get("streams_on_killed"),
            unit="streams")  # fmt: skip
    res.add("keepalive streams on the other, after", data.get("streams_on_other_after"),
            unit="streams")  # fmt: skip
    res.add("sessions on the same lease", data.get("same_session"), unit="sessions")
    res.add("holder records intact", data.get("holders_intact"), unit="records")
    res.add("lost sessions", data.get("lost"), unit="sessions")
    res.add("of which before the kill (while connecting)", data.get("lost_before_kill"),
            unit="sessions")  # fmt: skip
    res.add("recoveries (a new lease)", data.get("recoveries"), unit="sessions")
    res.add("longest renewal gap across the kill", data.get("max_gap_s"), unit="s")
    res.add("every session renewed again after the kill", data.get("all_back_s"), unit="s")
    res.add("connect and publish", data.get("connect_s"), unit="s")
    if data.get("failed") or data.get("first_error"):
        res.note = f"{data.get('failed') or data.get('first_error')}"[:300]
