"""Run the txmq benchmark side by side with RabbitMQ and NATS JetStream.

    python bench/run.py [--messages 50000] [--size 1024] [--window 256] [--rate 1000]
                        [--duration 10] [--systems txmq-async,txmq-sync,rabbitmq,nats]
                        [--json out.json]

Each system runs in turn: setup, produce, consume, latency, teardown.  A system that
cannot be imported or fails a phase is reported and skipped; the others still run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    PACE_LOG,
    Result,
    System,
    dump_json,
    expected_messages,
    format_table,
    machine_info,
    payload,
)

ALL_SYSTEMS = ("txmq-async", "txmq-sync", "rabbitmq", "nats")
TXMQ_KEYS = ("txmq-async", "txmq-sync")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--messages", type=int, default=50_000, help="messages per throughput phase")
    p.add_argument("--size", type=int, default=1024, help="message body size in bytes")
    p.add_argument("--window", type=int, default=256, help="max unacknowledged publishes")
    p.add_argument("--rate", type=int, default=1000, help="latency phase: messages per second")
    p.add_argument("--duration", type=float, default=10.0, help="latency phase: seconds")
    p.add_argument(
        "--systems",
        default=",".join(ALL_SYSTEMS),
        help=f"comma-separated subset of {','.join(ALL_SYSTEMS)}",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--phase-timeout",
        type=float,
        default=120.0,
        help="seconds before a setup/produce/consume phase is abandoned "
        "(latency gets duration + this)",
    )
    p.add_argument(
        "--pause",
        type=float,
        default=2.0,
        help="seconds to idle between systems (let the disk settle)",
    )
    p.add_argument("--rabbitmq-url", default="amqp://guest:guest@127.0.0.1:5672/")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    args = p.parse_args(argv)
    keys = [k.strip() for k in args.systems.split(",") if k.strip()]
    unknown = [k for k in keys if k not in ALL_SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {','.join(unknown)}; choose from {','.join(ALL_SYSTEMS)}")
    if args.size < 8:
        p.error("--size must be at least 8 (the latency phase stores an 8-byte send time)")
    if min(args.messages, args.window, args.rate) < 1 or args.duration <= 0:
        p.error("--messages, --window, --rate and --duration must be positive")
    args.system_keys = keys
    return args


def _skip(key: str, why: str) -> tuple[str, System | None, str]:
    print(f"[{key}] SKIPPED: {why}", flush=True)
    return (key, None, why)


def build_systems(args: argparse.Namespace) -> list[tuple[str, System | None, str]]:
    """(key, system or None, reason skipped) in the order of --systems."""
    wanted: list[str] = args.system_keys
    built: dict[str, tuple[str, System | None, str]] = {}

    txmq_wanted = [k for k in wanted if k in TXMQ_KEYS]
    if txmq_wanted:
        try:
            from bench.sys_txmq import make_systems  # lazy: written separately

            made = list(make_systems(args))
        except Exception as exc:
            why = f"cannot load bench.sys_txmq ({type(exc).__name__}: {exc})"
            for k in txmq_wanted:
                built[k] = _skip(k, why)
        else:
            for pos, system in enumerate(made):
                key = getattr(system, "key", None) or (
                    TXMQ_KEYS[pos] if pos < len(TXMQ_KEYS) else f"txmq-{pos}"
                )
                if key not in txmq_wanted:
                    continue
                if isinstance(system, System):
                    built[key] = (key, system, "")
                else:
                    built[key] = _skip(key, f"{system!r} does not implement bench.common.System")
            for k in txmq_wanted:
                if k not in built:
                    built[k] = _skip(k, "bench.sys_txmq.make_systems() did not return it")

    if "rabbitmq" in wanted:
        try:
            from bench.peer_rabbitmq import RabbitMQSystem

            rabbit = RabbitMQSystem(args.rabbitmq_url, window=args.window)
            built["rabbitmq"] = ("rabbitmq", rabbit, "")
        except Exception as exc:
            built["rabbitmq"] = _skip("rabbitmq", f"{type(exc).__name__}: {exc}")

    if "nats" in wanted:
        try:
            from bench.peer_nats import NatsSystem

            built["nats"] = ("nats", NatsSystem(args.nats_url, window=args.window), "")
        except Exception as exc:
            built["nats"] = _skip("nats", f"{type(exc).__name__}: {exc}")

    return [built[k] for k in wanted]


async def run_one(key: str, system: System, args: argparse.Namespace) -> Result:
    res = Result(
        key=key,
        name=system.name,
        durability=system.durability,
        messages=args.messages,
        size=args.size,
        window=args.window,
        rate=args.rate,
        duration=args.duration,
    )
    pt = args.phase_timeout
    body = payload(args.size)
    phase = "setup"
    tag = f"[{key}]"
    try:
        print(f"{tag} setup", flush=True)
        await asyncio.wait_for(system.setup(), pt)
        res.version = str(getattr(system, "version", "") or "")
        if res.version:
            print(f"{tag} {res.version}", flush=True)

        phase = "produce"
        res.produce_s = await asyncio.wait_for(system.produce(args.messages, body, args.window), pt)
        print(
            f"{tag} produce: {args.messages} x {args.size} B, window {args.window}: "
            f"{res.produce_s:.2f} s = {res.produce_msgs:,.0f} msg/s, "
            f"{res.produce_mib:.1f} MiB/s",
            flush=True,
        )

        phase = "consume"
        res.consume_s = await asyncio.wait_for(system.consume(args.messages), pt)
        print(
            f"{tag} consume: {args.messages} msgs: {res.consume_s:.2f} s = "
            f"{res.consume_msgs:,.0f} msg/s",
            flush=True,
        )

        phase = "latency"
        PACE_LOG.clear()
        lat = await asyncio.wait_for(
            system.latency(args.rate, args.duration, args.size), args.duration + pt
        )
        res.set_latencies(lat)
        if PACE_LOG:
            pace = PACE_LOG[-1]
            res.latency_send_rate = pace.achieved_rate
            res.latency_max_lag_ms = pace.max_lag_ms
        want = expected_messages(args.rate, args.duration)
        if len(lat) != want:
            res.errors.append(f"latency: {len(lat)} latencies returned, {want} sent")
        m = res.latency_ms
        extra = ""
        if res.latency_send_rate is not None:
            extra = (
                f"; send rate achieved {res.latency_send_rate:,.0f}/s, "
                f"max schedule lag {res.latency_max_lag_ms:.1f} ms"
            )
        print(
            f"{tag} latency @ {args.rate}/s for {args.duration:g} s: n={len(lat)} "
            f"p50 {m.get('p50', float('nan')):.2f} ms, p99 {m.get('p99', float('nan')):.2f} ms, "
            f"max {m.get('max', float('nan')):.2f} ms{extra}",
            flush=True,
        )
    except Exception as exc:
        if isinstance(exc, TimeoutError) and not str(exc):
            msg = f"{phase}: timed out after {pt:g} s"
        else:
            msg = f"{phase}: {type(exc).__name__}: {exc}"
        res.errors.append(msg)
        print(f"{tag} FAILED in {msg}", flush=True)
        traceback.print_exc(limit=4)
    finally:
        try:
            await asyncio.wait_for(system.teardown(), 30)
        except Exception as exc:
            res.errors.append(f"teardown: {type(exc).__name__}: {exc}")
            print(f"{tag} teardown failed: {exc}", flush=True)
    return res


def print_report(
    args: argparse.Namespace, results: list[Result], skipped: list[tuple[str, str]], wall: float
) -> None:
    mi = machine_info()
    print()
    print("=" * 100)
    print(f"machine: nproc={mi['nproc']}  cpu={mi['cpu']}  {mi['platform']}")
    print(f"python: {mi['implementation']} {mi['python']} (clients and brokers share this machine)")
    print(f"run at {mi['time_utc']}, wall time {wall:.0f} s")
    print()
    print(format_table(results))
    print()
    print("where the numbers come from:")
    print(
        f"  produce: {args.messages} messages of {args.size} B from one asyncio client, at most "
        f"{args.window} unacknowledged;"
    )
    print("           time from the first send to the last broker ack; MiB/s counts bodies only.")
    print(
        f"  consume: the same {args.messages} stored messages received and acknowledged by a "
        "fresh consumer (rabbitmq, nats: ack per message);"
    )
    print(
        "           time from subscribing until the last ack (or offset commit) has reached "
        "the broker."
    )
    print(
        f"  latency: {args.rate} msg/s for {args.duration:g} s "
        f"({expected_messages(args.rate, args.duration)} msgs, {args.size} B), "
        "producer paced by absolute deadlines,"
    )
    print(
        "           consumer running concurrently in the same process; latency = receive time "
        "- send time"
    )
    print(
        "           (time.perf_counter_ns written into the body just before publish), "
        "percentiles by linear interpolation."
    )
    for r in results:
        bits = [r.version] if r.version else []
        if r.latency_send_rate is not None:
            bits.append(
                f"latency send rate {r.latency_send_rate:,.0f}/s, "
                f"max schedule lag {r.latency_max_lag_ms:.1f} ms"
            )
        if r.latency_ms:
            bits.append(f"p90 {r.latency_ms['p90']:.2f} / p99.9 {r.latency_ms['p999']:.2f} ms")
        print(f"  {r.name}: {'; '.join(bits)}" if bits else f"  {r.name}:")
        print(f"      durability: {r.durability}")
        for e in r.errors:
            print(f"      ERROR {e}")
    for key, why in skipped:
        print(f"  {key}: skipped: {why}")


async def amain(args: argparse.Namespace) -> list[Result]:
    t0 = time.perf_counter()
    results: list[Result] = []
    skipped: list[tuple[str, str]] = []
    for i, (key, system, why) in enumerate(build_systems(args)):
        if system is None:
            skipped.append((key, why))
            continue
        if i and args.pause > 0:
            gc.collect()
            await asyncio.sleep(args.pause)
        results.append(await run_one(key, system, args))
    print_report(args, results, skipped, time.perf_counter() - t0)
    if args.json:
        params: dict[str, Any] = {k: v for k, v in vars(args).items() if k != "system_keys"}
        params["skipped"] = dict(skipped)
        dump_json(args.json, results, params)
        print(f"\nresults written to {args.json}")
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = asyncio.run(amain(args))
    return 1 if not results or any(r.errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
