"""A broker in this process for your tests: a real txmq broker (its store in a folder of
yours, its services and semantics), reached through the loopback transport instead of TCP.

Your code runs against it unchanged: while it runs, clients that are given no address and no
transport (``Producer()``, ``txmq.sync.PushConsumer(group=...)``, an outbox relay, ...)
reach it, because :meth:`InProcessBroker.environment` says so (``TXMQ_TRANSPORT=loopback``,
``TXMQ_BROKER_ADDRESS``) — the pytest fixtures set it for each test.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self, TypeVar

import anyio

from txmq.broker.server import Broker, EmbeddedBroker
from txmq.broker.state.config import BrokerConfig
from txmq.protocol.codec import decode_record
from txmq.protocol.message import MessageExt
from txmq.protocol.wire.base import Request
from txmq.protocol.wire.errors import TxmqError
from txmq.transports import loopback

__all__ = ["ConsumeTimeout", "InProcessBroker"]

T = TypeVar("T")
_NUMBERS = itertools.count(1)
#: how often the waits look again
POLL_S = 0.01


class ConsumeTimeout(AssertionError):
    """A group did not consume what it was waited for in time."""


class InProcessBroker:
    """A broker served in this process (see the module's documentation).

    ``settings``: any :class:`~txmq.broker.state.config.BrokerConfig` field (``delay_levels``,
    ``transaction_timeout_s``, ``default_queue_nums``, ...).  Start it with :meth:`start`
    or ``with``; it runs on a thread and event loop of its own.  ``listen``: also on a TCP
    port of its own (``tcp_address``), for clients of other transports and processes."""

    def __init__(self, store: str | Path, *, listen: bool = False, **settings: Any) -> None:
        known = {f.name for f in dataclasses.fields(BrokerConfig)} - {"store"}
        unknown = sorted(set(settings) - known)
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"unknown broker setting {unknown[0]!r}{hint}: the settings are "
                "txmq.broker.BrokerConfig's fields"
            )
        settings.setdefault("port", 0)
        settings.setdefault("grpc_port", 0)
        settings.setdefault("metrics_port", 0)
        #: where its clients reach it (served in this process)
        self.address = f"in-process-broker:{next(_NUMBERS)}"
        self.config = BrokerConfig(store=Path(store), **settings)
        self.embedded = EmbeddedBroker(self.config, listen=listen, address=self.address)
        self.served: loopback.Served | None = None

    @property
    def broker(self) -> Broker | None:
        """The broker itself, while it runs."""
        return self.embedded.broker

    @property
    def tcp_address(self) -> str:
        """Its TCP address (``listen=True``)."""
        broker = self.broker
        if broker is None or not broker.listen:
            raise RuntimeError("this in-process broker does not listen on TCP (listen=True)")
        return f"{self.config.host}:{broker.port}"

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> Self:
        """Open the store and serve the broker (at its address, and as this process's
        default in-process broker)."""
        if self.served is not None:
            return self
        self.embedded.start(timeout)
        broker, loop = self.embedded.broker, self.embedded.loop
        assert broker is not None and loop is not None
        try:
            self.served = loopback.serve(self.address, broker.router, loop, default=True)
        except BaseException:
            self.embedded.stop()
            raise
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop serving and close the store (everything stored is flushed)."""
        if self.served is not None:
            loopback.withdraw(self.address)
            self.served = None
        self.embedded.stop(timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def environment(self) -> dict[str, str]:
        """What points clients given no address and no transport at this broker."""
        return {"TXMQ_TRANSPORT": "loopback", "TXMQ_BROKER_ADDRESS": self.address}

    # -- on the broker's loop ----------------------------------------------------------------

    def _on_loop(self, fn: Callable[[Broker], T], timeout: float = 10.0) -> T:
        broker, loop = self.embedded.broker, self.embedded.loop
        if broker is None or loop is None:
            raise RuntimeError("the in-process broker is not running: start() it first")

        async def run() -> T:
            return fn(broker)

        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout)

    # -- what a test asks ----------------------------------------------------------------------

    def messages(self, topic: str) -> list[MessageExt]:
        """Every message stored in ``topic`` (its queues in order; a delayed message once it
        is delivered, a transactional one once committed)."""

        def read(broker: Broker) -> list[MessageExt]:
            cfg = broker.topics.get(topic)
            if cfg is None:
                return []
            out: list[MessageExt] = []
            for qid in range(cfg.queue_nums):
                offset = broker.store.min_offset(topic, qid)
                end = broker.store.max_offset(topic, qid)
                while offset < end:
                    got = broker.store.get_messages(topic, qid, offset, 256)
                    if not got.records:
                        break
                    for record in got.records:
                        msg = decode_record(record)
                        msg.broker_name = broker.config.broker_name
                        out.append(msg)
                    offset = got.next_begin_offset
            return out

        return self._on_loop(read)

    def bodies(self, topic: str) -> list[bytes]:
        """The bodies of :meth:`messages`."""
        return [m.body for m in self.messages(topic)]

    def backlog(self, group: str, topic: str) -> int:
        """How many messages of ``topic`` group ``group`` has not committed yet."""

        def count(broker: Broker) -> int:
            cfg = broker.topics.get(topic)
            if cfg is None:
                return 0
            left = 0
            for qid in range(cfg.queue_nums):
                end = broker.store.max_offset(topic, qid)
                done = broker.offsets.query(group, topic, qid)
                left += end - max(done, broker.store.min_offset(topic, qid))
            return left

        return self._on_loop(count)

    def wait_consumed(self, group: str, topic: str, timeout: float = 10.0) -> None:
        """Block until ``group`` has committed every message of ``topic`` stored so far
        (from synchronous tests; :meth:`wait_consumed_async` from async ones).  Push
        consumers commit every ``$TXMQ_PERSIST_INTERVAL_S`` (the fixtures make it short)."""
        deadline = time.monotonic() + timeout
        while (left := self.backlog(group, topic)) > 0:
            if time.monotonic() > deadline:
                raise ConsumeTimeout(self._late(group, topic, left, timeout))
            time.sleep(POLL_S)

    async def wait_consumed_async(self, group: str, topic: str, timeout: float = 10.0) -> None:
        """:meth:`wait_consumed`, awaited (the test's own consumers go on meanwhile)."""
        deadline = anyio.current_time() + timeout
        # (polls: what it waits for changes on the broker's own thread)
        while (left := self.backlog(group, topic)) > 0:
            if anyio.current_time() > deadline:
                raise ConsumeTimeout(self._late(group, topic, left, timeout))
            await anyio.sleep(POLL_S)

    @staticmethod
    def _late(group: str, topic: str, left: int, timeout: float) -> str:
        return (
            f"group {group!r} left {left} message(s) of {topic!r} unconsumed after "
            f"{timeout:g} s (is a consumer of the group subscribed and started?)"
        )

    def advance(self, seconds: float) -> None:
        """Move the broker's clock of due times ``seconds`` forward: delayed messages, retries
        waiting on their delay level and timer messages due by then are delivered now."""
        self._on_loop(lambda b: b.context.clock.advance(seconds))

    def check_back_now(self) -> int:
        """Ask the producer groups about every undecided half message now, their
        immunity notwithstanding (what the check-back does every 30 s); how many were
        asked.  Answers come as the producers' check listeners run."""
        return self._on_loop(lambda b: b.transaction_checker.check_round(immune_too=True))

    def pending_transactions(self) -> int:
        """How many half messages await a commit or a rollback."""
        return self._on_loop(lambda b: len(b.transactions.pending))

    def fail_next(
        self,
        *kinds: type[Request[Any]],
        times: int = 1,
        error: TxmqError | None = None,
    ) -> None:
        """Make the next ``times`` requests of these kinds (e.g. ``txmq.protocol.wire.
        SendMessage``; any, if none is named) fail with ``error`` without reaching the
        broker, or (``error`` None) reach it and lose their answer: the client's time-out
        runs out though the broker did what was asked."""
        if self.served is None:
            raise RuntimeError("the in-process broker is not running: start() it first")
        self.served.fail_next(*kinds, times=times, error=error)
