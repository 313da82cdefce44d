"""The outbox relay and idempotent consumers, measured in one run on PostgreSQL.

    python bench/outbox_bench.py [--rate 5000] [--duration 10] [--tx-rows 50] [--db URL]
                                 [--drain 50000] [--messages 20000] [--repeat 2]
                                 [--flavours async,sync] [--no-consumer] [--json PATH]

Everything runs against a real broker process (``txmq broker start``, async flush) and a
fresh PostgreSQL schema (dropped at the end):

1. **relay drain**: ``--drain`` rows are added to the outbox (64 sharding keys) while no
   relay runs; then ``txmq outbox relay`` starts in its own process; rows per second from
   its start until the backlog is 0.
2. **relay steady**: the same relay keeps running; this process adds ``--rate`` rows per
   second for ``--duration`` seconds (``--tx-rows`` rows per transaction, one sharding key
   per transaction out of 64, paced by absolute deadlines, ``outbox.add_many_async`` in an
   ``AsyncSession``; PostgreSQL NOTIFY wakes the relay), and a ``PushConsumer`` receives
   them. *Relay lag*: from the row's commit (taken here) to ``sent_at`` (written by the
   relay right after the broker acknowledged the send, PostgreSQL's clock — the same
   machine). *End to end*: from the commit to the consumer's listener.
3. **consumers**: ``--messages`` messages (unique keys) are stored in a topic; a consumer
   group whose listener writes one row per message in its own transaction (plain) and
   one whose listener is the same handler under ``@txmq.idempotent`` (the dedupe key is
   inserted in the same transaction) each consume all of them; messages per second.
   ``--repeat`` alternates the two that many times; ``--flavours`` runs it with async
   handlers (``AsyncSession``) and/or sync ones (``Session``, the consumer's threads).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sqlalchemy import (  # noqa: E402
    Column,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    insert,
    make_url,
    text,
)
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine  # noqa: E402
from sqlalchemy.orm import sessionmaker  # noqa: E402

import txmq  # noqa: E402
from bench.common import machine_info, percentile  # noqa: E402
from txmq import (  # noqa: E402
    ConsumeFrom,
    Message,
    MessageExt,
    Producer,
    PushConsumer,
    outbox,
)
from txmq.sqla import metadata as txmq_metadata  # noqa: E402

DEFAULT_DB = os.environ.get(
    "TXMQ_BENCH_DATABASE_URL",
    os.environ.get("TXMQ_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
)
KEYS = 64
_STAMP = struct.Struct(">Q")

bench_metadata = MetaData()
effects = Table(
    "bench_effects",
    bench_metadata,
    Column("id", Integer, primary_key=True),
    Column("key", String(64), nullable=False),
    Column("amount", Integer, nullable=False),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rate", type=int, default=5000, help="steady phase: rows per second")
    p.add_argument("--duration", type=float, default=10.0, help="steady phase: seconds")
    p.add_argument("--tx-rows", type=int, default=50, help="steady phase: rows per transaction")
    p.add_argument("--drain", type=int, default=50_000, help="drain phase: backlog rows")
    p.add_argument("--messages", type=int, default=20_000, help="consumer phase: messages")
    p.add_argument("--repeat", type=int, default=2, help="consumer phase: rounds")
    p.add_argument(
        "--flavours",
        default="async,sync",
        help="consumer phase: async (AsyncSession, async def) and/or sync (Session, threads)",
    )
    p.add_argument("--size", type=int, default=256, help="message body bytes")
    p.add_argument(
        "--no-consumer",
        dest="consumer",
        action="store_false",
        help="steady phase: no consumer (relay lag only, less CPU taken from the relay)",
    )
    p.add_argument(
        "--cycles-in-flight",
        type=int,
        default=2,
        help="the relay's --cycles-in-flight (default 2: its own default)",
    )
    p.add_argument("--db", default=DEFAULT_DB, help="PostgreSQL URL (a schema is made in it)")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    return p.parse_args(argv)


def spawn(*args: str, log_level: str = "WARNING") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "txmq.cli", "--log-level", log_level, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


async def first_line(proc: subprocess.Popen[str], prefix: str, timeout: float = 30) -> str:
    assert proc.stdout is not None
    stdout = proc.stdout

    def read() -> str:
        for line in stdout:
            if line.startswith(prefix):
                return line
        raise RuntimeError(f"process exited before printing {prefix!r}")

    return await asyncio.wait_for(asyncio.to_thread(read), timeout)


def body(n: int, size: int) -> bytes:
    return _STAMP.pack(n) + b"x" * max(0, size - _STAMP.size)


async def wait_backlog_zero(engine: Any, timeout: float) -> float:
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        async with engine.connect() as conn:
            s = await conn.run_sync(outbox.stats)
        if s.backlog == 0:
            return time.perf_counter()
        await asyncio.sleep(0.02)
    raise TimeoutError("the outbox did not drain")


async def drain_phase(args: argparse.Namespace, engine: Any, url: str, broker: str) -> Any:
    factory = async_sessionmaker(engine)
    topic = "bench-drain"
    chunk = 1000
    for start in range(0, args.drain, chunk):
        async with factory() as session, session.begin():
            for i in range(start, min(args.drain, start + chunk)):
                await outbox.add_async(
                    session, Message(topic, body(i, args.size)), sharding_key=f"k{i % KEYS}"
                )
    relay = spawn(
        "outbox", "relay", "--db", url, "--broker", broker, "--stats-interval", "0",
        "--cycles-in-flight", str(args.cycles_in_flight),
        log_level=os.environ.get("TXMQ_BENCH_RELAY_LOG", "WARNING"),
    )  # fmt: skip
    await first_line(relay, "txmq outbox relay:")
    began = time.perf_counter()
    ended = await wait_backlog_zero(engine, 300)
    return relay, {
        "rows": args.drain,
        "seconds": ended - began,
        "rows_per_s": args.drain / (ended - began),
    }


async def steady_phase(args: argparse.Namespace, engine: Any, broker: str) -> dict[str, Any]:
    topic = "bench-steady"
    factory = async_sessionmaker(engine)
    committed: dict[int, float] = {}  # batch -> perf_counter at commit
    committed_wall: dict[int, float] = {}  # batch -> time.time() at commit
    latencies: list[float] = []
    total_rows = int(args.rate * args.duration) // args.tx_rows * args.tx_rows
    done = asyncio.Event()

    async def on_message(msg: MessageExt) -> None:
        now = time.perf_counter()
        batch = _STAMP.unpack_from(msg.body)[0]
        if batch in committed:  # not the probe
            latencies.append((now - committed[batch]) * 1000)
        if len(latencies) >= total_rows:
            done.set()

    async with Producer(broker) as producer:  # so the consumer finds the topic at once
        await producer.send(Message(topic, body(2**63, 8)))
    consumer = PushConsumer(broker, "bench-steady", listener=on_message)
    consumer.subscribe(topic)
    async with engine.connect() as conn:
        first_id = (
            await conn.execute(text("SELECT coalesce(max(id), 0) FROM txmq_outbox"))
        ).scalar()
    samples: list[tuple[int, float]] = []

    async def sample() -> None:
        while True:
            async with engine.connect() as conn:
                s = await conn.run_sync(outbox.stats)
            samples.append((s.backlog, s.lag_seconds))
            await asyncio.sleep(0.25)

    async with contextlib.AsyncExitStack() as stack:
        if args.consumer:
            await stack.enter_async_context(consumer)
            await asyncio.sleep(1.0)  # the consumer holds its queues
        sampler = asyncio.create_task(sample())
        interval = args.tx_rows / args.rate
        began = time.perf_counter()
        behind = 0.0
        for n in range(total_rows // args.tx_rows):
            due = began + n * interval
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            else:
                behind = max(behind, -wait)
            msgs = [Message(topic, body(n, args.size)) for _ in range(args.tx_rows)]
            async with factory() as session:
                async with session.begin():
                    await outbox.add_many_async(session, msgs, sharding_key=f"k{n % KEYS}")
                committed[n] = time.perf_counter()  # before the session's close awaits
                committed_wall[n] = time.time()
        produced_in = time.perf_counter() - began
        if args.consumer:
            await asyncio.wait_for(done.wait(), 60)
        else:
            await wait_backlog_zero(engine, 60)
        delivered_in = time.perf_counter() - began
        sampler.cancel()
    async with engine.connect() as conn:
        sent = (
            await conn.execute(
                text(
                    "SELECT substring(body from 1 for 8), extract(epoch FROM sent_at) "
                    "FROM txmq_outbox WHERE id > :first AND topic = :topic"
                ),
                {"first": first_id, "topic": topic},
            )
        ).all()
    relay_lag = [(float(at) - committed_wall[_STAMP.unpack(b)[0]]) * 1000 for b, at in sent]
    out = {
        "rows": total_rows,
        "tx_rows": args.tx_rows,
        "rate_asked": args.rate,
        "rate_added": total_rows / produced_in,
        "rate_sent": total_rows / delivered_in,
        "producer_behind_max_ms": behind * 1000,
        "relay_lag_ms": _pcts(relay_lag),
        "backlog_max": max((b for b, _ in samples), default=0),
        "lag_seconds_sampled_max": max((lag for _, lag in samples), default=0.0),
    }
    if args.consumer:
        out["end_to_end_ms"] = _pcts(latencies)
    return out


def _pcts(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values)}


async def consumer_phase(
    args: argparse.Namespace, engine: Any, url: str, broker: str, topic: str, flavour: str
) -> dict[str, Any]:
    n = args.messages
    handlers = _async_handlers(engine) if flavour == "async" else _sync_handlers(url)
    plain, deduped, dispose = handlers

    async def run(name: str, handler: Any, round_no: int) -> float:
        count = 0
        done = asyncio.Event()
        loop = asyncio.get_running_loop()

        def one_more() -> None:
            nonlocal count
            count += 1
            if count >= n:
                done.set()

        if flavour == "async":

            async def listener(msg: MessageExt) -> Any:
                result = await handler(msg)
                one_more()
                return result
        else:

            def listener(msg: MessageExt) -> Any:  # in a worker thread
                result = handler(msg)
                loop.call_soon_threadsafe(one_more)
                return result

        group = f"bench-{flavour}-{name}-{round_no}"
        consumer = PushConsumer(
            broker, group, listener=listener, consume_from=ConsumeFrom.FIRST_OFFSET
        )
        consumer.subscribe(topic)
        began = time.perf_counter()
        async with consumer:
            await asyncio.wait_for(done.wait(), 300)
            elapsed = time.perf_counter() - began
        return n / elapsed

    rounds: dict[str, list[float]] = {"plain": [], "idempotent": []}
    try:
        for r in range(args.repeat):
            rounds["plain"].append(await run("plain", plain, r))
            async with engine.begin() as conn:
                await conn.execute(text("TRUNCATE txmq_consumed_keys"))
            rounds["idempotent"].append(await run("idempotent", deduped, r))
    finally:
        dispose()
    async with engine.connect() as conn:
        keys = (await conn.execute(text("SELECT count(*) FROM txmq_consumed_keys"))).scalar()
    mean = {k: sum(v) / len(v) for k, v in rounds.items()}
    return {
        "flavour": flavour,
        "messages": n,
        "rounds": rounds,
        "mean": mean,
        "dedupe_cost": 1 - mean["idempotent"] / mean["plain"],
        "keys_recorded_last_round": keys,
    }


def _async_handlers(engine: Any) -> tuple[Any, Any, Any]:
    factory = async_sessionmaker(engine)

    async def plain(msg: MessageExt) -> None:
        async with factory() as session, session.begin():
            await session.execute(insert(effects).values(key=msg.keys[0], amount=1))

    @txmq.idempotent(factory, group="bench-async")
    async def deduped(msg: MessageExt, session: Any) -> None:
        await session.execute(insert(effects).values(key=msg.keys[0], amount=1))

    return plain, deduped, lambda: None


def _sync_handlers(url: str) -> tuple[Any, Any, Any]:
    sync_engine = create_engine(url, pool_size=24, max_overflow=8)
    factory = sessionmaker(sync_engine)

    def plain(msg: MessageExt) -> None:
        with factory() as session, session.begin():
            session.execute(insert(effects).values(key=msg.keys[0], amount=1))

    @txmq.idempotent(factory, group="bench-sync")
    def deduped(msg: MessageExt, session: Any) -> None:
        session.execute(insert(effects).values(key=msg.keys[0], amount=1))

    return plain, deduped, sync_engine.dispose


async def fill_topic(args: argparse.Namespace, broker: str, topic: str) -> None:
    async with Producer(broker) as producer:
        for start in range(0, args.messages, 256):
            batch = [
                Message(topic, body(i, args.size), keys=[f"m-{i}"])
                for i in range(start, min(args.messages, start + 256))
            ]
            await producer.send_batch(batch)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    admin = create_async_engine(args.db, isolation_level="AUTOCOMMIT")
    schema = f"txmq_obench_{uuid.uuid4().hex[:10]}"
    async with admin.connect() as conn:
        await conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        version = (await conn.execute(text("SHOW server_version"))).scalar()
    url_obj = make_url(args.db).update_query_dict({"options": f"-csearch_path={schema}"})
    url = url_obj.render_as_string(hide_password=False)
    engine = create_async_engine(url, pool_size=24, max_overflow=8)
    tmp = tempfile.mkdtemp(prefix="txmq-obench-")
    procs: list[subprocess.Popen[str]] = []
    try:
        async with engine.begin() as conn:
            await conn.run_sync(txmq_metadata.create_all)
            await conn.run_sync(bench_metadata.create_all)
        broker_proc = spawn("broker", "start", "--store", f"{tmp}/store", "--port", "0")
        procs.append(broker_proc)
        line = await first_line(broker_proc, "txmq broker listening on ")
        broker = line.rsplit(" ", 1)[1].strip()
        print(f"PostgreSQL {version}, schema {schema}; broker {broker} (async flush)", flush=True)
        relay, drain = await drain_phase(args, engine, url, broker)
        procs.append(relay)
        print(f"drain: {drain['rows_per_s']:,.0f} rows/s", flush=True)
        steady = await steady_phase(args, engine, broker)
        print(f"steady: relay lag p99 {steady['relay_lag_ms']['p99']:.1f} ms", flush=True)
        consumers = []
        if args.repeat > 0:  # --repeat 0: the relay alone
            await fill_topic(args, broker, "bench-consume")
            for flavour in args.flavours.split(","):
                consumers.append(
                    await consumer_phase(args, engine, url, broker, "bench-consume", flavour)
                )
        return {"machine": machine_info(), "postgresql": version, "drain": drain,
                "steady": steady, "consumers": consumers}  # fmt: skip
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            if proc.stdout is not None:
                proc.stdout.close()
        await engine.dispose()
        async with admin.connect() as conn:
            await conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        await admin.dispose()
        shutil.rmtree(tmp, ignore_errors=True)


#: the relay's lag p99 at 5,000 rows/s, and what dedupe may cost a consumer (issue 33)
LAG_GOAL_MS = 10.0
DEDUPE_GOAL = 0.10


def report(args: argparse.Namespace, r: dict[str, Any]) -> str:
    d, s, cs = r["drain"], r["steady"], r["consumers"]

    def pcts(x: dict[str, float]) -> str:
        return f"p50 {x['p50']:.1f}  p99 {x['p99']:.1f}  max {x['max']:.1f}"

    lines = [
        "",
        "Outbox relay (one `txmq outbox relay` process, LISTEN/NOTIFY)",
        f"  drain {d['rows']:,} rows backlog: {d['rows_per_s']:,.0f} rows/s",
        f"  steady {args.rate:,} rows/s for {args.duration:g} s ({args.tx_rows} rows per "
        f"transaction): added {s['rate_added']:,.0f}/s, sent {s['rate_sent']:,.0f}/s",
        f"    relay lag, commit -> sent (ms):   {pcts(s['relay_lag_ms'])}   "
        f"(goal: p99 at most {LAG_GOAL_MS:g} ms)",
    ]
    if "end_to_end_ms" in s:
        lines.append(f"    commit -> consumer (ms):          {pcts(s['end_to_end_ms'])}")
    lines += [
        f"    backlog (sampled) max {s['backlog_max']}, lag_seconds() max "
        f"{s['lag_seconds_sampled_max']:.3f}",
    ]
    for c in cs:
        lines += [
            "",
            f"Consumers ({c['flavour']}): {c['messages']:,} messages, 1 INSERT per message, "
            "20 workers",
        ]
        for name in ("plain", "idempotent"):
            runs = ", ".join(f"{v:,.0f}" for v in c["rounds"][name])
            lines.append(f"  {name:<11} {c['mean'][name]:>8,.0f} msg/s  (rounds: {runs})")
        lines.append(
            f"  dedupe costs {c['dedupe_cost'] * 100:.1f}% of throughput "
            f"(goal: at most {DEDUPE_GOAL:.0%})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    arguments = parse_args()
    result = asyncio.run(main(arguments))
    print(report(arguments, result))
    if arguments.json:
        Path(arguments.json).write_text(json.dumps(result, indent=2, default=str))
