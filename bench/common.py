"""Shared pieces of the txmq benchmark: the System interface, pacing, percentiles, reporting.

Every system under test (txmq and the peers) implements :class:`System`.  The helpers
here are meant to be used by all of them so that the same work is measured the same way:

* :func:`run_windowed` - publish ``n`` messages keeping at most ``window`` unacknowledged.
* :func:`run_paced` - publish at a fixed rate scheduled by absolute deadlines.
* :func:`stamp` / :func:`read_stamp` - put / read the send time (``time.perf_counter_ns``)
  in the first 8 bytes of a body.  Producer and consumer run in the same process, so the
  monotonic clock is shared and no clock sync is involved.
* :class:`LatencyCollector` - records send-to-receive latencies and waits (bounded) until
  every message has arrived.
* :class:`Node` - one ``python -m txmq.cli ... start`` server process (broker or name
  server) of a benchmark: started, waited for (its ready file), stopped by its PID.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024
_STAMP = struct.Struct(">Q")
STAMP_SIZE = _STAMP.size


@runtime_checkable
class System(Protocol):
    """One system under test.  All methods run on one asyncio event loop.

    ``name`` is shown in the table, e.g. ``"rabbitmq (durable, confirms)"``.
    ``durability`` is one line saying what an acknowledgement means, e.g.
    ``"fsync before ack"`` or ``"page cache, fsync every 500ms"``.

    Optional attributes read with ``getattr``: ``key`` (the ``--systems`` key, e.g.
    ``"txmq-sync"``) and ``version`` (server/client versions, shown in the report).
    """

    name: str
    durability: str

    async def setup(self) -> None:
        """Connect; create a fresh queue/stream/topic (delete or purge leftovers)."""
        ...

    async def produce(self, n: int, body: bytes, window: int) -> float:
        """Publish ``n`` copies of ``body`` keeping at most ``window`` unacknowledged in
        flight; return elapsed seconds from the first send until the last ack."""
        ...

    async def consume(self, n: int) -> float:
        """Receive and ack exactly the ``n`` messages produce() stored; return seconds."""
        ...

    async def latency(self, rate: int, duration: float, body_size: int) -> list[float]:
        """Run a consumer concurrently with a producer publishing ``rate`` msg/s for
        ``duration`` seconds (see :func:`run_paced`); return per-message send-to-receive
        latencies in milliseconds.  Every message must arrive (bounded wait)."""
        ...

    async def teardown(self) -> None:
        """Delete what setup() created and close connections."""
        ...


# --------------------------------------------------------------------------- bodies


def stamp(body_size: int) -> bytes:
    """A body of ``body_size`` bytes whose first 8 bytes are ``time.perf_counter_ns()``.

    Call it immediately before handing the body to the client's publish call."""
    size = max(body_size, STAMP_SIZE)
    return _STAMP.pack(time.perf_counter_ns()) + b"x" * (size - STAMP_SIZE)


def read_stamp(body: bytes) -> int:
    """The perf_counter_ns send time written by :func:`stamp`."""
    return int(_STAMP.unpack_from(body)[0])


def payload(size: int) -> bytes:
    """The fixed body used by the throughput phases (not compressible to nothing, not random)."""
    pattern = b"txmq-bench-0123456789abcdefghijklmnopqrstuvwxyz"
    return (pattern * (size // len(pattern) + 1))[:size]


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], p: float) -> float:
    """``p``-th percentile (0..100) by linear interpolation between closest ranks
    (numpy's default 'linear' method).  NaN for an empty sequence."""
    if not values:
        return math.nan
    data = sorted(values)
    if len(data) == 1:
        return float(data[0])
    pos = (len(data) - 1) * (p / 100.0)
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return float(data[lo])
    return float(data[lo] + (data[hi] - data[lo]) * (pos - lo))


# --------------------------------------------------------------------------- publishing helpers


async def run_windowed(n: int, window: int, send_one: Callable[[int], Awaitable[object]]) -> float:
    """Call ``send_one(i)`` for i in 0..n-1 with at most ``window`` calls outstanding.

    ``send_one`` must return only once the broker acknowledged message ``i``.  Implemented
    as ``window`` workers pulling from a shared counter, so a slot is refilled as soon as
    an ack arrives.  Returns elapsed seconds from the first send to the last ack."""
    if n <= 0:
        return 0.0
    next_i = 0

    async def worker() -> None:
        nonlocal next_i
        while next_i < n:
            i = next_i
            next_i += 1
            await send_one(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(max(1, min(window, n)))))
    return time.perf_counter() - t0


@dataclass
class PaceStats:
    """What :func:`run_paced` achieved."""

    planned: int
    sent: int
    elapsed_s: float
    max_lag_ms: float  # worst delay of a send behind its scheduled deadline

    @property
    def achieved_rate(self) -> float:
        return self.sent / self.elapsed_s if self.elapsed_s > 0 else math.nan


# Every run_paced() call appends its stats here; run.py reads the entry of each latency phase.
PACE_LOG: list[PaceStats] = []


async def run_paced(
    rate: int,
    duration: float,
    body_size: int,
    send: Callable[[bytes], Awaitable[object]],
    window: int = 256,
) -> PaceStats:
    """Publish ``round(rate * duration)`` messages, message ``i`` due at ``t0 + i/rate``.

    Deadlines are absolute, so sleeping late never accumulates drift: a late producer
    catches up by sending immediately.  Each send runs in its own task (a confirm round
    trip longer than 1/rate must not hold back the schedule); at most ``window`` sends are
    unacknowledged at once.  The body is stamped (:func:`stamp`) when the task starts,
    right before ``send`` is called.  Raises the first send error."""
    total = max(1, round(rate * duration))
    interval_ns = 1_000_000_000 / rate
    sem = asyncio.Semaphore(window)
    tasks: set[asyncio.Task[None]] = set()
    errors: list[BaseException] = []
    max_lag_ns = 0

    async def one() -> None:
        try:
            await send(stamp(body_size))
        except Exception as exc:  # reported after the loop
            errors.append(exc)
        finally:
            sem.release()

    t0 = time.perf_counter_ns()
    for i in range(total):
        if errors:
            break
        deadline = t0 + int(i * interval_ns)
        delay = deadline - time.perf_counter_ns()
        await asyncio.sleep(delay / 1e9 if delay > 0 else 0)
        await sem.acquire()
        max_lag_ns = max(max_lag_ns, time.perf_counter_ns() - deadline)
        task = asyncio.create_task(one())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)
    elapsed = (time.perf_counter_ns() - t0) / 1e9
    if errors:
        raise errors[0]
    stats = PaceStats(planned=total, sent=total, elapsed_s=elapsed, max_lag_ms=max_lag_ns / 1e6)
    PACE_LOG.append(stats)
    return stats


class LatencyCollector:
    """Consumer side of the latency phase: ``record(body)`` on each received message."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.latencies_ms: list[float] = []
        self._done = asyncio.Event()
        if expected <= 0:
            self._done.set()

    def record(self, body: bytes) -> None:
        now = time.perf_counter_ns()
        self.latencies_ms.append((now - read_stamp(body)) / 1e6)
        if len(self.latencies_ms) >= self.expected:
            self._done.set()

    async def wait(self, limit_s: float) -> list[float]:
        """Wait up to ``limit_s`` seconds until ``expected`` messages arrived; TimeoutError
        naming the shortfall otherwise."""
        try:
            await asyncio.wait_for(self._done.wait(), limit_s)
        except TimeoutError:
            raise TimeoutError(
                f"latency: only {len(self.latencies_ms)}/{self.expected} messages arrived "
                f"within {limit_s:.1f}s after the producer finished"
            ) from None
        return self.latencies_ms


def expected_messages(rate: int, duration: float) -> int:
    """How many messages :func:`run_paced` sends for ``rate`` and ``duration``."""
    return max(1, round(rate * duration))


# --------------------------------------------------------------------------- results


@dataclass
class Result:
    key: str
    name: str
    durability: str
    version: str = ""
    messages: int = 0
    size: int = 0
    window: int = 0
    produce_s: float | None = None
    consume_s: float | None = None
    rate: int = 0
    duration: float = 0.0
    latency_count: int = 0
    latency_send_rate: float | None = None  # achieved by run_paced, if the system used it
    latency_max_lag_ms: float | None = None  # worst send delay behind schedule
    latency_ms: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def produce_msgs(self) -> float | None:
        return self.messages / self.produce_s if self.produce_s else None

    @property
    def produce_mib(self) -> float | None:
        return self.messages * self.size / MiB / self.produce_s if self.produce_s else None

    @property
    def consume_msgs(self) -> float | None:
        return self.messages / self.consume_s if self.consume_s else None

    def set_latencies(self, lat: Sequence[float]) -> None:
        self.latency_count = len(lat)
        if lat:
            self.latency_ms = {
                "p50": percentile(lat, 50),
                "p90": percentile(lat, 90),
                "p99": percentile(lat, 99),
                "p999": percentile(lat, 99.9),
                "max": max(lat),
                "min": min(lat),
                "mean": sum(lat) / len(lat),
            }

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["produce_msgs_per_s"] = self.produce_msgs
        d["produce_mib_per_s"] = self.produce_mib
        d["consume_msgs_per_s"] = self.consume_msgs
        return d


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _fmt(v: float | None, digits: int = 0) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.{digits}f}"


def format_table(results: Sequence[Result]) -> str:
    """One row per system: produce msg/s and MiB/s, consume msg/s, latency p50/p99/max."""
    headers = [
        "system",
        "produce msg/s",
        "produce MiB/s",
        "consume msg/s",
        "lat p50 ms",
        "lat p99 ms",
        "lat max ms",
        "durability",
    ]
    rows = []
    for r in results:
        lat = r.latency_ms
        rows.append(
            [
                r.name + (" [errors]" if r.errors else ""),
                _fmt(r.produce_msgs),
                _fmt(r.produce_mib, 1),
                _fmt(r.consume_msgs),
                _fmt(lat.get("p50"), 2),
                _fmt(lat.get("p99"), 2),
                _fmt(lat.get("max"), 2),
                r.durability,
            ]
        )
    widths = [
        max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
        for i, h in enumerate(headers)
    ]
    right = {1, 2, 3, 4, 5, 6}

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, c in enumerate(cells):
            if i == len(cells) - 1:
                out.append(c)
            elif i in right:
                out.append(c.rjust(widths[i]))
            else:
                out.append(c.ljust(widths[i]))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def dump_json(path: str, results: Sequence[Result], params: dict[str, Any]) -> None:
    doc = {
        "machine": machine_info(),
        "params": params,
        "results": [r.to_dict() for r in results],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, default=str)
        f.write("\n")


# -- where the CPU goes ----------------------------------------------------------------------

#: clock ticks per second of /proc's CPU times
TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def machine_busy() -> float:
    """Busy seconds of all cores so far (``/proc/stat``: everything but idle and iowait)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / TICK


# -- server processes -------------------------------------------------------------------------


def wait_for(
    predicate: Callable[[], Any], timeout: float, interval: float = 0.02, what: str = "condition"
) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); TimeoutError after
    ``timeout`` s (the tests' wait_for turns it into their failure)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout}s")
        time.sleep(interval)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a ``--grpc-port`` or ``--metrics-port``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Node:
    """``python -m txmq.cli --log-level L <argv> --port P --ready-file F`` in its own process.

    ``argv`` is the command and its options (``["broker", "start", "--store", ...]``,
    ``["namesrv", "start"]``); ``extra`` is appended to it.  The ready file
    (``tmp/<name>.ready``) and the log (``tmp/<name>.log``: stdout and stderr, appended to
    across restarts) live in ``tmp``, so several nodes of one folder need distinct names.
    :meth:`start` launches (again, on the same store), :meth:`wait_ready` or
    :meth:`wait_ready_async` wait at most ``timeout`` seconds for the address the process
    writes to its ready file; :meth:`stop` ends it by SIGTERM, then SIGKILL.  Every wait is
    bounded and every signal goes to the node's own PID.  ``port`` 0 (default): a free port
    at each start; else that port at every start (a node others must find again where they
    were told, say a controller on etcd started again after its death).  ``port_flag``: the
    option that port is given with (a proxy's is ``--grpc-port``).
    """

    POLL_S = 0.02

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        tmp: Path | str,
        log_level: str = "WARNING",
        *,
        extra: Sequence[str] = (),
        timeout: float = 60.0,
        port: int = 0,
        port_flag: str = "--port",
    ) -> None:
        self.name = name
        self.port_flag = port_flag
        self.argv = [*argv, *extra]
        self.port = port
        self.tmp = Path(tmp)
        self.log_level = log_level
        self.timeout = timeout
        self.ready = self.tmp / f"{name}.ready"
        self.log = self.tmp / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.starts = 0

    def start(self) -> Node:
        """Launch (again, on the same store and log); :meth:`wait_ready` waits for it."""
        assert not self.alive(), f"{self.name} runs already"
        self.ready.unlink(missing_ok=True)
        self.address = ""
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "txmq.cli", "--log-level", self.log_level),
                    *self.argv,
                    *(self.port_flag, str(self.port), "--ready-file", str(self.ready)),
                ],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self.starts += 1
        return self

    def _is_ready(self, deadline: float) -> bool:
        """True once the ready file holds the address (then in :attr:`address`).  If the
        process ended first, or ``deadline`` passed (the process is then killed), a
        RuntimeError with the end of its log."""
        if self.ready.exists() and (address := self.ready.read_text()):
            self.address = address
            return True
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise RuntimeError(f"{self.name} did not start (exit {code}):\n{self.tail()}")
        if time.monotonic() > deadline:
            self.kill()
            raise RuntimeError(f"{self.name} not ready in time, killed:\n{self.tail()}")
        return False

    def wait_ready(self, timeout: float | None = None) -> str:
        """The address, once the process wrote it (at most ``timeout`` s; default: the
        node's)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not self._is_ready(deadline):
            time.sleep(self.POLL_S)
        return self.address

    async def wait_ready_async(self, timeout: float | None = None) -> str:
        """:meth:`wait_ready` for a coroutine: polls with ``asyncio.sleep``."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:  # a file to poll: no event to wait on
            if self._is_ready(deadline):
                return self.address
            await asyncio.sleep(self.POLL_S)

    def tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cpu(self) -> float:
        """User + system CPU seconds of the running process so far (0 if it is not)."""
        return proc_cpu(self.pid) if self.alive() else 0.0

    def kill(self) -> None:
        """SIGKILL by PID and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM by PID; SIGKILL if still running ``timeout`` s later."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    async def stop_async(self, timeout: float = 30.0) -> None:
        """:meth:`stop` for a coroutine: waits in a thread, the event loop runs on."""
        await asyncio.to_thread(self.stop, timeout)
