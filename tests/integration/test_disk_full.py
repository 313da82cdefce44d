"""A full disk (hardening issue, item 9), on a real broker process whose store is on a
small tmpfs: writes are refused with a clear, retriable DISK_FULL before the disk is full
(``disk_max_used_ratio``) and when a write fails for want of space, each change of state
is one log line, nothing acknowledged is lost, and a read-only store is one line at start.

Mounting needs root; elsewhere the tests skip, except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

from tests.conftest import ROOT, BrokerProcess, wait_for
from txmq import Message
from txmq.protocol.wire.errors import ResponseCode, TxmqError
from txmq.sync import AdminClient, Producer, PullConsumer

MiB = 1024 * 1024
TOPIC = "disk-full"
FULL_LINE = re.compile(r"WARNING txmq\.broker\.store: disk full: ")
RESUMED_LINE = re.compile(r"WARNING txmq\.broker\.store: disk has room again: ")
CHECK_INTERVAL_S = 0.2
#: a small store: 1 MiB segments, 64 KiB messages at most, no Parquet export
SMALL = {
    "TXMQ_BROKER_MAX_MESSAGE_SIZE": str(64 * 1024),
    "TXMQ_BROKER_EXPORT_SEGMENTS": "false",
    "TXMQ_BROKER_DISK_CHECK_INTERVAL_S": str(CHECK_INTERVAL_S),
}


def _cannot_mount(why: str) -> NoReturn:
    """Skip, except in CI (``CI=true``), where a skip would hide a broken setup."""
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"{why} (CI=true: the disk-full tests must run)", pytrace=False)
    pytest.skip(why)


@dataclass
class Disk:
    """A mounted tmpfs."""

    path: Path

    def free(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self, name: str, size: int) -> Path:
        """A ballast file of ``size`` bytes (written, so that it takes its blocks)."""
        path = self.path / name
        chunk = b"\xa5" * MiB
        with path.open("wb") as fh:
            left = size
            while left > 0:
                fh.write(chunk[: min(left, MiB)])
                left -= MiB
        return path

    def fill_up(self, name: str) -> Path:
        """A ballast file that takes every block left."""
        path = self.path / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            while True:
                try:
                    os.write(fd, b"\xa5" * 4096)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    return path
        finally:
            os.close(fd)

    def remount(self, mode: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{mode}", str(self.path)], check=True)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Disk]]:
    """Factory: ``tmpfs(size_mib)`` mounts a tmpfs under ``tmp_path`` (unmounted after)."""
    mounted: list[Path] = []

    def mount(size_mib: int) -> Disk:
        if os.geteuid() != 0:
            _cannot_mount("mounting a tmpfs needs root")
        path = tmp_path / f"disk{len(mounted)}"
        path.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)],
            capture_output=True,
            text=True,
        )
        if r.returncode:
            _cannot_mount(f"cannot mount a tmpfs: {r.stderr.strip()}")
        mounted.append(path)
        return Disk(path)

    yield mount
    for path in reversed(mounted):
        if subprocess.run(["umount", str(path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(path)], check=True)


def start(broker_process: Callable[..., BrokerProcess], disk: Disk, ratio: float) -> BrokerProcess:
    bp = broker_process("--segment-size", str(MiB), store=disk.path / "store")
    bp.env = {**SMALL, "TXMQ_BROKER_DISK_MAX_USED_RATIO": str(ratio)}
    return bp.start()


def refused(exc: TxmqError) -> None:
    """``exc`` is the clear, retriable answer of a full disk."""
    assert exc.code == ResponseCode.DISK_FULL, (exc.code, str(exc))
    assert exc.retriable
    assert "disk is full" in str(exc)


def refused_for_a_while(p: Producer, topic: str) -> None:
    """Sends refused for several disk checks: the state line is not repeated."""
    began = time.monotonic()
    while time.monotonic() - began < 5 * CHECK_INTERVAL_S:
        with pytest.raises(TxmqError) as err:
            p.send(Message(topic, b"refused"))
        refused(err.value)


def log_lines(bp: BrokerProcess, pattern: re.Pattern[str]) -> list[str]:
    return [line for line in bp.output().splitlines() if pattern.search(line)]


def no_stack_traces(bp: BrokerProcess) -> None:
    out = bp.output()
    assert "Traceback" not in out and 'File "' not in out, out[-3000:]
    assert "SYSTEM_ERROR" not in out and "failed:" not in out, out[-3000:]


def test_writes_are_refused_over_the_ratio_and_taken_again_below(
    tmpfs: Callable[[int], Disk], broker_process: Callable[..., BrokerProcess]
) -> None:
    disk = tmpfs(32)
    ballast = disk.fill("ballast", 20 * MiB)  # 62.5 % used, over 0.5
    bp = start(broker_process, disk, 0.5)
    wait_for(lambda: log_lines(bp, FULL_LINE))
    with Producer(bp.address, retry_times=1) as p:
        for i in range(5):
            with pytest.raises(TxmqError) as err:
                p.send(Message(TOPIC, b"refused %d" % i))
            refused(err.value)
        text = str(err.value)
        assert "disk_max_used_ratio 0.5" in text, text
        assert re.search(r"is 6\d\.\d% used", text), text
        refused_for_a_while(p, TOPIC)
        assert bp.alive()

        ballast.unlink()

        def taken() -> bool:
            try:
                p.send(Message(TOPIC, b"taken"))
            except TxmqError as exc:
                refused(exc)
                return False
            return True

        wait_for(taken, timeout=20)
        for i in range(3):
            p.send(Message(TOPIC, b"after %d" % i))
    assert len(log_lines(bp, FULL_LINE)) == 1, bp.output()[-3000:]
    resumed = log_lines(bp, RESUMED_LINE)
    assert len(resumed) == 1, bp.output()[-3000:]
    assert "disk_max_used_ratio 0.5" in resumed[0]
    no_stack_traces(bp)


def read_all(address: str, queues: int = 4) -> list[bytes]:
    bodies: list[bytes] = []
    with PullConsumer(address) as c:
        for qid in range(queues):
            offset = 0
            while True:
                got = c.pull(TOPIC, qid, offset, max_msgs=64, long_poll=0)
                if not got.messages:
                    break
                bodies += [m.body for m in got.messages]
                offset = got.next_offset
    return bodies


def test_a_disk_that_fills_up_refuses_writes_and_loses_nothing_acknowledged(
    tmpfs: Callable[[int], Disk], broker_process: Callable[..., BrokerProcess]
) -> None:
    disk = tmpfs(40)
    bp = start(broker_process, disk, 1.0)  # no early refusal: the writes hit ENOSPC
    ballast = disk.fill("ballast", disk.free() - 8 * MiB)
    acked: list[bytes] = []
    refusals = 0
    with Producer(bp.address, retry_times=0) as p:
        # 4 KiB messages with keys (the key index too), then, near the end, 60 KiB ones
        for i in range(20_000):
            size = 4096 if i % 10 else 60 * 1024
            body = b"%06d:" % i + os.urandom(size // 2).hex().encode()[: size - 7]
            try:
                p.send(Message(TOPIC, body, keys=f"k{i} key-{i}"))
            except TxmqError as exc:
                refused(exc)
                refusals += 1
                if refusals >= 20:
                    break
            else:
                acked.append(body)
        assert refusals >= 20, f"the disk never filled ({len(acked)} messages taken)"
        assert len(acked) > 100
        refused_for_a_while(p, TOPIC)
        assert bp.alive(), bp.output()[-3000:]
        assert len(log_lines(bp, FULL_LINE)) == 1, bp.output()[-3000:]
        assert "failed" in log_lines(bp, FULL_LINE)[0]

        ballast.unlink()

        def taken() -> bool:
            body = b"after-%d" % len(acked)
            try:
                p.send(Message(TOPIC, body))
            except TxmqError as exc:
                refused(exc)
                return False
            acked.append(body)
            return True

        wait_for(taken, timeout=20)
        for i in range(3):
            body = b"later-%d" % i
            p.send(Message(TOPIC, body))
            acked.append(body)
    assert len(log_lines(bp, RESUMED_LINE)) == 1, bp.output()[-3000:]
    no_stack_traces(bp)
    got = read_all(bp.address)
    assert sorted(got) == sorted(acked)

    bp.kill()  # no clean shutdown: recovery finds everything too
    bp.start()
    assert sorted(read_all(bp.address)) == sorted(acked)
    assert bp.alive()


def test_a_full_disk_never_kills_the_broker_through_a_mapped_file(
    tmpfs: Callable[[int], Disk], broker_process: Callable[..., BrokerProcess]
) -> None:
    """Consume-queue and index files are memory-mapped and sparse: a store into a page of
    a hole on a full disk is SIGBUS.  A new queue's first entry needs such a page while
    its record still fits in the commit log's last page.  The broker stops cleanly on the
    full disk, and starts again once there is room."""
    disk = tmpfs(24)
    bp = start(broker_process, disk, 1.0)
    with AdminClient(bp.address) as admin:
        admin.create_topic("wide", 64)
    acked: list[bytes] = []
    with Producer(bp.address, retry_times=0) as p:
        p.send(Message("wide", b"first", keys="first"))
        acked.append(b"first")
        ballast = disk.fill_up("ballast")
        for i in range(40):  # round robin: every send goes to a queue not written yet
            try:
                p.send(Message("wide", b"tiny %d" % i, keys=f"tiny-{i}"))
            except TxmqError as exc:
                refused(exc)
            else:
                acked.append(b"tiny %d" % i)
            assert bp.alive(), bp.output()[-3000:]
        assert len(acked) < 41, "the disk never filled"
    assert bp.terminate() == 0, bp.output()[-3000:]
    no_stack_traces(bp)
    assert len(log_lines(bp, FULL_LINE)) == 1, bp.output()[-3000:]

    ballast.unlink()
    bp.start()
    with Producer(bp.address, retry_times=0) as p:
        p.send(Message("wide", b"after"))
        acked.append(b"after")
    with PullConsumer(bp.address) as c:
        got = [
            m.body
            for qid in range(64)
            for m in c.pull("wide", qid, 0, max_msgs=64, long_poll=0).messages
        ]
    assert sorted(got) == sorted(acked)
    no_stack_traces(bp)


@pytest.mark.parametrize("existing", [True, False], ids=["existing-store", "new-store"])
def test_a_read_only_store_is_one_clear_line_at_start(
    tmpfs: Callable[[int], Disk],
    broker_process: Callable[..., BrokerProcess],
    existing: bool,
) -> None:
    disk = tmpfs(16)
    store = disk.path / "store"
    if existing:
        bp = broker_process("--segment-size", str(MiB), store=store)
        bp.env = dict(SMALL)
        bp.start()
        with Producer(bp.address) as p:
            p.send(Message(TOPIC, b"before"))
        assert bp.terminate() == 0
    disk.remount("ro")
    r = subprocess.run(
        [sys.executable, "-m", "txmq.cli", "broker", "start", "--store", str(store), "--port", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0
    assert len(lines) == 1, r.stderr
    assert lines[0] == (
        f"txmq: error: store {store} is on a read-only file system: the broker writes "
        "there; remount it read-write, or give another --store"
    ), lines[0]
    assert "listening" not in r.stdout
