"""Connections that speak the txmq protocol, for clients and the broker alike.

A :class:`Connection` multiplexes requests in both directions over one TCP stream: outgoing
requests wait for the response with the same request id, incoming requests go to a handler
(a :class:`txmq.protocol.rpc.Router`, which decodes them into typed requests).  Writes are coalesced
by a writer task so that pipelined requests cost few system calls.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import time
import traceback
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import anyio
import anyio.abc
import anyio.lowlevel

from txmq.protocol.flow import FRAME_ALLOWANCE, ConnectionLimits, FrameBudget, stop_eager_reading
from txmq.protocol.wire.base import ErrorAnswer, R, Request, Response, WithBody, decode, encode
from txmq.protocol.wire.errors import (
    BadRequest,
    BrokerUnavailable,
    RequestTimeout,
    ResponseCode,
    TxmqError,
    clip,
    error_for_code,
)
from txmq.protocol.wire.frame import (
    DEFAULT_MAX_FRAME_SIZE,
    NOTICE_SIGN_AGAIN,
    SIGNED,
    Frame,
    FrameDecoder,
    FrameKind,
    encode_frame,
)

__all__ = [
    "Connection",
    "ConnectionLimits",
    "FrameBudget",
    "FrameSigner",
    "Handler",
    "HandlerResult",
    "Reply",
]

log = logging.getLogger("txmq.remoting")

#: what reading or writing a connection whose peer is gone raises
_GONE = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)

#: a successful answer: its header, or its header and a body
Reply = Response | WithBody[Any]
HandlerResult = Reply | None | Awaitable[Reply | None] | asyncio.Future[Reply | None]
Handler = Callable[["Connection", Frame], HandlerResult]


class FrameSigner(Protocol):
    """Signs a connection's request frames (:class:`txmq.security.signing.Signer`), or
    stops and resumes signing them as the server's notices on its answers say."""

    def frame(
        self,
        kind: FrameKind,
        code: int,
        request_id: int,
        header: bytes,
        body: bytes | memoryview,
        version: int,
    ) -> bytes: ...

    def notice(self, notice: bytes) -> None:
        """An answer's notice (its trailer) about the connection's authentication."""
        ...


_SIGN_AGAIN = bytes([NOTICE_SIGN_AGAIN])
#: how many requests of one read a server handles before it lets other tasks run
YIELD_EVERY = 32


def _expire(fut: asyncio.Future[Frame | None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Connection:
    """One protocol connection. Run :meth:`run` in a task group; it returns when closed."""

    def __init__(
        self,
        stream: anyio.abc.ByteStream,
        handler: Handler | None = None,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        name: str = "",
        limits: ConnectionLimits | None = None,
        budget: FrameBudget | None = None,
        signer: FrameSigner | None = None,
    ) -> None:
        self.stream = stream
        self.handler = handler
        self.name = name
        self.max_frame_size = max_frame_size
        self.closed = False
        self.attributes: dict[str, Any] = {}
        #: signs this connection's requests (None: they go unsigned)
        self.signer = signer
        self._decoder = FrameDecoder(max_frame_size)
        self._ids = itertools.count(1)
        # the request path is the hot path: plain asyncio futures and tasks, no per-request
        # cancel scopes (anyio's structure still owns the connection's reader and writer)
        self._pending: dict[int, asyncio.Future[Frame | None]] = {}
        self._replies: set[asyncio.Task[None]] = set()
        self._out: list[bytes] = []
        self._out_event = asyncio.Event()
        self._tg: anyio.abc.TaskGroup | None = None
        self._close_after_flush = False
        self.on_close: list[Callable[[Connection], None]] = []
        # limits (servers): bytes queued to write, requests not answered, activity times
        self.limits = limits
        self._out_bytes = 0
        self._inflight = 0
        self._room = asyncio.Event()
        self._room.set()
        self._last_active = time.monotonic()
        self._partial_since = 0.0
        self._writing_since = 0.0
        self._paused = False
        self._budget = budget
        self._reserved = 0
        #: why the connection was closed by its limits (None: it was not)
        self.closed_for: str | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def run(self) -> None:
        if self.limits is not None:
            stop_eager_reading(self.stream)
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._writer)
                if self.limits is not None:
                    tg.start_soon(self._watchdog, self.limits)
                await self._reader()
                if self._close_after_flush:
                    # the writer cancels the group once the queued answers are written
                    with anyio.move_on_after(5):
                        await anyio.sleep_forever()
                tg.cancel_scope.cancel()
        except Exception:
            # a connection's failure ends that connection, never its owner's task group (a
            # client's: every request would fail; a server's: it would stop serving)
            log.exception("connection %s failed; closing it", self.name)
        finally:
            self.mark_closed()
            # what it held goes now, not when the garbage collector finds the connection
            self._decoder.clear()
            self._out.clear()
            if self._reserved and self._budget is not None:
                self._budget.release(self._reserved)
                self._reserved = 0
            for task in list(self._replies):
                task.cancel()
            with anyio.CancelScope(shield=True):
                await self.stream.aclose()

    def mark_closed(self) -> None:
        if self.closed:
            return
        self.closed = True
        err = BrokerUnavailable(f"connection {self.name} closed")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        for callback in self.on_close:
            try:
                callback(self)
            except Exception:  # pragma: no cover - a callback's bug must not break closing
                log.exception("on_close callback failed")

    def close(self) -> None:
        """Close after what is queued has been written."""
        self._close_after_flush = True
        self._out_event.set()

    # -- io loops -------------------------------------------------------------------------

    async def _reader(self) -> None:
        limits = self.limits
        while True:
            try:
                data = await self.stream.receive(256 * 1024)
            except _GONE as exc:
                log.debug("connection %s read: %r", self.name, exc)
                return
            try:
                frames = self._decoder.feed(data)
            except TxmqError as exc:
                log.warning("connection %s: %s; closing it", self.name, clip(str(exc)))
                request_id = getattr(exc, "request_id", 0)
                self._enqueue(_error_frame(request_id, exc.code, str(exc)))
                self.close()
                return
            if limits is None:
                for frame in frames:
                    self._received(frame)
            else:
                await self._limited(limits, frames)
            if self._close_after_flush:
                return

    async def _limited(self, limits: ConnectionLimits, frames: list[Frame]) -> None:
        """Take what was read under the limits: dispatch while the peer's unread answers
        and unanswered requests fit, reserve memory for a big frame before reading on."""
        now = self._last_active = time.monotonic()
        buffered = self._decoder.buffered
        if frames or not buffered:
            self._partial_since = now if buffered else 0.0
            if self._reserved and self._budget is not None:  # its frame is complete
                self._budget.release(self._reserved)
                self._reserved = 0
        elif not self._partial_since:
            self._partial_since = now
        queue = deque(frames)
        taken = 0
        while queue:
            if self._out_bytes > limits.write_buffer or self._inflight >= limits.max_inflight:
                # a peer that does not read its answers (or floods requests) is not read
                # either, until what it is owed drains to half the limit
                self._room.clear()
                await self._paused_until(self._room.wait())
            self._received(queue.popleft())
            taken += 1
            if taken % YIELD_EVERY == 0 and queue:
                # let others run between slices of a big read: the first answers (and a
                # SYNC_MASTER's transfer to its slaves) leave while the rest is handled
                await anyio.lowlevel.checkpoint()
        if self._budget is not None and not self._reserved and buffered > FRAME_ALLOWANCE:
            size = self._decoder.next_frame_size or 0
            await self._paused_until(self._budget.acquire(size))
            self._reserved = size

    async def _paused_until(self, event: Awaitable[Any]) -> None:
        self._paused = True
        try:
            await event
        finally:
            self._paused = False
        if self._partial_since:  # a frame's time runs from when it is read again
            self._partial_since = time.monotonic()

    def _received(self, frame: Frame) -> None:
        if frame.kind == FrameKind.RESPONSE:
            if frame.auth and self.signer is not None:
                self.signer.notice(frame.auth)
            fut = self._pending.pop(frame.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(frame)
        else:
            self._dispatch(frame)

    def _check_room(self) -> None:
        limits = self.limits
        if (
            limits is not None
            and not self._room.is_set()
            and self._out_bytes <= limits.write_buffer // 2
            and self._inflight <= limits.max_inflight // 2
        ):
            self._room.set()

    async def _watchdog(self, limits: ConnectionLimits) -> None:
        """Close the connection when a limit's time is up."""
        while True:
            await anyio.sleep(limits.check_interval)
            now = time.monotonic()
            reason = None
            if limits.frame_timeout and self._partial_since and not self._paused:
                if now - self._partial_since > limits.frame_timeout:
                    reason = (
                        f"a frame ({self._decoder.buffered} bytes so far) was not completed "
                        f"within {limits.frame_timeout:g} s"
                    )
            if reason is None and limits.idle_timeout:
                if self._writing_since and now - self._writing_since > limits.idle_timeout:
                    reason = (
                        f"it has not read its answers for {limits.idle_timeout:g} s "
                        f"({self._out_bytes} bytes waiting)"
                    )
                elif (
                    not self._inflight
                    and not self._out_bytes
                    and now - self._last_active > limits.idle_timeout
                ):
                    reason = f"idle for {limits.idle_timeout:g} s"
            if reason is not None:
                self.closed_for = reason
                log.info("closing connection %s: %s", self.name, reason)
                self.mark_closed()
                if self._tg is not None:
                    self._tg.cancel_scope.cancel()
                return

    async def _writer(self) -> None:
        while True:
            await self._out_event.wait()
            self._out_event.clear()
            if self._out:
                data = b"".join(self._out)
                self._out.clear()
                self._writing_since = time.monotonic()
                try:
                    await self.stream.send(data)
                except _GONE:  # (over TLS a peer gone may be EndOfStream, from a send too)
                    self.mark_closed()
                    if self._tg is not None:
                        self._tg.cancel_scope.cancel()
                    return
                self._last_active = time.monotonic()
                self._writing_since = 0.0
                self._out_bytes -= len(data)
                self._check_room()
            if self._close_after_flush and not self._out:
                if self._tg is not None:
                    self._tg.cancel_scope.cancel()
                return

    def _enqueue(self, data: bytes) -> None:
        if self.closed:
            raise BrokerUnavailable(f"connection {self.name} is closed")
        self._out.append(data)
        self._out_bytes += len(data)
        self._out_event.set()

    # -- incoming requests ----------------------------------------------------------------

    def _dispatch(self, frame: Frame) -> None:
        self._inflight += 1
        if self.handler is None:
            self._fail(frame, ResponseCode.REQUEST_CODE_NOT_SUPPORTED, "no handler")
            return
        try:
            result = self.handler(self, frame)
        except Exception as exc:
            self._failed(frame, exc)
            return
        if isinstance(result, asyncio.Future):
            result.add_done_callback(lambda f: self._reply_future(frame, f))
        elif inspect.isawaitable(result):
            task = asyncio.get_running_loop().create_task(self._await_reply(frame, result))
            self._replies.add(task)
            task.add_done_callback(self._replies.discard)
        else:
            self._reply(frame, result)

    async def _await_reply(self, frame: Frame, result: Awaitable[Reply | None]) -> None:
        try:
            reply = await result
        except Exception as exc:
            self._failed(frame, exc)
            return
        self._reply(frame, reply)

    def _reply_future(self, frame: Frame, fut: asyncio.Future[Reply | None]) -> None:
        if fut.cancelled():
            self._answered()
            return
        exc = fut.exception()
        if exc is None:
            self._reply(frame, fut.result())
        else:
            self._failed(frame, exc)

    def _answered(self) -> None:
        self._inflight -= 1
        self._check_room()

    def _reply(self, frame: Frame, reply: Reply | None) -> None:
        self._answered()
        if frame.kind == FrameKind.ONEWAY or reply is None or self.closed:
            return
        if isinstance(reply, WithBody):
            header, body = reply
        else:
            header, body = reply, b""
        self._enqueue(
            encode_frame(
                FrameKind.RESPONSE,
                ResponseCode.SUCCESS,
                frame.request_id,
                header,
                body,
                frame.version,
                frame.notice,
            )
        )

    def _failed(self, frame: Frame, exc: BaseException) -> None:
        """Answer a request whose handler raised: a txmq error with its code, anything
        else as SYSTEM_ERROR, logged with its stack (the message clipped: it may quote
        the request)."""
        if isinstance(exc, TxmqError):
            self._fail(frame, exc.code, str(exc))
            return
        text = clip(f"{type(exc).__name__}: {exc}")
        stack = "".join(traceback.format_tb(exc.__traceback__))
        log.error("handling request code %s failed: %s\n%s", frame.code, text, stack)
        self._fail(frame, ResponseCode.SYSTEM_ERROR, text)

    def _fail(self, frame: Frame, code: int, message: str) -> None:
        self._answered()
        if frame.kind == FrameKind.ONEWAY or self.closed:
            return
        self._enqueue(
            _error_frame(frame.request_id, code, clip(message), frame.version, frame.notice)
        )

    # -- outgoing requests ----------------------------------------------------------------

    async def call(
        self, request: Request[R], body: bytes = b"", *, timeout: float = 3.0
    ) -> WithBody[R]:
        """Send a typed request; its typed answer and the answer's body (errors raise)."""
        frame = await self.request(
            request.CODE, encode(request), body, timeout=timeout, version=request.VERSION
        )
        header: R = decode(request.RESPONSE, frame.header)  # type: ignore[assignment]
        return WithBody(header, frame.body)

    def send_oneway(self, request: Request[Any], body: bytes = b"") -> None:
        """Send a typed request that gets no answer."""
        self.oneway(request.CODE, encode(request), body, version=request.VERSION)

    async def request(
        self,
        code: int,
        header: bytes = b"",
        body: bytes = b"",
        *,
        timeout: float = 3.0,
        check: bool = True,
        version: int = 1,
    ) -> Frame:
        """Send a request (its header as msgpack) and wait for its answer; error answers
        raise (unless ``check``).  A request sent unsigned on a connection the server no
        longer holds authenticated (its answer says sign again) is sent again, signed."""
        again = False
        while True:
            request_id = next(self._ids) & 0xFFFFFFFF
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[Frame | None] = loop.create_future()
            self._pending[request_id] = fut
            expiry = loop.call_later(timeout, _expire, fut) if timeout > 0 else None
            try:
                data = self._frame(FrameKind.REQUEST, code, request_id, header, body, version)
                self._enqueue(data)
                frame = await fut
            finally:
                self._pending.pop(request_id, None)
                if expiry is not None:
                    expiry.cancel()
            if frame is None:
                raise RequestTimeout(
                    f"no answer to request {code} within {timeout:.1f}s from {self.name}"
                )
            if again or not frame.auth or frame.auth[:1] != _SIGN_AGAIN or data[5] & SIGNED:
                break
            again = True
        if check and frame.code != ResponseCode.SUCCESS:
            raise error_for_code(frame.code, error_message(frame))
        return frame

    def oneway(self, code: int, header: bytes = b"", body: bytes = b"", version: int = 1) -> None:
        request_id = next(self._ids) & 0xFFFFFFFF
        self._enqueue(self._frame(FrameKind.ONEWAY, code, request_id, header, body, version))

    def _frame(
        self, kind: FrameKind, code: int, request_id: int, header: bytes, body: bytes, version: int
    ) -> bytes:
        # signed here, as it is queued: the requests' numbers go out in order
        if self.signer is None:
            return encode_frame(kind, code, request_id, header, body, version)
        return self.signer.frame(kind, code, request_id, header, body, version)


def error_message(frame: Frame) -> str:
    """The readable message of an error answer."""
    try:
        return decode(ErrorAnswer, frame.header).error
    except BadRequest:
        return f"(unreadable error header {frame.header[:64]!r})"


def _error_frame(
    request_id: int, code: int, message: str, version: int = 1, notice: bytes = b""
) -> bytes:
    return encode_frame(
        FrameKind.RESPONSE, code, request_id, ErrorAnswer(error=message), b"", version, notice
    )
