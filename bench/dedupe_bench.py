"""What the broker's dedupe window (no duplicates from send retries) costs.

    python bench/dedupe_bench.py [--rounds 6] [--messages 50000] [--size 1024] [--window 256]
                                 [--flush async|sync] [--json out.json]
                                 [--aa]   # both brokers off: the machine's noise
    python bench/dedupe_bench.py --in-process [--rounds 40] [--chunk 5000]

One run starts two brokers as a user would (``txmq broker start``, every setting at its
default, one of them with ``TXMQ_BROKER_DEDUPE_WINDOW_S=0``: the dedupe off), each on a
store of its own in a temporary folder, and one client process with a ``txmq.Producer``
per broker.  Then ``--rounds`` times, alternating which broker goes first (on/off,
off/on, ...): ``--messages`` messages of ``--size`` bytes to each broker in turn, at most
``--window`` unacknowledged (fresh message ids: every send is looked up and added), timing
first send to last acknowledgement and the broker process's CPU seconds over the round.

Printed: per round and as medians, msg/s and broker CPU µs per message on and off, and
the median of the rounds' on/off ratios (each round's pair ran back to back: the ratio is
steadier than the medians on a busy machine); then each broker's resident memory at the end (the
"on" broker holds up to ``dedupe_max_entries`` ids) and the time each takes to start again
on its store after SIGTERM (the "on" broker loads the window from its key index: the
broker logs how many hashes and how long).  Both brokers are stopped by PID and the
folder removed.

``--in-process``: the send path alone, without sockets or a client — three brokers' send
services in this process (dedupe on, off, off again: the noise), their stores in a
temporary folder, taking ``--chunk`` fresh 1 KiB messages each in turn (a shuffled order
each round), ``--rounds`` times; printed: the median CPU µs per send of each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import machine_info, payload, proc_cpu, run_windowed  # noqa: E402

TOPIC = "dedupe-bench"
QUEUES = 4


@dataclass
class Side:
    name: str
    env: dict[str, str]
    folder: Path
    proc: subprocess.Popen[bytes] | None = None
    address: str = ""
    rates: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)
    start_s: list[float] = field(default_factory=list)

    @property
    def log(self) -> Path:
        return self.folder / "broker.log"

    def start(self) -> float:
        ready = self.folder / "ready"
        ready.unlink(missing_ok=True)
        began = time.monotonic()
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "txmq.cli",
                    "broker",
                    "start",
                    "--store",
                    str(self.folder / "store"),
                    "--port",
                    "0",
                    "--grpc-port",
                    "0",
                    "--metrics-port",
                    "0",
                    "--ready-file",
                    str(ready),
                ],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            )
        deadline = began + 120
        while not (ready.exists() and ready.read_text()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"broker {self.name} did not start:\n{self.log.read_text()}")
            time.sleep(0.01)
        self.address = ready.read_text()
        return time.monotonic() - began

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def rss_mib(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0


async def produce(side: Side, n: int, body: bytes, window: int) -> None:
    from txmq import Message, Producer

    assert side.proc is not None
    async with Producer(side.address, "dedupe-bench") as producer:
        await producer.send(Message(TOPIC, b"warm-up"))
        cpu0 = proc_cpu(side.proc.pid)

        async def send_one(i: int) -> None:
            await producer.send(Message(TOPIC, body))  # a fresh message id each

        took = await run_windowed(n, window, send_one)
        cpu = proc_cpu(side.proc.pid) - cpu0
    side.rates.append(n / took)
    side.cpu_us.append(cpu / n * 1e6)


def _median_ratio(on: list[float], off: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(on, off, strict=True))


def run(args: argparse.Namespace) -> dict[str, object]:
    folder = Path(tempfile.mkdtemp(prefix="txmq-dedupe-bench-"))
    flush = {"TXMQ_BROKER_FLUSH": args.flush}
    on_env = {**flush, "TXMQ_BROKER_DEDUPE_WINDOW_S": "0"} if args.aa else dict(flush)
    on = Side("on", on_env, folder / "on")
    off = Side("off", {**flush, "TXMQ_BROKER_DEDUPE_WINDOW_S": "0"}, folder / "off")
    body = payload(args.size)
    result: dict[str, object] = {"params": vars(args), "machine": machine_info()}
    try:
        for side in (on, off):
            side.folder.mkdir(parents=True)
            side.start()
            asyncio.run(_create_topic(side.address))
        for r in range(args.rounds):
            order = (on, off) if r % 2 == 0 else (off, on)
            for side in order:
                asyncio.run(produce(side, args.messages, body, args.window))
            print(
                f"round {r + 1}: on {on.rates[-1]:,.0f} msg/s {on.cpu_us[-1]:.1f} µs/msg · "
                f"off {off.rates[-1]:,.0f} msg/s {off.cpu_us[-1]:.1f} µs/msg",
                flush=True,
            )
        rss = {side.name: side.rss_mib() for side in (on, off)}
        for side in (on, off):
            side.stop()
            side.start_s.append(side.start())
        read_back = re.findall(
            r"dedupe window: (\d+) key hashes .* loaded from the key index in (\d+) ms",
            on.log.read_text(),
        )
        result.update(
            rounds={
                s.name: {"msg_per_s": s.rates, "broker_cpu_us_per_msg": s.cpu_us} for s in (on, off)
            },
            median_msg_per_s={s.name: statistics.median(s.rates) for s in (on, off)},
            median_cpu_us={s.name: statistics.median(s.cpu_us) for s in (on, off)},
            ratio_msg_per_s=_median_ratio(on.rates, off.rates),
            ratio_cpu_us=_median_ratio(on.cpu_us, off.cpu_us),
            rss_mib=rss,
            restart_s={s.name: s.start_s[-1] for s in (on, off)},
            window_read_back=[int(x) for x in read_back[-1]] if read_back else None,
            messages_per_broker=args.rounds * args.messages,
        )
    finally:
        for side in (on, off):
            side.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return result


async def _create_topic(address: str) -> None:
    from txmq import AdminClient

    async with AdminClient(address) as admin:
        await admin.create_topic(TOPIC, QUEUES)


def report(res: dict[str, object]) -> str:
    rate = res["median_msg_per_s"]
    cpu = res["median_cpu_us"]
    rss = res["rss_mib"]
    restart = res["restart_s"]
    assert isinstance(rate, dict) and isinstance(cpu, dict)
    assert isinstance(rss, dict) and isinstance(restart, dict)
    params = res["params"]
    assert isinstance(params, dict)
    lines = [
        "",
        f"median of {params['rounds']} rounds ({res['messages_per_broker']:,} messages per "
        f"broker, {params['flush']} flush)",
        "| dedupe | produce msg/s | broker CPU µs/msg | RSS at the end MiB | restart s |",
        "|---|---|---|---|---|",
    ]
    for name in ("on", "off"):
        lines.append(
            f"| {name} | {rate[name]:,.0f} | {cpu[name]:.1f} | {rss[name]:.0f} | "
            f"{restart[name]:.2f} |"
        )
    lines.append(
        f"on / off, median of the rounds' ratios: msg/s {res['ratio_msg_per_s']:.3f}, broker "
        f"CPU per message {res['ratio_cpu_us']:.3f}; memory {rss['on'] - rss['off']:+.0f} MiB"
        + (" (--aa: both brokers off)" if params["aa"] else "")
    )
    back = res.get("window_read_back")
    if isinstance(back, list):
        lines.append(f"restart: {back[0]:,} key hashes loaded from the key index in {back[1]} ms")
    return "\n".join(lines)


def in_process(args: argparse.Namespace) -> dict[str, float]:
    """Median CPU µs per SendService.put of brokers with dedupe on, off and off."""
    import random

    from txmq.broker.server import Broker
    from txmq.broker.state.config import BrokerConfig
    from txmq.protocol.message import Message, new_message_id
    from txmq.protocol.wire import SendMessage

    folder = Path(tempfile.mkdtemp(prefix="txmq-dedupe-bench-"))
    brokers: dict[str, Broker] = {}
    try:
        for name, window in (("on", 120.0), ("off", 0.0), ("off again", 0.0)):
            config = BrokerConfig(
                store=folder / name.replace(" ", "-"),
                port=0,
                grpc_port=0,
                metrics_port=0,
                dedupe_window_s=window,
                export_segments=False,
            )
            brokers[name] = Broker(config)
            brokers[name].store.start()
        body = payload(args.size)
        times: dict[str, list[float]] = {name: [] for name in brokers}
        rng = random.Random(7)
        for _ in range(args.rounds):
            names = list(brokers)
            rng.shuffle(names)
            for name in names:
                reqs = [
                    SendMessage(
                        topic=TOPIC,
                        queue_id=i % QUEUES,
                        properties=Message(TOPIC, body).wire_properties(new_message_id()),
                        born_timestamp=1,
                        group="bench",
                    )
                    for i in range(args.chunk)
                ]
                put = brokers[name].services.sending.put
                began = time.process_time()
                for req in reqs:
                    put(req, body)
                times[name].append((time.process_time() - began) / args.chunk * 1e6)
        return {name: statistics.median(t) for name, t in times.items()}
    finally:
        for broker in brokers.values():
            broker.store.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--messages", type=int, default=50_000)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--flush", choices=("async", "sync"), default="async")
    p.add_argument("--json", help="write the raw numbers here")
    p.add_argument("--aa", action="store_true", help="both brokers off: the machine's noise")
    p.add_argument("--in-process", action="store_true", help="the send path alone")
    p.add_argument("--chunk", type=int, default=5000)
    args = p.parse_args(argv)
    if args.in_process:
        medians = in_process(args)
        for name, us in medians.items():
            print(f"{name:>9}: {us:.2f} µs per send ({us - medians['off']:+.2f})")
        return 0
    res = run(args)
    print(report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
