"""Timer messages (exact delivery times): how fast they are stored and delivered, how late.

    python bench/timer_bench.py [--pending 10000 100000] [--spread 20] [--batch 500]

For each N of ``--pending``, one broker process (``txmq broker start``, defaults, a store
in a temporary folder) and two runs:

- *spread*: N timers sent with ``send_batch`` (4 batches in flight), their delivery times
  spread evenly over ``--spread`` seconds starting after the sends; measured: timers stored
  per second (first send to last acknowledgement), then, from the delivered copies' store
  timestamps, lateness p50 / p99 / max (store time - delivery time);
- *burst*: N timers all due at the same millisecond: delivered per second (N / (last
  copy's store time - due time)) with N pending, and the lateness of the last one.

Then the broker is restarted (SIGTERM) with N timers pending and the time to start is
printed (the wheel is rebuilt from the timer log).  The broker is stopped by PID and the
folder removed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import percentile  # noqa: E402
from txmq import Message, Producer, PullConsumer, PullStatus  # noqa: E402


def _ms() -> int:
    return time.time_ns() // 1_000_000


class Broker:
    def __init__(self, folder: Path) -> None:
        self.store = folder / "store"
        self.ready = folder / "ready"
        self.log = folder / "broker.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""

    def start(self) -> float:
        self.ready.unlink(missing_ok=True)
        began = time.monotonic()
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "txmq.cli", "broker", "start", "--store", str(self.store),
                 "--port", "0", "--grpc-port", "0", "--metrics-port", "0",
                 "--ready-file", str(self.ready)],
                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
            )  # fmt: skip
        while not (self.ready.exists() and self.ready.read_text()):
            if self.proc.poll() is not None:
                raise SystemExit(f"broker exited:\n{self.log.read_text()}")
            time.sleep(0.02)
        self.address = self.ready.read_text()
        return time.monotonic() - began

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)


async def send(address: str, topic: str, dues: list[int], batch: int) -> float:
    began = time.monotonic()
    sem = asyncio.Semaphore(4)
    async with Producer(address, send_timeout=60) as producer:

        async def one(first: int) -> None:
            async with sem:
                await producer.send_batch(
                    [
                        Message(
                            topic,
                            f"{i} {dues[i]}".encode(),
                            deliver_at=datetime.fromtimestamp(dues[i] / 1000, UTC),
                        )
                        for i in range(first, min(first + batch, len(dues)))
                    ]
                )

        await asyncio.gather(*(one(f) for f in range(0, len(dues), batch)))
    return time.monotonic() - began


async def delivered(address: str, topic: str, n: int, until_ms: int) -> dict[int, int]:
    """index -> the delivered copy's store time, once all n are there (or until_ms)."""
    out: dict[int, int] = {}
    async with PullConsumer(address, f"{topic}-reader") as consumer:
        queues = await consumer.queues(topic)
        offsets = dict.fromkeys(queues, 0)
        while len(out) < n and _ms() < until_ms:
            for qid in queues:
                res = await consumer.pull(topic, qid, offsets[qid], max_msgs=1024, long_poll=0)
                if res.status == PullStatus.FOUND:
                    for m in res.messages:
                        out[int(m.body.split()[0])] = m.store_timestamp
                    offsets[qid] = res.next_offset
            await asyncio.sleep(0.2)
    return out


async def run(n: int, spread_s: float, batch: int) -> dict[str, float]:
    folder = Path(tempfile.mkdtemp(prefix="timer-bench-"))
    broker = Broker(folder)
    row: dict[str, float] = {"pending": n}
    try:
        broker.start()
        lead = max(5_000, n // 8)  # ms: the sends are over by then (~20-40k/s)
        t0 = _ms() + lead
        dues = [t0 + i * int(spread_s * 1000) // n for i in range(n)]
        took = await send(broker.address, "spread", dues, batch)
        row["stored/s"] = n / took
        got = await delivered(broker.address, "spread", n, t0 + int(spread_s * 1000) + 60_000)
        late = [(got[i] - dues[i]) / 1000 for i in got]
        row["delivered"] = len(got)
        row["p50"], row["p99"], row["max"] = (
            percentile(late, 50), percentile(late, 99), max(late)
        )  # fmt: skip
        due = _ms() + lead
        await send(broker.address, "burst", [due] * n, batch)
        got = await delivered(broker.address, "burst", n, due + 120_000)
        last = max(got.values()) - due
        row["burst delivered/s"] = n / max(last / 1000, 1e-3)
        row["burst last late s"] = last / 1000
        far = _ms() + 600_000  # N pending across a restart
        await send(broker.address, "far", [far + i for i in range(n)], batch)
        broker.stop()
        row["restart s"] = broker.start()
    finally:
        broker.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pending", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--spread", type=float, default=20.0)
    ap.add_argument("--batch", type=int, default=500)
    args = ap.parse_args()
    print(f"cpus {os.cpu_count()}, python {sys.version.split()[0]}, spread {args.spread}s")
    cols = [
        "pending", "stored/s", "delivered", "p50", "p99", "max",
        "burst delivered/s", "burst last late s", "restart s",
    ]  # fmt: skip
    print(" | ".join(cols))
    for n in args.pending:
        row = asyncio.run(run(n, args.spread, args.batch))
        print(" | ".join(f"{row[c]:,.3f}" if row[c] < 100 else f"{row[c]:,.0f}" for c in cols))


if __name__ == "__main__":
    main()
