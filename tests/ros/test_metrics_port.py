"""The hub's metrics port under idle and slow connections (issue 25, item 5).

Before, `tensorhub serve --metrics-port` ran prometheus_client's threading HTTP server: no
token, no idle timeout, one hub thread per connection (600 idle connections made 613
threads, still there 20 s later), bound to the `--listen` host. Now it is
`ros.metrics_http.MetricsServer` (one thread, a deadline per connection, a bound on open
connections) on 127.0.0.1 unless `--metrics-host` says otherwise. The first test plays the
attack against a real `serve` process and fails on the old code; the others pin the
server's rules in-process, with short deadlines.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from prometheus_client import CollectorRegistry, Gauge

from consistency import EtcdCluster, Keys
from tests.waiting import wait_until

if TYPE_CHECKING:
    from ros.metrics_http import MetricsServer

IDLE = 300  # connections the attacker opens (the 600 would only take longer)
DEADLINE = 5.0  # ros.metrics_http.TIMEOUT, named here so the attack test runs on old code


@contextmanager
def _serve(
    etcd_cluster: EtcdCluster, keys: Keys, tmp_path: Path, *flags: str
) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A `tensorhub serve` with `flags` and `--metrics-port 0`, ready; ended after. Yields
    the process and the metrics port it chose and wrote to its ready file (a port picked
    here could be taken by another process before the hub binds it)."""
    ready = tmp_path / "ready.json"
    env = {k: v for k, v in os.environ.items() if k != "TENSORHUB_ADMIN_TOKEN"}
    env["TENSORHUB_ADMIN_TOKEN"] = "admin-token-for-the-metrics-test"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ros.cli", "serve", "--etcd", ",".join(etcd_cluster.endpoints),
         "--prefix", keys.prefix, "--ready-file", str(ready), "--grace", "0.2",
         "--metrics-port", "0", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        wait_until("serve is ready", lambda: ready.exists() or proc.poll() is not None, 60)
        assert proc.poll() is None, proc.communicate()[0]
        info = json.loads(ready.read_text())
        assert info["address"]
        yield proc, int(info["metrics"].rsplit(":", 1)[1])
    finally:
        proc.terminate()
        proc.wait(15)


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads: line")


def _scrape(host: str, port: int) -> bytes:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as reply:
        return bytes(reply.read())


def _connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closed `sock` (EOF or reset) within `seconds`."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True


@pytest.mark.timeout(180)
def test_idle_metrics_connections_cost_no_thread_and_are_closed(
    etcd_cluster: EtcdCluster, keys: Keys, tmp_path: Path
) -> None:
    """300 idle connections to `serve --metrics-port P` add no hub thread (before: one
    each) and are all closed within the request deadline (before: never), while a scrape
    is still answered."""
    with _serve(etcd_cluster, keys, tmp_path) as (proc, port):
        assert b"tensorhub_hub_calls_refused_total" in _scrape("127.0.0.1", port)
        before = _threads(proc.pid)
        idle = []
        try:
            for _ in range(IDLE):
                with suppress(OSError):
                    idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            time.sleep(1.0)  # every one accepted by now (threads made, before)
            grown = _threads(proc.pid) - before
            assert b"tensorhub_hub_calls_refused_total" in _scrape("127.0.0.1", port)
            start = time.monotonic()
            end = start + DEADLINE + 10  # one bound for them all
            still_open = [
                s for s in idle if not _closed_within(s, max(0.01, end - time.monotonic()))
            ]
            took = time.monotonic() - start
        finally:
            for sock in idle:
                sock.close()
    assert len(idle) == IDLE
    assert grown <= 2, grown  # before: about one thread per connection
    assert len(still_open) == 0
    assert took < DEADLINE + 5


@pytest.mark.timeout(120)
def test_metrics_bind_to_loopback_whatever_the_listen_host(
    etcd_cluster: EtcdCluster, keys: Keys, tmp_path: Path
) -> None:
    """`serve --listen 127.0.0.2:0 --metrics-port P`: the port that needs no token answers
    on 127.0.0.1 only (before: on the --listen host, so a hub listening on a routable
    address published its metrics there too)."""
    with _serve(etcd_cluster, keys, tmp_path, "--listen", "127.0.0.2:0") as (_, port):
        assert b"tensorhub_hub_calls_refused_total" in _scrape("127.0.0.1", port)
        assert not _connects("127.0.0.2", port)


@pytest.fixture
def metrics() -> Iterator[MetricsServer]:
    from ros.metrics_http import TIMEOUT, MetricsServer

    assert TIMEOUT == DEADLINE
    registry = CollectorRegistry()
    Gauge("probe_value", "a gauge to find in the answer", registry=registry).set(7)
    Gauge("other_value", "filtered out by name[]", registry=registry).set(1)
    with MetricsServer("127.0.0.1", 0, registry=registry, timeout=0.5, max_connections=4) as m:
        yield m


def _exchange(address: tuple[str, int], request: bytes) -> bytes:
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(request)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def test_answers_get_head_and_filters(metrics: MetricsServer) -> None:
    got = _exchange(metrics.address, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK")
    assert b"Connection: close" in head
    assert b"probe_value 7.0" in body
    assert b"other_value" in body
    only = _exchange(metrics.address, b"GET /metrics?name[]=probe_value HTTP/1.1\r\n\r\n")
    assert b"probe_value 7.0" in only
    assert b"other_value" not in only
    assert _exchange(metrics.address, b"HEAD / HTTP/1.1\r\n\r\n").endswith(b"\r\n\r\n")
    assert _exchange(metrics.address, b"POST / HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405")
    big = b"GET / HTTP/1.1\r\nX: " + b"a" * 9000
    assert _exchange(metrics.address, big).startswith(b"HTTP/1.1 431")


def test_silent_and_trickling_connections_are_closed_at_the_deadline(
    metrics: MetricsServer,
) -> None:
    """One connection sends nothing, one sends a byte of a request every 0.1 s: both are
    closed at the 0.5 s deadline, from the one thread the server started with."""
    threads = threading.active_count()
    start = time.monotonic()
    with (
        socket.create_connection(metrics.address, timeout=10) as idle,
        socket.create_connection(metrics.address, timeout=10) as slow,
    ):
        stop = threading.Event()

        def trickle() -> None:
            for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n":
                if stop.wait(0.1):
                    return
                with suppress(OSError):
                    slow.send(bytes([byte]))

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        try:
            assert _closed_within(idle, 10)
            assert _closed_within(slow, 10)
        finally:
            stop.set()
            sender.join(timeout=10)
    took = time.monotonic() - start
    assert 0.4 <= took < 3.0, took
    assert threading.active_count() == threads  # the test's sender has ended


def test_a_flood_of_connections_is_bounded_and_a_scrape_still_gets_in(
    metrics: MetricsServer,
) -> None:
    """Ten silent connections against a bound of four: the oldest are closed to admit the
    newest, at most four are ever open, and a scraper (which sends at once) is answered."""
    crowd = [socket.create_connection(metrics.address, timeout=10) for _ in range(10)]
    try:
        wait_until("the crowd was accepted", lambda: len(metrics) == 4, 10)
        assert b"probe_value 7.0" in _exchange(metrics.address, b"GET / HTTP/1.1\r\n\r\n")
        assert len(metrics) <= 4
        assert _closed_within(crowd[0], 10)  # the oldest made room
    finally:
        for sock in crowd:
            sock.close()


@pytest.mark.timeout(60)
def test_a_taken_metrics_port_is_a_clear_error(
    etcd_cluster: EtcdCluster, keys: Keys, tmp_path: Path
) -> None:
    """`serve --metrics-port P` with P taken: exit 2 with one line naming the flag, before
    the hub starts (before: a traceback, after the gRPC server had started)."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "ros.cli", "serve", "--listen", "127.0.0.1:0",
             "--etcd", ",".join(etcd_cluster.endpoints), "--prefix", keys.prefix,
             "--metrics-port", str(port)],
            check=False, capture_output=True, text=True, timeout=50,
            env={**os.environ, "TENSORHUB_ADMIN_TOKEN": "admin-token-for-the-metrics-test"},
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"--metrics-port {port}" in done.stderr
    assert "Traceback" not in done.stderr
    assert "hub serving" not in done.stdout
