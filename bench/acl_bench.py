"""What access control and TLS cost a producer: throughput with ACL + TLS vs without.

    python bench/acl_bench.py [--rounds 6] [--messages 20000] [--size 1024] [--window 256]
                              [--batch 0] [--json out.json]

One run starts five brokers as a user would (``txmq broker start``, defaults otherwise),
each on a store of its own in a temporary folder: ``plain``; ``acl`` (``--acl FILE``: every
request signed with HMAC-SHA256 and checked against the user's rules); ``tls``
(``--tls-cert/--tls-key``, a certificate authority made for the run); ``acl+tls`` (both,
``--acl-auth-strategy stateless``: every request signed and checked, RocketMQ's default);
and ``acl+tls stateful`` (both, the stateful strategy, txmq's default: the connection is
authenticated by its first signed request, the later ones go unsigned).  One client
process holds a ``txmq.Producer`` per broker (with the user's credentials and the CA where
the broker needs them).  Then ``--rounds`` times, in a rotating order: ``--messages`` sends
of ``--size`` bytes to each broker, at most ``--window`` unacknowledged (``--batch N``:
batches of N messages instead), timing first send to last acknowledgement, and the
broker's CPU seconds over the round.

Printed: per round and as medians, msg/s and the broker's and the client's CPU µs per
message of each (two processes on two cores: together they bound the rate); and for
each secured broker the median of the rounds' ratios to ``plain`` (the goal for acl+tls,
either strategy: at most 15 % fewer msg/s).  Every broker is stopped by PID and the
folder removed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Node, machine_info, payload, proc_cpu, run_windowed  # noqa: E402

TOPIC = "acl-bench"
QUEUES = 4
USER = ("bench", "bench-secret-1")
POLICY = f"""
[users.{USER[0]}]
secret_key = "{USER[1]}"
rules = [{{ resource = "topic:{TOPIC}", actions = ["pub", "admin"] }}]
"""


#: the goal: ACL over TLS costs at most this share of plain's produce throughput
GOAL = 0.15


@dataclass
class Side:
    name: str
    acl: bool
    tls: bool
    #: --acl-auth-strategy (None: the default)
    strategy: str | None = None
    node: Node | None = None
    rates: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)
    client_us: list[float] = field(default_factory=list)

    def client_options(self, ca: Path) -> dict[str, Any]:
        opts: dict[str, Any] = {}
        if self.acl:
            opts.update(access_key=USER[0], secret_key=USER[1])
        if self.tls:
            opts.update(tls=True, tls_ca=ca)
        return opts


async def produce(side: Side, ca: Path, n: int, body: bytes, window: int, batch: int) -> None:
    from txmq import Message, Producer

    assert side.node is not None
    async with Producer(side.node.address, "acl-bench", **side.client_options(ca)) as producer:
        await producer.send(Message(TOPIC, b"warm-up"))
        cpu0 = proc_cpu(side.node.pid)
        client0 = time.process_time()
        if batch:
            messages = [Message(TOPIC, body) for _ in range(batch)]

            async def send_batch(i: int) -> None:
                await producer.send_batch(messages)

            took = await run_windowed(n // batch, max(1, window // batch), send_batch)
        else:

            async def send_one(i: int) -> None:
                await producer.send(Message(TOPIC, body))

            took = await run_windowed(n, window, send_one)
        cpu = proc_cpu(side.node.pid) - cpu0
        client = time.process_time() - client0
    side.rates.append(n / took)
    side.cpu_us.append(cpu / n * 1e6)
    side.client_us.append(client / n * 1e6)


async def _create_topic(side: Side, ca: Path) -> None:
    from txmq import AdminClient

    assert side.node is not None
    async with AdminClient(side.node.address, **side.client_options(ca)) as admin:
        await admin.create_topic(TOPIC, QUEUES)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from txmq.security.certs import make_test_ca

    folder = Path(tempfile.mkdtemp(prefix="txmq-acl-bench-"))
    sides = [
        Side("plain", acl=False, tls=False),
        Side("acl", acl=True, tls=False),
        Side("tls", acl=False, tls=True),
        Side("acl+tls", acl=True, tls=True, strategy="stateless"),
        Side("acl+tls stateful", acl=True, tls=True, strategy="stateful"),
    ]
    body = payload(args.size)
    result: dict[str, Any] = {"params": vars(args), "machine": machine_info()}
    try:
        certs = make_test_ca(folder / "certs")
        acl = folder / "acl.toml"
        acl.write_text(POLICY)
        for side in sides:
            slug = side.name.replace("+", "-").replace(" ", "-")
            argv = ["broker", "start", "--store", str(folder / slug), "--grpc-port", "0"]
            argv += ["--metrics-port", "0"]
            if side.acl:
                argv += ["--acl", str(acl)]
            if side.strategy:
                argv += ["--acl-auth-strategy", side.strategy]
            if side.tls:
                argv += ["--tls-cert", str(certs.cert), "--tls-key", str(certs.key)]
            side.node = Node(slug, argv, folder).start()
        for side in sides:
            assert side.node is not None
            side.node.wait_ready()
            asyncio.run(_create_topic(side, certs.ca))
        for r in range(args.rounds):
            order = sides[r % len(sides) :] + sides[: r % len(sides)]
            for side in order:
                asyncio.run(produce(side, certs.ca, args.messages, body, args.window, args.batch))
            print(
                f"round {r + 1}: "
                + " · ".join(
                    f"{s.name} {s.rates[-1]:,.0f} msg/s, CPU µs/msg broker {s.cpu_us[-1]:.1f} "
                    f"client {s.client_us[-1]:.1f}"
                    for s in sides
                ),
                flush=True,
            )
        plain = sides[0]
        result.update(
            median_msg_per_s={s.name: statistics.median(s.rates) for s in sides},
            median_cpu_us={s.name: statistics.median(s.cpu_us) for s in sides},
            median_client_us={s.name: statistics.median(s.client_us) for s in sides},
            ratio_msg_per_s={
                s.name: statistics.median(a / b for a, b in zip(s.rates, plain.rates, strict=True))
                for s in sides[1:]
            },
            ratio_cpu_us={
                s.name: statistics.median(
                    a / b for a, b in zip(s.cpu_us, plain.cpu_us, strict=True)
                )
                for s in sides[1:]
            },
            messages_per_broker=args.rounds * args.messages,
        )
    finally:
        for side in sides:
            if side.node is not None:
                side.node.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return result


def report(res: dict[str, Any]) -> str:
    params = res["params"]
    what = f"batches of {params['batch']}" if params["batch"] else "single sends"
    lines = [
        "",
        f"median of {params['rounds']} rounds ({res['messages_per_broker']:,} messages of "
        f"{params['size']} B per broker, {what}, window {params['window']})",
        "| broker | produce msg/s | vs plain | broker CPU µs/msg | vs plain | client CPU µs/msg |",
        "|---|---|---|---|---|---|",
    ]
    for name, rate in res["median_msg_per_s"].items():
        ratio = res["ratio_msg_per_s"].get(name)
        cpu_ratio = res["ratio_cpu_us"].get(name)
        lines.append(
            f"| {name} | {rate:,.0f} | "
            + (f"{ratio:.3f}" if ratio is not None else "1")
            + f" | {res['median_cpu_us'][name]:.1f} | "
            + (f"{cpu_ratio:.3f}" if cpu_ratio is not None else "1")
            + f" | {res['median_client_us'][name]:.1f} |"
        )
    for name in ("acl+tls", "acl+tls stateful"):
        cost = 1 - res["ratio_msg_per_s"][name]
        verdict = "met" if cost <= GOAL else "missed"
        lines.append(
            f"{name} costs {cost:.1%} of plain's throughput (goal: at most {GOAL:.0%}, {verdict})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--batch", type=int, default=0, help="send batches of this many")
    p.add_argument("--json", help="write the raw numbers here")
    args = p.parse_args(argv)
    res = run(args)
    print(report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
