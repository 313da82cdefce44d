"""Factory fixtures for the message-store tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from txmq.broker.store import GetStatus, MessageStore, PutResult, PutStatus, StoreConfig
from txmq.protocol.codec import decode_records
from txmq.protocol.message import MessageExt, Prop, new_message_id


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[Callable[..., MessageStore]]:
    """``make_store(root=None, **config)`` opens and starts a store (64 KiB segments by
    default); every store still running is shut down after the test."""
    stores: list[MessageStore] = []

    def make(root: Path | None = None, **overrides: Any) -> MessageStore:
        overrides.setdefault("segment_size", 64 * 1024)
        store = MessageStore(StoreConfig(root=root or tmp_path / "store", **overrides))
        store.start()
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.shutdown()


@pytest.fixture
def put_msg() -> Callable[..., PutResult]:
    """``put_msg(store, topic, queue_id, body, tags=, keys=, props=)``: put and check PUT_OK."""

    def put(
        store: MessageStore,
        topic: str = "T",
        queue_id: int = 0,
        body: bytes = b"body",
        *,
        tags: str | None = None,
        keys: list[str] | None = None,
        props: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> PutResult:
        properties = dict(props or {})
        properties.setdefault(Prop.UNIQ_KEY, new_message_id())
        if tags:
            properties[Prop.TAGS] = tags
        if keys:
            properties[Prop.KEYS] = " ".join(keys)
        result = store.put(
            topic=topic,
            queue_id=queue_id,
            body=body,
            properties=properties,
            born_timestamp=1_700_000_000_000,
            **kwargs,
        )
        assert result.status is PutStatus.PUT_OK, result
        return result

    return put


@pytest.fixture
def read_queue() -> Callable[..., list[MessageExt]]:
    """``read_queue(store, topic, queue_id, start=0)``: every message from ``start`` on."""

    def read(store: MessageStore, topic: str, queue_id: int, start: int = 0) -> list[MessageExt]:
        out: list[MessageExt] = []
        offset = start
        while True:
            got = store.get_messages(topic, queue_id, offset, max_count=256)
            if got.status is GetStatus.OFFSET_FOUND_NULL and got.next_begin_offset > offset:
                offset = got.next_begin_offset  # a hole (a damaged record skipped)
                continue
            if got.status is not GetStatus.FOUND:
                assert got.status in (
                    GetStatus.OFFSET_OVERFLOW_ONE,
                    GetStatus.NO_MATCHED_MESSAGE,
                    GetStatus.NO_MESSAGE_IN_QUEUE,
                ), got
                return out
            out.extend(decode_records(b"".join(got.records), verify=True))
            offset = got.next_begin_offset

    return read


@pytest.fixture
def crash_store() -> Callable[[MessageStore], None]:
    """Stop a store as a killed process would: no final checkpoint, abort marker left.

    (Nothing is lost from the page cache, as with SIGKILL.)
    """

    def crash(store: MessageStore) -> None:
        with store._lock:
            store._running = False
        for thread in store._threads:
            thread.stop()
        if store._exporter is not None:  # (a killed broker's export child would finish)
            store._exporter.stop()
        store._flusher.stop()
        store._close()

    return crash
