"""The NIXL backend (transport/nixl/) between real processes, over UCX's TCP transport and
over same-host cma: round trip, a holder killed or frozen mid-read, corrupt bytes, a refused
token, the reader's deadline and rate floor, a release during a read, and a clean exit.

The holder runs in a subprocess (tests/transport/nixl_holder_proc.py) with the same UCX
settings as the reader in this process. The whole module is skipped where NIXL is not
installed (`pip install 'tensorhub[nixl]'`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
import torch

from tensorhub.errors import DeadlineExceeded, SlowHolder, TransportError
from tests.nixl_support import UCX, use_ucx
from tests.transport._model import MODEL, TENANT
from tests.transport.nixl_holder_proc import CHUNK, nixl_model
from transport.checksums import WSUM64, XXH3
from transport.fetch_state import FetchState
from transport.frames import recv_message, send_message
from transport.layout import Layout
from transport.nixl import NixlChannel, NixlHolder, NixlReader
from transport.nixl.loader import unavailable_reason
from transport.nixl.protocol import (
    BEGIN,
    END,
    GO,
    MAX_OFFER_BYTES,
    NixlOffer,
    NixlRequest,
    decode_offer,
    decode_op,
    encode_op,
    encode_request,
)
from transport.outcome import ChunkOutcome, ChunkStatus
from transport.pace import DEFAULT_RATE_FLOOR
from transport.planner import Source
from transport.store import HeldVersion, HolderStore
from transport.wire import ErrorCode, Refusal

_WHY = unavailable_reason()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"NIXL unavailable: {_WHY}")

ROOT = Path(__file__).resolve().parents[2]
TOKEN = b"good"


class Holder:
    """A holder subprocess and its control address."""

    def __init__(self, proc: subprocess.Popen[str], port: int) -> None:
        self.proc, self.address = proc, ("127.0.0.1", port)

    def command(self, line: str) -> str:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()


@pytest.fixture(params=sorted(UCX))
def ucx(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The UCX transport of both sides: set here for the reader, passed to the holder."""
    return use_ucx(request.param, monkeypatch)


@pytest.fixture
def spawn(ucx: dict[str, str]) -> Iterator[Callable[..., Holder]]:
    """Start holder subprocesses; killed (even when stopped) at teardown."""
    procs: list[subprocess.Popen[str]] = []

    def start(**opts: object) -> Holder:
        args = [sys.executable, "-m", "tests.transport.nixl_holder_proc"]
        for key, value in opts.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
        env |= {**ucx, "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "WARN"}
        proc = subprocess.Popen(
            args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("PORT "):
                return Holder(proc, int(line.split()[1]))
        raise AssertionError(f"holder exited with {proc.wait()} before listening")

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.fixture
def reader(ucx: dict[str, str]) -> Iterator[NixlReader]:
    """A `NixlReader` made under the test's UCX settings (UCX reads them at creation)."""
    r = NixlReader()
    yield r
    r.close()


def version(mib: int) -> tuple[dict[str, torch.Tensor], Layout, list[int]]:
    """The holder's model, its layout and the publisher's per-chunk checksums."""
    src = nixl_model(1, mib)
    layout = Layout.from_tensors(src, chunk_size=CHUNK)
    pub = HeldVersion.publisher(TENANT, MODEL, 1, src, layout)
    return src, layout, [pub.checksum(i) for i in range(layout.num_chunks)]


def destination(src: dict[str, torch.Tensor], layout: Layout) -> HeldVersion:
    tensors = {k: torch.zeros_like(v) for k, v in src.items()}
    return HeldVersion.reader(TENANT, MODEL, 1, layout, tensors)


def fetch(
    dest: HeldVersion,
    expected: list[int],
    deadline: float,
    token: bytes = TOKEN,
    rate_floor: float = DEFAULT_RATE_FLOOR,
    checksum: str = "",
) -> FetchState:
    """One round's state for reading into `dest` by `deadline` (monotonic); the stall
    timeout is the whole time left, so the deadline is what ends a wait."""
    stall = max(0.01, deadline - time.monotonic())
    return FetchState(
        TENANT, MODEL, dest.key[2], dest, token, deadline, stall, expected,
        rate_floor=rate_floor, checksum=checksum or XXH3,
    )  # fmt: skip


def channel_to(reader: NixlReader, address: tuple[str, int], f: FetchState) -> NixlChannel:
    """The reader's channel to the holder whose NIXL control port is `address`."""
    return reader.open(f, Source("holder", address[0], address[1]), None)


def read_all(
    reader: NixlReader,
    holder: Holder,
    mib: int,
    deadline: float,
    token: bytes = TOKEN,
    rate_floor: float = DEFAULT_RATE_FLOOR,
) -> tuple[list[ChunkOutcome], HeldVersion, dict[str, torch.Tensor], float]:
    """Read the whole version from `holder`: outcomes, destination, source, seconds."""
    src, layout, expected = version(mib)
    dest = destination(src, layout)
    start = time.monotonic()
    f = fetch(dest, expected, start + deadline, token, rate_floor)
    channel = channel_to(reader, holder.address, f)
    try:
        outcomes = list(channel.read(range(layout.num_chunks)))
    finally:
        channel.close()
    return outcomes, dest, src, time.monotonic() - start


def statuses(outcomes: Iterable[ChunkOutcome]) -> set[ChunkStatus]:
    return {o.status for o in outcomes}


def test_round_trip(spawn: Callable[..., Holder], reader: NixlReader) -> None:
    holder = spawn(mib=16)
    outcomes, dest, src, _ = read_all(reader, holder, 16, deadline=60)
    assert statuses(outcomes) == {ChunkStatus.DONE}
    assert [o.index for o in outcomes] == list(range(dest.layout.num_chunks))
    assert dest.complete
    for name, tensor in src.items():
        assert torch.equal(dest.tensors[name], tensor), name
    assert holder.command("registered") == "REGISTERED 1"


def test_wsum64_manifest(spawn: Callable[..., Holder], reader: NixlReader) -> None:
    """A manifest whose checksums are wsum64 (computed where a GPU publisher's tensors
    are) is verified by that algorithm; a wrong value is CORRUPT (and ends that read, as
    on every channel); the chunks after it read DONE on the next."""
    holder = spawn(mib=4)
    src, layout, _ = version(4)
    pub = HeldVersion.publisher(TENANT, MODEL, 1, src, layout)
    sums = [pub.wsum64(i) for i in range(layout.num_chunks)]
    sums[1] ^= 1
    dest = destination(src, layout)
    f = fetch(dest, sums, time.monotonic() + 30, checksum=WSUM64)
    channel = channel_to(reader, holder.address, f)
    outcomes = list(channel.read(range(layout.num_chunks)))
    outcomes += list(channel.read(range(2, layout.num_chunks)))
    channel.close()
    assert [o.index for o in outcomes] == list(range(layout.num_chunks))
    assert [o.status for o in outcomes] == [
        ChunkStatus.CORRUPT if o.index == 1 else ChunkStatus.DONE for o in outcomes
    ]
    assert not dest.is_present(1)


def test_channels_read_from_threads_at_once(
    spawn: Callable[..., Holder], reader: NixlReader
) -> None:
    """A fetch's workers read through one `NixlReader` from several threads."""
    holder = spawn(mib=16)
    results: list[tuple[list[ChunkOutcome], HeldVersion, dict[str, torch.Tensor], float]] = []
    threads = [
        threading.Thread(target=lambda: results.append(read_all(reader, holder, 16, deadline=60)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert len(results) == 3
    for outcomes, dest, src, _ in results:
        assert statuses(outcomes) == {ChunkStatus.DONE}
        assert all(torch.equal(dest.tensors[k], v) for k, v in src.items())


def test_wrong_token_refused_before_any_metadata(
    spawn: Callable[..., Holder], reader: NixlReader
) -> None:
    holder = spawn(mib=4)
    outcomes, dest, _, _ = read_all(reader, holder, 4, deadline=30, token=b"bad")
    assert statuses(outcomes) == {ChunkStatus.DENIED}
    assert not any(dest.is_present(i) for i in range(dest.layout.num_chunks))
    # On the wire: a refusal, no agent metadata; and nothing was registered.
    _, layout, _ = version(4)
    with socket.create_connection(holder.address, timeout=10) as sock:
        send_message(sock, encode_request(NixlRequest(TENANT, MODEL, 1, layout.digest, b"bad")))
        answer = decode_offer(recv_message(sock, MAX_OFFER_BYTES))
    assert isinstance(answer, Refusal)
    assert answer.code is ErrorCode.DENIED
    assert holder.command("registered") == "REGISTERED 0"


def test_corrupt_bytes_detected(spawn: Callable[..., Holder], reader: NixlReader) -> None:
    holder = spawn(mib=4)
    assert holder.command("corrupt") == "CORRUPTED"
    outcomes, dest, _, _ = read_all(reader, holder, 4, deadline=30)
    assert statuses(outcomes) == {ChunkStatus.CORRUPT}
    assert not any(dest.is_present(i) for i in range(dest.layout.num_chunks))


def test_holder_killed_mid_read_fails_fast(
    spawn: Callable[..., Holder], reader: NixlReader
) -> None:
    holder = spawn(mib=256, on_begin="kill")
    outcomes, dest, _, took = read_all(reader, holder, 256, deadline=60)
    assert holder.proc.wait(10) == -signal.SIGKILL
    failed = [o for o in outcomes if o.status is not ChunkStatus.DONE]
    assert failed, "every chunk read from a killed holder"
    assert {o.status for o in failed} == {ChunkStatus.FAILED}
    assert all(type(o.error) is TransportError for o in failed), failed[0].error
    assert took < 10, f"a dead holder took {took:.1f}s to notice"
    assert not any(dest.is_present(o.index) for o in failed)


def test_holder_stopped_mid_read_never_hangs(
    spawn: Callable[..., Holder], reader: NixlReader, ucx: dict[str, str]
) -> None:
    """The holder freezes once it said `go` to the second of four 64 MiB READs. Over cma
    that READ still completes, verified (process_vm_readv reads a stopped process); over
    TCP the holder's progress thread serves READs, so it stays in progress (only chunks
    already in the kernel's socket buffers may land). Either way the next `begin` is never
    answered, and the deadline ends the read: it never hangs."""
    holder = spawn(mib=256, on_begin="stop", nth_begin=2)
    outcomes, dest, _, took = read_all(reader, holder, 256, deadline=4)
    assert took < 4 + 2, f"read of a stopped holder took {took:.1f}s, deadline 4s"
    done = [o for o in outcomes if o.status is ChunkStatus.DONE]
    failed = [o for o in outcomes if o.status is not ChunkStatus.DONE]
    assert failed, "every chunk read from a stopped holder"
    assert all(dest.is_present(o.index) for o in done)
    assert all(isinstance(o.error, DeadlineExceeded) for o in failed), failed[:1]
    batch = 64  # 1 MiB chunks per 64 MiB READ
    if ucx["UCX_TLS"] == "tcp":
        # the first READ completes; of the second, at most what the kernel's socket buffers
        # held when the holder froze (4 of its 64 chunks seen once), never all of it
        assert batch <= len(done) < 2 * batch, "a READ completed over TCP from a frozen holder"
    else:
        assert len(done) >= 2 * batch, "the READ in flight at the freeze did not complete"


def test_rate_floor_cuts_a_frozen_holder(
    spawn: Callable[..., Holder], reader: NixlReader, ucx: dict[str, str]
) -> None:
    if ucx["UCX_TLS"] != "tcp":
        pytest.skip("over cma a READ in flight may complete from a stopped holder")
    holder = spawn(mib=16, on_begin="stop")
    outcomes, _, _, took = read_all(reader, holder, 16, deadline=60, rate_floor=1e12)
    assert statuses(outcomes) == {ChunkStatus.FAILED}
    assert all(isinstance(o.error, SlowHolder) for o in outcomes)
    assert took < 5, f"the rate floor took {took:.1f}s"


def test_reader_deadline(spawn: Callable[..., Holder], reader: NixlReader) -> None:
    holder = spawn(mib=4)
    outcomes, dest, _, took = read_all(reader, holder, 4, deadline=0)
    assert statuses(outcomes) == {ChunkStatus.FAILED}
    assert all(isinstance(o.error, DeadlineExceeded) for o in outcomes)
    assert not any(dest.is_present(i) for i in range(dest.layout.num_chunks))
    assert took < 1


def test_a_token_revoked_mid_channel_stops_the_next_batch(
    ucx: dict[str, str], reader: NixlReader
) -> None:
    """The token is checked again at every `begin`, as the TCP holder checks every GET: a
    channel opened with a good token, whose token is then refused (expired, or its tenant
    deleted), gets DENIED for its next batch and reads nothing more."""
    src, layout, expected = version(4)
    store = HolderStore()
    store.add(HeldVersion.publisher(TENANT, MODEL, 1, src, layout))
    accepted = threading.Event()
    accepted.set()
    holder = NixlHolder(store, lambda *_: accepted.is_set()).start()
    store.watch(holder.register, holder.release)
    try:
        dest = destination(src, layout)
        channel = channel_to(reader, holder.address, fetch(dest, expected, time.monotonic() + 20))
        try:
            assert statuses(channel.read([0])) == {ChunkStatus.DONE}
            accepted.clear()  # revoked while the channel is open
            assert statuses(channel.read([1])) == {ChunkStatus.DENIED}
        finally:
            channel.close()
        assert dest.is_present(0)
        assert not dest.is_present(1)
    finally:
        holder.stop()


def test_release_waits_for_the_read_in_flight(ucx: dict[str, str], reader: NixlReader) -> None:
    """A release returns only once the batch a reader began has ended; then the version
    is deregistered and later reads are refused."""
    src, layout, expected = version(4)
    store = HolderStore()
    held = HeldVersion.publisher(TENANT, MODEL, 1, src, layout)
    store.add(held)
    holder = NixlHolder(store, lambda *_: True).start()
    store.watch(holder.register, holder.release)
    try:
        with socket.create_connection(holder.address, timeout=10) as sock:
            send_message(sock, encode_request(NixlRequest(TENANT, MODEL, 1, layout.digest, TOKEN)))
            assert isinstance(decode_offer(recv_message(sock, MAX_OFFER_BYTES)), NixlOffer)
            send_message(sock, encode_op(BEGIN, TOKEN))
            assert decode_op(recv_message(sock, 1024)) == (GO, b"")
            released = threading.Event()

            def release() -> None:
                store.release(held.key, 10)
                released.set()

            t = threading.Thread(target=release)
            t.start()
            assert not released.wait(0.5), "release returned with a READ in flight"
            assert holder.registered() == 1
            send_message(sock, encode_op(END))
            assert released.wait(5)
            t.join()
            answer = decode_op(recv_message(sock, 1024))
            assert isinstance(answer, Refusal)
            assert answer.code is ErrorCode.RELEASED
        deadline = time.monotonic() + 5
        while holder.registered() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert holder.registered() == 0
        dest = destination(src, layout)
        channel = channel_to(reader, holder.address, fetch(dest, expected, time.monotonic() + 10))
        outcomes = list(channel.read(range(layout.num_chunks)))
        channel.close()
        assert statuses(outcomes) == {ChunkStatus.RELEASED}
    finally:
        holder.stop()


def test_release_disconnects_readers_that_kept_the_metadata(
    ucx: dict[str, str], reader: NixlReader
) -> None:
    """Deregistering revokes nothing over TCP or cma: a reader that kept the metadata could
    READ the old regions. A release retires the agent, so such a READ fails; the next
    version is served by a fresh agent."""
    src, layout, expected = version(4)
    store = HolderStore()
    held = HeldVersion.publisher(TENANT, MODEL, 1, src, layout)
    store.add(held)
    holder = NixlHolder(store, lambda *_: True).start()
    store.watch(holder.register, holder.release)
    try:
        dest = destination(src, layout)
        channel = channel_to(reader, holder.address, fetch(dest, expected, time.monotonic() + 10))
        assert statuses(channel.read([0])) == {ChunkStatus.DONE}
        store.release(held.key, 5)
        # the store told the holder (HolderStore.watch) before its release returned
        assert holder.registered() == 0
        assert holder.retired == 1
        # the reader's control channel is told RELEASED and ends (within POLL): with it the
        # retired agent's last reference goes, and the agent closes
        deadline = time.monotonic() + 5
        while holder.admission.sockets() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not holder.admission.sockets()
        # A READ without `begin` (hostile) fails once the reader's UCX has heard of the
        # disconnect: at once over TCP; over cma the READ needs nothing of the holder, so
        # one that starts before UCX delivered the disconnect may still complete.
        cut = time.monotonic() + 5
        error: TransportError | None = None
        while error is None:
            now = time.monotonic()
            try:
                channel._transfer([1], now + 5, now + 5)
            except TransportError as exc:
                error = exc
            else:
                assert now < cut, "the retired agent's reader could still READ after 5 s"
                time.sleep(0.05)
        assert "RemoteDisconnect" in str(error)
        channel.close()
        again = HeldVersion.publisher(TENANT, MODEL, 2, src, layout)
        store.add(again)
        dest = HeldVersion.reader(
            TENANT, MODEL, 2, layout, {k: torch.zeros_like(v) for k, v in src.items()}
        )
        channel = channel_to(reader, holder.address, fetch(dest, expected, time.monotonic() + 10))
        outcomes = list(channel.read(range(layout.num_chunks)))
        channel.close()
        assert statuses(outcomes) == {ChunkStatus.DONE}
    finally:
        holder.stop()


def test_nixl_process_exits_cleanly(ucx: dict[str, str]) -> None:
    """With no UCX setting but UCX_TLS, a process that used NIXL exits 0 (docs/nixl.md,
    "The exit crash": on hosts with rdma-core providers it died with SIGSEGV)."""
    code = (
        "import torch\n"
        "from transport.nixl.holder import new_agent\n"
        "a = new_agent('exit-test')\n"
        "a.register_memory([torch.ones(1024)])\n"
        "print('ok', flush=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env |= {"UCX_TLS": ucx["UCX_TLS"], "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "WARN"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")
