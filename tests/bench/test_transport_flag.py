"""`--transport` of `bench fanout`, `elastic` and `failover`: the flag, the UCX settings a NIXL
run's participants get, the link-counter check (`LinksBypassed`) and the count of reads by
transport. The last two tests need root (emulated hosts) and the second of them NIXL too;
each is skipped with its reason otherwise."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from bench.cli import _parse
from bench.common import MODEL, LinksBypassed, MiB, Options, add_reads, options, reads, verify
from bench.emu.cluster import ON_LINKS, Cluster, links_between, participant_env
from bench.emu.control import broadcast
from bench.emu.netns import Emulation
from transport.kinds import TransportKind
from transport.registry import unavailable_reason

root = pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts need root (netns, tc)")


@pytest.mark.parametrize("name", ["fanout", "elastic", "failover"])
def test_the_flag_defaults_to_tcp_and_names_the_run(name: str) -> None:
    assert options(_parse(name, [])).transport == "tcp"
    opts = options(_parse(name, ["--transport", "nixl"]))
    assert opts.transport == "nixl"
    assert opts.flags() == " --transport nixl"  # in the command a result reproduces with
    assert Options().flags() == ""


def test_only_the_three_take_it() -> None:
    with pytest.raises(SystemExit):
        _parse("crossdc", ["--transport", "nixl"])
    with pytest.raises(SystemExit):
        _parse("fanout", ["--transport", "rdma"])
    assert options(_parse("crossdc", [])).transport == "tcp"


def test_nixl_participants_get_ucx_tcp_on_their_veth() -> None:
    """UCX over TCP only (no cma, no shared memory between namespaces), on `eth0`, the
    host's veth; never restricted to `lo`. A TCP run sets nothing."""
    assert participant_env("nixl") == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
    assert participant_env("tcp") == {}


def test_reads_are_counted_by_transport() -> None:
    replies = [
        {  # the first reader: the trainer over NIXL
            "transports": {"trainer": "nixl"},
            "bytes_per_source": {"trainer": 100},
            "fallbacks": {},
        },
        {  # a reader behind it: PARTIAL when planned, so over TCP; one holder sent nothing
            "transports": {"r1": "tcp", "trainer": "nixl"},
            "bytes_per_source": {"r1": 100, "trainer": 0},
            "fallbacks": {"r1": "nixl: the holder is PARTIAL (it offers NIXL only ...)"},
        },
        {"transports": {"r2": "tcp"}, "bytes_per_source": {"r2": 100}},  # no NIXL offered
    ]
    counted = reads(replies)
    assert counted == {"nixl": 1, "tcp": 2, "tcp_partial": 1, "tcp_other": 1}
    assert add_reads(counted, {"nixl": 2}) == {**counted, "nixl": 3}


def test_bytes_around_the_links_fail_the_phase() -> None:
    before = {"a": (0, 0), "b": (0, 0)}
    on_links = {"a": (0, 33 * MiB), "b": (33 * MiB, 0)}  # one copy of 32 MiB, with headers
    assert links_between(before, on_links, 32 * MiB, 1, "x").per_copy > 1
    with pytest.raises(LinksBypassed, match=r"x: the host links carried 1\.03 model sizes"):
        links_between(before, on_links, 32 * MiB, 2, "x")  # two copies moved, one seen
    edge = math.ceil(ON_LINKS * 32 * MiB)
    links_between(before, {"a": (edge, 0), "b": (0, 0)}, 32 * MiB, 1, "x")


@root
def test_link_counters_count_the_veth_not_loopback() -> None:
    """A host's counters grow by what crosses its veth, and not by what its processes
    send each other inside the namespace (as cma or shared memory would not)."""
    nbytes = 4 * MiB
    send = (
        "import socket,sys; s=socket.create_server((sys.argv[1],0)); print(s.getsockname()[1],"
        " flush=True); c,_=s.accept(); c.sendall(bytes(int(sys.argv[2]))); c.close()"
    )
    recv = (
        "import socket,sys; c=socket.create_connection((sys.argv[1],int(sys.argv[2])));"
        " n=0\nwhile (b:=c.recv(1<<20)): n+=len(b)\nprint(n)"
    )

    def move(emu: Emulation, server: int, client: int, address: str) -> int:
        a, b = emu.hosts[server], emu.hosts[client]
        srv = subprocess.Popen(
            emu.exec_argv(a, [sys.executable, "-c", send, address, str(nbytes)]),
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert srv.stdout is not None
        port = srv.stdout.readline().strip()
        got = subprocess.run(
            emu.exec_argv(b, [sys.executable, "-c", recv, address, port]),
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        srv.wait(30)
        return int(got)

    with Emulation({1: 2}, 400.0) as emu:
        before = emu.link_bytes()
        assert move(emu, 0, 1, emu.hosts[0].ip) == nbytes
        across = links_between(before, emu.link_bytes(), nbytes, 1, "across")
        assert across.per_copy < 1.1
        before = emu.link_bytes()
        assert move(emu, 0, 0, "127.0.0.1") == nbytes  # inside one namespace
        with pytest.raises(LinksBypassed):
            links_between(before, emu.link_bytes(), nbytes, 1, "inside")


@pytest.mark.timeout(240)
@root
@pytest.mark.skipif(
    bool(unavailable_reason(TransportKind.NIXL)), reason="NIXL is not installed here"
)
def test_a_nixl_fetch_between_emulated_hosts_crosses_the_link() -> None:
    """The SDK over NIXL between two namespaces: the COMPLETE publisher read over NIXL, one
    copy on the links' counters (UCX on TCP over the veth, not cma)."""
    opts = Options(size_mb=4, transport="nixl")
    with Cluster({1: 2}, 400.0, transport="nixl") as c:
        trainer, reader = c.parts
        before = c.link_bytes()
        pub = trainer.call("publish", model=MODEL, version=1, nbytes=opts.nbytes,
                           seed=opts.seed, chunk=opts.chunk)  # fmt: skip
        got = broadcast([reader], "fetch", 120, model=MODEL, version=1)
        verify(pub["digest"], got, "reader")
        links = c.links_since(before, opts.nbytes, 1, "reader")
        assert reads(got) == {"nixl": 1, "tcp": 0, "tcp_partial": 0, "tcp_other": 0}
        assert links.per_copy < 1.1
        assert c.ucx()["UCX_TLS"] == "tcp"
