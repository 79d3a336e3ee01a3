"""The run's table on stdout: a header, then one row per step, and a line for the kill."""

from __future__ import annotations

from ray_sync.model import MiB
from ray_sync.reports import Step, Summary


def print_header(summary: Summary, tenant: str, rollouts: int) -> None:
    nodes = summary.nodes
    print(
        f"model {summary.model} of {tenant}: versions {summary.first_version}.."
        f"{summary.last_version}, {rollouts} rollouts on {len(nodes)} nodes "
        f"({', '.join(nodes)}), trainer on {summary.trainer_node}",
        flush=True,
    )
    print(
        f"{'step':<5} {'version':<8} {'trainer s':<10} {'fetch s max':<12} "
        f"{'MB trainer':<11} {'MB peers':<9} {'MB delta':<9} {'MB moved':<9} {'rollouts':<9} "
        "bytes ok",
        flush=True,
    )


def print_step(s: Step) -> None:
    reports = s.reports
    mb_trainer = sum(r.from_trainer for r in reports) / MiB
    mb_peers = sum(r.from_peers for r in reports) / MiB
    mb_delta = sum(r.delta_bytes for r in reports) / MiB
    mb_moved = sum(r.moved for r in reports) / MiB
    print(
        f"{s.step:<5} {s.version:<8} {s.trainer.seconds:<10.3f} "
        f"{max(r.fetch_s for r in reports):<12.3f} {mb_trainer:<11.1f} {mb_peers:<9.1f} "
        f"{mb_delta:<9.2f} {mb_moved:<9.2f} {len(reports):<9} {'yes' if s.bytes_ok else 'NO'}",
        flush=True,
    )
    if s.killed and s.replacement:
        r = s.replacement
        around = f"; read around {len(r.failed_sources)} failed source(s)"
        print(
            f"      killed {s.killed} (ray.kill) holding version {s.version}; {r.name} started "
            f"on {r.node}, caught up to version {r.version} {s.replace_s:.1f}s after the kill"
            f"{around if r.failed_sources else ''}",
            flush=True,
        )


def print_final(summary: Summary) -> None:
    last = summary.steps[-1].trainer
    print(
        f"final version {last.version}: {len(summary.final)} live rollouts, identical bytes "
        f"(sha256 {last.digest[:16]}), wall time {summary.wall_s:.1f}s; ok",
        flush=True,
    )
