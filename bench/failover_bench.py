"""Failover time of a replicated broker set: SIGKILL the master, time until sends succeed.

    python bench/failover_bench.py [--kills 10] [--replication sync|async] [--threads 4]
                                   [--send-timeout 3] [--seed 18] [--json out.json]
                                   [--keep]   # keep the logs and stores (printed path)

One run starts, as a user would (real processes, free ports, stores in a temporary
folder, every setting at its default): a name server with the controller inside (``txmq
namesrv start --controller-store``) and one broker set of three brokers (``txmq broker
start --namesrv NS --cluster bench --broker-name failover --broker-id 0|1|2 --replication
sync|async --controller NS``), topic ``failover`` with 4 queues.

``--threads`` producers (``txmq.sync.Producer(namesrv=NS, retry_times=0)``, one per
thread) send numbered messages through the name server without a pause: each number is
sent once (a failed send is not retried, so nothing acknowledged can be stored twice by a
retry); the bench remembers when each send began and when it was acknowledged (status
SEND_OK; a SYNC_MASTER's SLAVE_NOT_AVAILABLE / FLUSH_SLAVE_TIMEOUT counts as not
acknowledged, "unsafe").

Then ``--kills`` times: wait until the set is whole (the controller names a master and
every other replica is alive and in its sync state set) and a send was acknowledged since,
wait a random 0-1 s (``--seed``), SIGKILL the master (by PID), and measure

- **elected**: kill -> the controller names another master (``GetReplicaInfo`` polled every
  20 ms);
- **failover**: kill -> the first acknowledgement of a send that *began* after the kill
  (the issue's failover time; goal under 5 s);

then start the killed broker again on its store (it rejoins as a slave, cutting any tail
the new master never had) and time until the set is whole again.

At the end the producers stop, the replicas' commit logs converge, and every message of
the topic is read from the final master (pull through the name server): **lost** =
acknowledged numbers that are not there, each charged to the first kill after its
acknowledgement; **duplicates** = numbers stored more than once.  A SYNC_MASTER must lose
nothing; an ASYNC_MASTER loses what its slaves had not copied when it died.  Every process
is stopped by PID and the temporary folder removed.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import functools
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import machine_info  # noqa: E402
from bench.replicas import (  # noqa: E402
    BrokerSet,
    commit_log_end,
    consume_all,
    create_topic,
    git_head,
    namesrv_node,
)

SET = "failover"
TOPIC = "failover"


@dataclass
class Sender:
    """Producer threads sending numbered messages, each number once (``retry_times=0``)."""

    namesrv: str
    threads: int = 4
    send_timeout: float = 3.0
    #: number -> (when its send began, when it was acknowledged), monotonic
    acked: dict[int, tuple[float, float]] = field(default_factory=dict)
    #: acknowledgement times in the order they were recorded, and their numbers
    ack_log: list[tuple[float, float, int]] = field(default_factory=list)
    unsafe: set[int] = field(default_factory=set)  # SLAVE_NOT_AVAILABLE / FLUSH_SLAVE_TIMEOUT
    failed: set[int] = field(default_factory=set)  # an exception (not stored, or unknown)
    errors: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _workers: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Sender:
        for t in range(self.threads):
            worker = threading.Thread(target=self._run, args=(t,), daemon=True)
            worker.start()
            self._workers.append(worker)
        return self

    def _run(self, t: int) -> None:
        from txmq import Message
        from txmq.protocol.wire.errors import TxmqError
        from txmq.sync import Producer

        n = t
        with Producer(
            namesrv=self.namesrv, retry_times=0, send_timeout=self.send_timeout
        ) as producer:
            while not self._stop.is_set():
                began = time.monotonic()
                try:
                    r = producer.send(Message(TOPIC, str(n).encode(), keys=[str(n)]))
                except TxmqError as exc:
                    with self._lock:
                        self.failed.add(n)
                        kind = type(exc).__name__
                        self.errors[kind] = self.errors.get(kind, 0) + 1
                    time.sleep(0.02)
                else:
                    done = time.monotonic()
                    with self._lock:
                        if r.status == "SEND_OK":
                            self.acked[n] = (began, done)
                            self.ack_log.append((began, done, n))
                        else:
                            self.unsafe.add(n)
                            self.errors[r.status] = self.errors.get(r.status, 0) + 1
                n += self.threads

    def count(self) -> int:
        with self._lock:
            return len(self.ack_log)

    def more_than(self, count: int) -> bool:
        return self.count() > count

    def first_ack_after(self, moment: float, since: int) -> float | None:
        """The earliest acknowledgement of a send that began after ``moment`` among those
        recorded from index ``since`` on (None: none yet)."""
        with self._lock:
            times = [done for began, done, _ in self.ack_log[since:] if began > moment]
        return min(times) if times else None

    def stop(self) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(30)


@dataclass
class Kill:
    number: int
    killed: int  # broker id of the master killed
    at: float  # monotonic
    acked_before: int
    new_master: int = -1
    elected_s: float = float("nan")
    failover_s: float = float("nan")
    whole_again_s: float = float("nan")  # restart -> the set is whole again
    lost: int = 0
    #: how long before the kill the oldest lost message was acknowledged (the slaves' lag)
    lost_span_s: float = 0.0


def run(args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="txmq-failoverbench-"))
    ns = namesrv_node(tmp, log_level="INFO")
    bs: BrokerSet | None = None
    sender: Sender | None = None
    kills: list[Kill] = []
    try:
        namesrv = ns.start().wait_ready()
        bs = BrokerSet(tmp, namesrv, SET, 3, args.replication, log_level="INFO").start()
        master = bs.wait_healthy()
        asyncio.run(create_topic(namesrv, TOPIC, SET))
        pids = ", ".join(f"{n.name}={n.pid}" for n in bs.nodes.values())
        print(f"{args.replication} set whole, master {master}; pids {pids}", flush=True)
        sender = Sender(namesrv, args.threads, args.send_timeout).start()
        t_start = time.monotonic()
        for k in range(args.kills):
            master = bs.wait_healthy(timeout=120)
            _wait(functools.partial(sender.more_than, sender.count()), 60, "an acknowledgement")
            time.sleep(rng.uniform(0.0, 1.0))  # a random moment while messages flow
            kill = Kill(k + 1, master, time.monotonic(), sender.count())
            bs.nodes[master].kill()
            kill.at = time.monotonic()  # (SIGKILL sent and the process reaped)
            deadline = kill.at + 60
            while time.monotonic() < deadline:
                if kill.new_master < 0:
                    new = bs.master()
                    if new >= 0 and new != master:
                        kill.new_master = new
                        kill.elected_s = time.monotonic() - kill.at
                first = sender.first_ack_after(kill.at, kill.acked_before)
                if first is not None and kill.new_master >= 0:
                    kill.failover_s = first - kill.at
                    break
                time.sleep(0.02)
            else:
                raise TimeoutError(f"kill {k + 1}: no acknowledged send within 60 s")
            restarted = time.monotonic()
            bs.nodes[master].start().wait_ready()
            bs.wait_healthy(timeout=120)
            kill.whole_again_s = time.monotonic() - restarted
            kills.append(kill)
            print(
                f"kill {kill.number}: master {kill.killed} -> {kill.new_master}: elected after "
                f"{kill.elected_s:.2f} s, first acknowledged send after {kill.failover_s:.2f} s;"
                f" whole again {kill.whole_again_s:.2f} s after the restart",
                flush=True,
            )
        time.sleep(1.0)  # some acknowledgements on the last master too
        sender.stop()
        elapsed = time.monotonic() - t_start
        master = bs.wait_healthy(timeout=120)
        end = commit_log_end(bs.nodes[master].address)
        _wait(
            lambda: all(commit_log_end(n.address) == end for n in bs.nodes.values()),
            60,
            "the replicas' commit logs to converge",
        )
        seen = consume_all(namesrv, TOPIC)
        return _result(args, sender, kills, seen, master, elapsed)
    finally:
        if sender is not None:
            sender.stop()
        if bs is not None:
            bs.stop()
        ns.stop()
        if args.keep:
            print(f"logs and stores kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _result(
    args: argparse.Namespace,
    sender: Sender,
    kills: list[Kill],
    seen: dict[bytes, int],
    master: int,
    elapsed: float,
) -> dict[str, object]:
    numbers = {int(body): c for body, c in seen.items()}
    lost = sorted(n for n in sender.acked if n not in numbers)
    dups = sorted(n for n, c in numbers.items() if c > 1)
    moments = [k.at for k in kills]
    after_last = 0
    for n in lost:  # charged to the first kill after the acknowledgement
        acked_at = sender.acked[n][1]
        i = bisect.bisect_left(moments, acked_at)
        if i < len(kills):
            kills[i].lost += 1
            kills[i].lost_span_s = max(kills[i].lost_span_s, kills[i].at - acked_at)
        else:
            after_last += 1
    stored_unacked = sum(1 for n in numbers if n in sender.failed or n in sender.unsafe)
    return {
        "replication": args.replication,
        "kills": [asdict(k) for k in kills],
        "acknowledged": len(sender.acked),
        "unsafe": len(sender.unsafe),
        "failed": len(sender.failed),
        "errors": dict(sorted(sender.errors.items())),
        "stored": sum(numbers.values()),
        "stored_not_acknowledged": stored_unacked,
        "lost": len(lost),
        "lost_after_last_kill": after_last,
        "lost_sample": lost[:20],
        "duplicates": len(dups),
        "duplicate_sample": dups[:20],
        "final_master": master,
        "seconds": elapsed,
    }


def _wait(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout}s")
        time.sleep(0.02)


def report(res: dict[str, object]) -> str:
    kills = res["kills"]
    assert isinstance(kills, list)
    fo = sorted(k["failover_s"] for k in kills)
    el = sorted(k["elected_s"] for k in kills)
    wh = sorted(k["whole_again_s"] for k in kills)
    lost = [k["lost"] for k in kills]
    mode = "SYNC_MASTER" if res["replication"] == "sync" else "ASYNC_MASTER"
    out = [
        "| set | kills | failover p50 s | failover max s | elected p50 / max s "
        "| whole again p50 / max s | acknowledged | lost | lost per kill | duplicates "
        "| unsafe / failed sends |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {mode} + 2 slaves | {len(kills)} | {statistics.median(fo):.2f} | {fo[-1]:.2f} "
        f"| {statistics.median(el):.2f} / {el[-1]:.2f} "
        f"| {statistics.median(wh):.2f} / {wh[-1]:.2f} | {res['acknowledged']:,} "
        f"| {res['lost']} | {' · '.join(str(x) for x in lost)} | {res['duplicates']} "
        f"| {res['unsafe']} / {res['failed']} |",
        "",
        "failover per kill (s): " + " · ".join(f"{k['failover_s']:.2f}" for k in kills),
        "lost per kill, acknowledged within how long before the kill (s): "
        + " · ".join(f"{k['lost']} ({k['lost_span_s']:.2f})" for k in kills),
        f"goal: failover under 5 s: {'met' if fo[-1] < 5 else 'NOT met'} (max {fo[-1]:.2f} s)",
        f"send errors and unsafe answers: {res['errors']}; stored but not acknowledged: "
        f"{res['stored_not_acknowledged']}; lost after the last kill: "
        f"{res['lost_after_last_kill']}",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--replication", choices=("sync", "async"), default="sync")
    ap.add_argument("--threads", type=int, default=4, help="producer threads")
    ap.add_argument("--send-timeout", type=float, default=3.0, help="the producer's default")
    ap.add_argument("--seed", type=int, default=18)
    ap.add_argument("--keep", action="store_true", help="keep the logs and stores")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on SIGTERM too
    load0 = os.getloadavg()
    res = run(args)
    load1 = os.getloadavg()
    info = machine_info()
    print()
    print(
        f"{args.kills} kills, {args.threads} producer threads, send timeout "
        f"{args.send_timeout} s, seed {args.seed}, {res['seconds']:.0f} s; {info['nproc']} "
        f"cores {info['cpu']}, Python {info['python']}; load average before "
        f"{load0[0]:.2f} / {load0[1]:.2f}, after {load1[0]:.2f} / {load1[1]:.2f} (1 / 5 min); "
        f"{git_head()}"
    )
    print(report(res))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": info, "params": vars(args), "result": res}, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
