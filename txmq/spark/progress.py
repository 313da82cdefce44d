"""What the job shows on standard error while it works: a line per phase with its duration.

On a terminal a phase also has a live line, redrawn in place, with a bar where there is
something to count (the tables written, the tables read, else the tasks of the Spark stages
running) and the time so far; when the phase ends, its line is replaced by the phase's
record.  Anywhere else (a pipe, a file, a CI log) only the records are written, one line
each, without carriage returns::

    txmq reconcile: starting Spark (local[*]) ................. 4.2 s
    txmq reconcile: reading the store (3 segments) ............ 1.34 s

Durations are :func:`txmq.observability.fmt.span` text (``850 ms`` is ``0.85 s``; ``2 min
5 s`` is ``2.08 min``), as everywhere in the command line.  Lines of someone else's (the
JVM's standard error, see :mod:`txmq.spark.launch`) go through :func:`echo`, which writes
them above the live line rather than through it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TextIO

from txmq.observability.fmt import span

__all__ = ["Phase", "Progress", "echo", "record", "seconds", "spark_tasks"]

#: how often a live line is redrawn (seconds)
TICK = 0.2
#: where a record's duration starts (dot leaders fill the gap)
WIDTH = 64
BAR = 20

#: one lock for everything written to standard error by this module and :func:`echo`
_lock = threading.RLock()
#: the Progress whose live line is on the terminal now, if any
_showing: Progress | None = None

#: (tasks done, tasks) of the Spark stages running now, None when none runs
TaskCount = Callable[[], tuple[int, int] | None]


def seconds(s: float) -> str:
    """A duration as the command line writes spans: ``0.05 s``, ``4.2 s``, ``2.08 min``."""
    return span(timedelta(seconds=s))


def record(name: str, doing: str, took: float, *, failed: bool = False) -> str:
    """A phase's line: ``name: doing .... 4.2 s`` (``failed after 4.2 s`` if it failed)."""
    head = f"{name}: {doing} " if name else f"{doing} "
    tail = f" failed after {seconds(took)}" if failed else f" {seconds(took)}"
    return head + "." * max(WIDTH - len(head), 3) + tail


def bar(done: int, total: int, width: int = BAR) -> str:
    """``[=====>    ]`` for ``done`` of ``total``."""
    filled = width if total <= 0 else min(width, width * max(done, 0) // total)
    head = ">" if 0 < filled < width else ""
    return "[" + ("=" * filled + head)[:width].ljust(width) + "]"


@dataclass
class Phase:
    """One phase: what it does, and what it counts (``total`` things called ``unit``)."""

    doing: str
    total: int | None = None
    unit: str = ""
    done: int = 0
    #: said in brackets after ``doing`` in the record, e.g. ``3 segments``
    note: str = ""
    started: float = field(default_factory=time.perf_counter)

    def advance(self, n: int = 1) -> None:
        self.done += n

    def live(self, tasks: tuple[int, int] | None) -> str:
        """The live line's text (without the name): bar, count, time so far."""
        parts = [self.doing]
        if self.total:
            parts += [bar(self.done, self.total), f"{self.done}/{self.total} {self.unit}".rstrip()]
        elif tasks is not None:
            parts += [bar(*tasks), f"{tasks[0]}/{tasks[1]} Spark tasks"]
        parts.append(seconds(time.perf_counter() - self.started))
        return " ".join(parts)

    def text(self) -> str:
        """``doing`` with the note, or the count, in brackets."""
        said = self.note or (
            f"{self.done}/{self.total} {self.unit}".rstrip() if self.total is not None else ""
        )
        return f"{self.doing} ({said})" if said else self.doing


def _terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Progress:
    """The phases of a run on ``stream`` (default: standard error, as it is when written
    to).  ``live``: redraw a live line (default: when ``stream`` is a terminal);
    ``enabled=False``: say nothing (the library's default)."""

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        name: str = "txmq reconcile",
        live: bool | None = None,
        enabled: bool = True,
    ) -> None:
        self._stream = stream
        self.name = name
        self.enabled = enabled
        self.live = enabled and (_terminal(self.stream) if live is None else live)
        self.phases: list[Phase] = []
        self._tasks: TaskCount | None = None
        self._shown = ""
        self._last = ""
        self._wake = threading.Event()
        self._ticker: threading.Thread | None = None

    @classmethod
    def off(cls) -> Progress:
        return cls(enabled=False)

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def tasks(self, count: TaskCount | None) -> None:
        """Count the running Spark tasks with ``count`` (see :func:`spark_tasks`) on the live
        line of a phase with nothing of its own to count."""
        self._tasks = count

    @contextmanager
    def phase(self, doing: str, total: int | None = None, unit: str = "") -> Iterator[Phase]:
        """A phase: its record is written when it ends (``failed after`` on an exception)."""
        p = Phase(doing, total, unit)
        if not self.enabled:
            yield p
            return
        self.phases.append(p)
        if self.live:
            self._start()
            self._draw()
        failed = True
        try:
            yield p
            failed = False
        finally:
            self.phases.remove(p)
            took = time.perf_counter() - p.started
            self._write(record(self.name, p.text(), took, failed=failed))

    def close(self) -> None:
        """Stop redrawing (the thread that does, if any, ends)."""
        ticker, self._ticker = self._ticker, None
        if ticker is not None:
            self._wake.set()
            ticker.join(timeout=2)
        with _lock:
            self._clear()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the live line -------------------------------------------------------------------

    def _start(self) -> None:
        if self._ticker is None:
            self._wake.clear()
            self._ticker = threading.Thread(target=self._tick, name="txmq-progress", daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        while not self._wake.wait(TICK):
            if self.phases:
                self._draw()

    def _count(self) -> tuple[int, int] | None:
        if self._tasks is None:
            return None
        try:
            return self._tasks()
        except Exception:  # the session stopping under it: no count this time
            return None

    def _draw(self) -> None:
        """Redraw the live line: the newest phase, counted now."""
        phases = list(self.phases)
        if not phases:
            return
        p = phases[-1]
        tasks = None if p.total else self._count()  # Spark is asked outside the lock
        text = f"{self.name}: {p.live(tasks)}" if self.name else p.live(tasks)
        with _lock:
            if p in self.phases:  # not ended while it was counted
                self._show(text[: max(self._columns() - 1, 10)])

    def _columns(self) -> int:
        """The terminal's width (``$COLUMNS`` or 80 when it does not say)."""
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, ValueError, OSError):
            columns = 0
        if columns <= 0:
            try:
                columns = int(os.environ.get("COLUMNS", ""))
            except ValueError:
                columns = 80
        return columns

    def _show(self, text: str) -> None:
        """``text`` as the live line (the caller holds the lock)."""
        global _showing
        self.stream.write("\r\x1b[K" + text)
        self.stream.flush()
        self._shown = self._last = text
        _showing = self

    def _clear(self) -> None:
        """Take the live line off the terminal (the caller holds the lock)."""
        global _showing
        if self._shown:
            self.stream.write("\r\x1b[K")
            self._shown = ""
        if _showing is self:
            _showing = None

    def _write(self, line: str) -> None:
        with _lock:
            self._clear()
            self._last = ""
            self.stream.write(line + "\n")
            self.stream.flush()
        if self.live and self.phases:
            self._draw()

    def _redraw(self) -> None:
        """Put the live line back as it was, after someone else's line (the caller holds
        the lock)."""
        if self.live and self.phases and self._last:
            self._show(self._last)


def echo(text: str, stream: TextIO | None = None) -> None:
    """``text`` (a line, or lines) on standard error, above the live line if one is shown."""
    out = stream if stream is not None else sys.stderr
    with _lock:
        showing = _showing
        if showing is not None:
            showing._clear()
        out.write(text if text.endswith("\n") else text + "\n")
        out.flush()
        if showing is not None:
            showing._redraw()


def spark_tasks(sc: Any) -> TaskCount:
    """(tasks done, tasks) of the stages running in SparkContext ``sc`` (its status
    tracker: Spark's own console progress bar counts the same)."""
    tracker = sc.statusTracker()

    def count() -> tuple[int, int] | None:
        done = total = 0
        for stage in tracker.getActiveStageIds():
            info = tracker.getStageInfo(stage)
            if info is not None:
                done += info.numCompletedTasks
                total += info.numTasks
        return (done, total) if total else None

    return count
