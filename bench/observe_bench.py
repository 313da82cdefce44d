"""What client metrics and traces cost: produce and consume throughput with them off, with
metrics on and the OpenTelemetry API but no SDK, with metrics and an SDK tracer provider
that samples 1 trace in 100, and with one that records every span but exports nothing —
alternating, in one run, on one broker process; plus the per-call cost of the hooks
themselves.

    .venv/bin/python bench/observe_bench.py [--messages 50000] [--rounds 5]

Produce: ``--messages`` sends of ``--size`` bytes, at most ``--window`` unacknowledged
(concurrent ``Producer.send``).  Consume: a new group's ``PushConsumer`` drains them.
Each round runs every mode once (rotating the order); the table shows each mode's median
messages per second and its cost against "off", and what the hooks of one message (its
send and its processing) cost alone, in nanoseconds, in a loop without a broker.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Node, machine_info, run_windowed
from txmq import ConsumeFrom, Message, MessageExt, Producer, PushConsumer
from txmq.observability import hooks as observe

#: "off": no registry, and the OpenTelemetry API without an SDK (what the hooks check first)
MODES = (
    "off",
    "metrics + API, no SDK",
    "metrics + SDK, 1 % sampled",
    "metrics + SDK, no exporter",
)
#: the most each mode may cost of "off"'s throughput, produce and consume alike
GOALS = {
    "off": "",
    "metrics + API, no SDK": "5 %",
    "metrics + SDK, 1 % sampled": "10 %",
    "metrics + SDK, no exporter": "35 %",
}


def set_mode(mode: str) -> None:
    from prometheus_client import CollectorRegistry

    if mode == "off":
        observe.use_registry(None)
        observe.use_tracer_provider(None)  # the global one: none is set in this process
    elif mode == "metrics + API, no SDK":
        observe.use_registry(CollectorRegistry())
        observe.use_tracer_provider(None)
    elif mode == "metrics + SDK, 1 % sampled":
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        observe.use_registry(CollectorRegistry())
        # what production tracing at these rates looks like: 1 trace in 100 recorded
        observe.use_tracer_provider(TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.01))))
    else:
        from opentelemetry.sdk.trace import TracerProvider

        observe.use_registry(CollectorRegistry())
        observe.use_tracer_provider(TracerProvider())  # records spans, no processor


class Broker:
    """One broker in a temporary folder, removed by :meth:`stop`."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="txmq-observe-bench-"))
        argv = ["broker", "start", "--store", str(self.tmp / "store")]
        self.node = Node("broker", argv, self.tmp, timeout=30)
        try:
            self.address = self.node.start().wait_ready()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.node.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


async def one_round(
    address: str, topic: str, group: str, n: int, size: int, window: int
) -> tuple[float, float]:
    body = b"x" * size
    async with Producer(address, "bench-observe") as producer:
        await producer.send(Message(topic, body))  # route and connection made
        produce_s = await run_windowed(n, window, lambda i: producer.send(Message(topic, body)))
    got = 0
    done = asyncio.Event()

    async def listener(msg: MessageExt) -> None:
        nonlocal got
        got += 1
        if got >= n + 1:
            done.set()

    consumer = PushConsumer(
        address, group, listener=listener, consume_from=ConsumeFrom.FIRST_OFFSET
    )
    consumer.subscribe(topic)
    t0 = time.perf_counter()
    async with consumer:
        await asyncio.wait_for(done.wait(), 300)
        consume_s = time.perf_counter() - t0
    return n / produce_s, n / consume_s


def hook_ns(calls: int = 200_000) -> dict[str, float]:
    """Nanoseconds per send hook (enter, exit) and per consume hook, by mode."""
    out: dict[str, float] = {}
    props = {"UNIQ_KEY": "X" * 32}
    t0 = time.perf_counter_ns()
    for _ in range(calls):  # the loop alone, to subtract
        props = {"UNIQ_KEY": "X" * 32}
    loop = (time.perf_counter_ns() - t0) / calls
    for mode in MODES:
        set_mode(mode)
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            props = {"UNIQ_KEY": "X" * 32}
            with observe.sending("t", "g", [props], 10) as s:
                s.sent(1, "b")
            # what the consumer gets: the properties as sent (its trace context with them)
            with observe.consuming("g", "t", "id", props) as c:
                c.result("success")
        out[mode] = (time.perf_counter_ns() - t0) / calls - loop
    return out


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=50000)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    hooks = hook_ns()
    broker = Broker()
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    try:
        for r in range(args.rounds):
            for k in range(len(MODES)):
                mode = MODES[(r + k) % len(MODES)]
                set_mode(mode)
                tag = f"r{r}m{MODES.index(mode)}"
                rates = await one_round(
                    broker.address, f"bench-{tag}", f"g-{tag}", args.messages, args.size,
                    args.window,
                )  # fmt: skip
                results[mode].append(rates)
                print(
                    f"round {r + 1} {mode:30} produce {rates[0]:9.0f}/s consume {rates[1]:9.0f}/s"
                )
    finally:
        broker.stop()
    info: Any = machine_info()
    print(f"\n{info}\n")
    print(f"{args.messages} messages of {args.size} B, window {args.window}, {args.rounds} rounds")
    print(
        "| mode | produce msg/s (median) | cost | consume msg/s (median) | cost | goal "
        "(cost at most) | hooks ns/msg |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    base_p = statistics.median(x[0] for x in results["off"])
    base_c = statistics.median(x[1] for x in results["off"])
    for mode in MODES:
        prod = statistics.median(x[0] for x in results[mode])
        cons = statistics.median(x[1] for x in results[mode])
        print(
            f"| {mode} | {prod:.0f} | {100 * (1 - prod / base_p):+.1f} % | {cons:.0f} | "
            f"{100 * (1 - cons / base_c):+.1f} % | {GOALS[mode]} | {hooks[mode]:.0f} |"
        )


if __name__ == "__main__":
    asyncio.run(main())
