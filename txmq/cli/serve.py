"""Running a server (broker, name server) in the foreground until SIGTERM or SIGINT: the
ready file, the "listening on" line, and a start failure said in one line."""

from __future__ import annotations

import errno
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from txmq.cli.options import CommandError
from txmq.server.serving import ListenerUnavailable, Server

__all__ = ["run_server"]


def run_server(
    server: Server,
    *,
    name: str,
    what: str,
    host: str,
    port: int,
    ready_file: str | None,
    explain: Callable[[BaseException], BaseException | None] = lambda exc: None,
) -> int:
    """Serve until a signal (``name``: the command's, ``what``: the server in prose);
    ``explain(cause)`` may turn a start failure particular to the server (its store, say)
    into a :class:`CommandError`."""
    logger = logging.getLogger(f"txmq.{name}")

    async def run() -> None:
        async with anyio.create_task_group() as tg:

            async def on_signal() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        logger.info("received %s; shutting down", signal.Signals(signum).name)
                        server.request_stop()
                        return

            async def serve(*, task_status: anyio.abc.TaskStatus[Any]) -> None:
                await server.serve(task_status=task_status)
                tg.cancel_scope.cancel()

            tg.start_soon(on_signal)
            await tg.start(serve)
            if ready_file:
                Path(ready_file).write_text(server.address)  # noqa: ASYNC240
            print(f"txmq {name} listening on {server.address}", flush=True)

    try:
        anyio.run(run)
    except BaseExceptionGroup as group:  # the task group's: say the first cause in one line
        exc: BaseException = group
        while isinstance(exc, BaseExceptionGroup):
            exc = exc.exceptions[0]
        raise _one_line(exc, what, host, port, explain) from None
    return 0


def _one_line(
    exc: BaseException,
    what: str,
    host: str,
    port: int,
    explain: Callable[[BaseException], BaseException | None],
) -> BaseException:
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return CommandError(
            f"{host}:{port} is already in use (another {what}?): stop it, or choose "
            "another --port (0 picks a free one)"
        )
    if isinstance(exc, ListenerUnavailable):
        return CommandError(str(exc))
    if isinstance(exc, OSError) and exc.errno == errno.EADDRNOTAVAIL:
        return CommandError(f"cannot listen on {host}: no such address on this machine (--host)")
    return explain(exc) or exc
