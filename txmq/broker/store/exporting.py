"""The store's background Parquet export of sealed commit-log segments.

Decoding a segment takes seconds of CPU, so the broker never does it itself:
:class:`SegmentExporter` owns one daemon thread that, when asked (:meth:`request`, after
start and after every commit-log roll), runs ``python -m broker.store.export STORE`` in a
child process at lowered priority and waits for it.  Requests that arrive during a run
lead to exactly one more run.  The child writes each export to a temporary file and
renames it, so terminating it (:meth:`stop`) never leaves a bad export behind.

Only one export runs per store: the child inherits an ``flock`` on ``<store>/export.lock``,
so the child of a broker that was killed keeps it until it finishes, and the next broker's
exporter waits for that (two children would write the same temporary files).

This module stays import-light: :mod:`broker.store.export` imports pyarrow (about 40 MiB
and a quarter of a second), which the broker process itself never needs.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .commitlog import segment_paths

__all__ = ["SegmentExporter", "export_file", "pyarrow_installed"]

log = logging.getLogger("txmq.broker.store")

#: where the exports live, in the store folder
EXPORT_DIR = "export"
#: held (inherited by the child) while an export runs
LOCK_FILE = "export.lock"
#: the niceness added to the child's (it competes with the broker for CPU)
NICE = 10
_STDERR_TAIL = 2000


def pyarrow_installed() -> bool:
    """Whether pyarrow can be found (without importing it into this process)."""
    try:
        return importlib.util.find_spec("pyarrow") is not None
    except (ImportError, ValueError):
        return False


def export_file(root: Path, segment: Path) -> Path:
    """Where the export of ``segment`` lives (``broker.store.export`` writes it)."""
    return root / EXPORT_DIR / f"{segment.name}.parquet"


def _pythonpath() -> str:
    """PYTHONPATH for the child: the folder holding the ``broker`` package comes first, so
    the child imports the same code even when this process found it via ``sys.path``."""
    here = str(Path(__file__).resolve().parents[2])
    rest = os.environ.get("PYTHONPATH")
    return here if not rest else os.pathsep.join((here, rest))


class SegmentExporter:
    """Runs the Parquet export of the store at ``root`` in a child process, on request."""

    def __init__(
        self,
        root: Path,
        *,
        retry_s: float = 5.0,
        stop_timeout: float = 5.0,
        paused: Callable[[], bool] | None = None,
    ) -> None:
        self._root = root
        #: no export while this says so (a full disk: an export only adds to it); the
        #: next request after that exports what was left
        self._paused = paused
        self._retry_s = retry_s
        self._stop_timeout = stop_timeout
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._stopping = False
        self._disabled = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread = threading.Thread(target=self._run, name="txmq-store-export", daemon=True)
        #: finished child runs (whatever their exit status)
        self.runs = 0

    def start(self) -> None:
        self._thread.start()

    def request(self) -> None:
        """Ask for an export run (cheap; safe to call from any thread, with any lock held)."""
        self._wake.set()

    def stop(self) -> None:
        """Stop the thread, terminating a running child (killing it if it lingers)."""
        with self._lock:
            self._stopping = True
            self._wake.set()
            if self._proc is not None:
                self._proc.terminate()
        if not self._thread.is_alive():
            return
        self._thread.join(self._stop_timeout)
        if self._thread.is_alive():
            with self._lock:
                if self._proc is not None:
                    self._proc.kill()
            self._thread.join()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            if self._stopping:
                return
            self._wake.clear()
            try:
                self._export()
            except Exception:
                log.exception("parquet export of %s failed", self._root)

    def _has_work(self) -> bool:
        """False when there is certainly nothing to do: no sealed segment, no export."""
        try:
            segments = segment_paths(self._root / "commitlog")
        except FileNotFoundError:
            return False
        if len(segments) > 1:
            return True
        folder = self._root / EXPORT_DIR
        return folder.is_dir() and any(folder.iterdir())

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "txmq.broker.store.export", str(self._root)]

    def _export(self) -> None:
        if self._disabled or (self._paused is not None and self._paused()):
            return
        if not self._has_work():
            return
        lock = os.open(self._root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info(
                    "parquet export of %s: an earlier export is still running; "
                    "trying again in %g s",
                    self._root,
                    self._retry_s,
                )
                self._wake.wait(self._retry_s)  # returns early for stop() (or a request)
                self._wake.set()
                return
            self._run_child(lock)
        finally:
            os.close(lock)

    def _run_child(self, lock: int) -> None:
        env = {**os.environ, "PYTHONPATH": _pythonpath()}
        began = time.monotonic()
        with self._lock:
            if self._stopping:
                return
            proc = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                pass_fds=(lock,),  # the child holds the lock even if this process dies
                start_new_session=True,  # a Ctrl-C on the broker's terminal is not for it
            )
            self._proc = proc
        with proc:
            try:
                _lower_priority(proc.pid)
                out, err = proc.communicate()
            except BaseException:
                proc.kill()
                raise
            finally:
                with self._lock:
                    self._proc = None
                self.runs += 1
        took = time.monotonic() - began
        code = proc.returncode
        if code == 0:
            summary = out.decode(errors="replace").strip().splitlines()
            log.info("parquet export: %s (%.1f s)", summary[-1] if summary else "done", took)
        elif self._stopping:
            log.info("parquet export of %s stopped by shutdown", self._root)
        elif code == 2:  # the child found no pyarrow after all (a broken installation)
            self._disabled = True
            log.warning(
                "parquet export of %s is off: the export could not import pyarrow: %s",
                self._root,
                _tail(err),
            )
        else:
            log.warning(
                "parquet export of %s failed (exit status %s): %s", self._root, code, _tail(err)
            )


def _lower_priority(pid: int) -> None:
    try:
        nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + NICE)
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    except (AttributeError, OSError):  # not POSIX, or the child is already gone
        pass


def _tail(err: bytes) -> str:
    text = err.decode(errors="replace").strip()
    return text[-_STDERR_TAIL:] if text else "(no output)"
