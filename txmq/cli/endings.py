"""How a ``txmq`` command ends when it is cut short: its reader closed the pipe
(``txmq admin topics | head -1``), or Ctrl-C. Both end it quietly, as Unix tools end, with
the exit status a shell shows for them: 141 (128 + SIGPIPE) for a closed pipe, 130
(128 + SIGINT) for Ctrl-C, after one line on stderr. A command that stops itself on SIGINT
(a broker, a name server, the outbox relay, the console) still ends as it says, with 0.

The process is not killed by the signal itself, so Python still finishes as usual
(``atexit`` handlers, logging's last lines)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

__all__ = ["INTERRUPTED", "PIPE_CLOSED", "reader_gone", "to_the_end"]

#: exit statuses: what a shell shows for a process that SIGPIPE / SIGINT ended
PIPE_CLOSED = 128 + 13
INTERRUPTED = 128 + 2


def to_the_end(command: Callable[[], int]) -> int:
    """``command()``'s exit status, or the quiet one of a closed pipe or Ctrl-C."""
    try:
        try:
            return command()
        finally:  # (--help too) what is still buffered, while a closed pipe can be told
            sys.stdout.flush()
    except KeyboardInterrupt:
        print("txmq: interrupted", file=sys.stderr)
        return INTERRUPTED
    except (BrokenPipeError, BaseExceptionGroup) as exc:
        if not reader_gone(exc):
            raise
        # the interpreter flushes stdout again as it exits: into nothing, without a word
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return PIPE_CLOSED


def reader_gone(exc: BaseException) -> bool:
    """Whether ``exc`` is a broken pipe (alone, or all of a task group's errors) and
    stdout's reader has closed it — not a connection to a server, whose broken pipe is
    an error to report."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(BrokenPipeError)[1] is None and _stdout_closed()
    return isinstance(exc, BrokenPipeError) and _stdout_closed()


def _stdout_closed() -> bool:
    """Whether nothing reads stdout any longer (a pipe whose reader exited)."""
    import select

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a test, say
        return False
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
