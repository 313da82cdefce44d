"""The Spark session the job makes for itself, and how it keeps Spark's start-up chatter off
standard error.

When the job starts the JVM (``txmq reconcile``, not spark-submit, and no session given):

- Spark logs through a log4j2 configuration of the job's (:data:`LOG4J2`, given to the
  driver's JVM as ``-Dlog4j2.configurationFile`` in ``spark.driver.extraJavaOptions``, ahead
  of any the user gives, which win): warnings and errors, less Hadoop's notice that it has
  no native library; Spark then no longer announces its default profile and level;
- a local master binds to 127.0.0.1 (``SPARK_LOCAL_IP``, unless set): Spark no longer warns
  that the host name resolves to a loopback address, and nothing listens beyond the host;
- the JVM's standard error goes through a thread that drops the lines in :data:`NOISE` (the
  java launcher's own ``WARNING: Using incubator modules``, which no setting turns off) and
  writes every other line as it came (an exception Spark logs still shows);
- Spark's console progress bar stays off (the job shows its own, :mod:`txmq.spark.progress`).

``spark_log=True`` (``txmq reconcile --spark-log``) starts Spark as PySpark does, its output
untouched, and leaves Spark's log at its level (WARN).  A JVM started otherwise (by
spark-submit, or earlier in this process) is left as it is.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "JDBC_JAR",
    "LOG4J2",
    "NOISE",
    "default_driver_memory",
    "filter_lines",
    "session",
]

JDBC_JAR = "/usr/share/java/postgresql.jar"
"""Where Debian's ``libpostgresql-jdbc-java`` puts the driver (``--jdbc-jar`` or
``TXMQ_JDBC_JAR`` say otherwise)."""

#: Spark's log settings in a JVM the job starts (Spark's own defaults, at WARN, less the
#: start-up notices nobody can act on).  The root at WARN keeps Spark from announcing that it
#: set the level to WARN; the job lowers it to ERROR once the session is up.
LOG4J2 = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
logger.nativecode.name = org.apache.hadoop.util.NativeCodeLoader
logger.nativecode.level = error
logger.jetty.name = org.sparkproject.jetty.util.component.AbstractLifeCycle
logger.jetty.level = error
logger.metastore.name = org.apache.hadoop.hive.metastore.RetryingHMSHandler
logger.metastore.level = fatal
logger.metastore2.name = org.apache.hadoop.hive.metastore.ObjectStore
logger.metastore2.level = error
logger.parquet.name = org.apache.parquet.CorruptStatistics
logger.parquet.level = error
"""

#: lines of the JVM's standard error that are dropped: the java launcher's note that Spark's
#: launcher asked for an incubator module (``--add-modules=jdk.incubator.vector``)
NOISE = (re.compile(r"^WARNING: Using incubator modules: "),)

#: how long, at exit, the JVM's standard error may stay busy before the process goes on
#: ending (its last lines, e.g. an exception it logged as the job failed, are written first)
DRAIN_SECONDS = 1.0
#: ... and how long it must have been quiet
QUIET_SECONDS = 0.1


def session(
    master: str | None = None, jdbc_jar: str = JDBC_JAR, *, spark_log: bool = False, **conf: str
) -> Any:
    """A Spark session set up for the job (UTC, the JDBC driver, no UI, no console progress
    bar).  ``master`` None: the one spark-submit was given, or ``local[*]`` when not run by
    spark-submit.  Quiet (when this call starts the JVM: as the module docstring says), and
    Spark's log at ERROR once started, unless ``spark_log``: then as PySpark does."""
    from pyspark.core.context import SparkContext
    from pyspark.sql import SparkSession

    # Python workers run this interpreter (its packages: txmq, msgpack, pyarrow)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ  # spark-submit started the JVM already
    settings: dict[str, str] = {}
    if master is not None or not submitted:
        settings["spark.master"] = master or "local[*]"
    local = (master or "local").startswith("local")
    if not submitted and local:
        # local mode is one JVM doing everything: Spark's default of 1 GiB does not hold the
        # broadcast consumed keys of a big run
        settings["spark.driver.memory"] = default_driver_memory()
    settings |= {
        "spark.app.name": "txmq-reconcile",
        "spark.sql.session.timeZone": "UTC",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "8",
        # a run compiles some 150 classes of generated code, most of them again in the next
        # run of a session (tests, a notebook) unless they stay cached (Spark keeps 100)
        "spark.sql.codegen.cache.maxEntries": "1000",
        # hash joins: sorting millions of string keys is what a sort-merge join costs most
        "spark.sql.join.preferSortMergeJoin": "false",
    }
    if Path(jdbc_jar).is_file():
        settings["spark.jars"] = jdbc_jar
    settings |= conf
    if not spark_log and not submitted and SparkContext._gateway is None:
        spark = _quiet_session(settings, local=local)
    else:
        builder = SparkSession.builder
        for k, v in settings.items():
            builder = builder.config(k, v)
        spark = builder.getOrCreate()
    if not spark_log:
        spark.sparkContext.setLogLevel("ERROR")  # the summary is the output; errors still show
    return spark


def default_driver_memory() -> str:
    """Half of this machine's memory (at least 1 GiB): the heap of a local-mode session
    unless ``--conf spark.driver.memory=...`` says otherwise."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return "1g"
    return f"{max(total // 2 // 2**20, 1024)}m"


def filter_lines(lines: Iterator[bytes], write: Callable[[str], None]) -> None:
    """Each of ``lines`` (the JVM's standard error) that is not :data:`NOISE`, to ``write``
    as it came."""
    for raw in lines:
        line = raw.decode(errors="replace")
        if not any(p.match(line) for p in NOISE):
            write(line)


def _quiet_session(settings: dict[str, str], *, local: bool) -> Any:
    from pyspark import SparkConf
    from pyspark.core.context import SparkContext
    from pyspark.java_gateway import launch_gateway
    from pyspark.sql import SparkSession

    from txmq.spark.progress import echo

    folder = tempfile.mkdtemp(prefix="txmq-spark-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    config = Path(folder) / "log4j2.properties"
    config.write_text(LOG4J2)
    ours = f"-Dlog4j2.configurationFile={config.as_uri()}"
    theirs = settings.get("spark.driver.extraJavaOptions")
    conf = SparkConf()
    for k, v in settings.items():
        conf.set(k, v)
    conf.set("spark.driver.extraJavaOptions", f"{ours} {theirs}" if theirs else ours)

    read, write = os.pipe()
    pump = _Pump(read, echo)
    try:
        with _environ(SPARK_LOCAL_IP="127.0.0.1" if local else None):
            gateway = launch_gateway(  # type: ignore[no-untyped-call]
                conf, popen_kwargs={"stderr": write}
            )
    except BaseException:
        os.close(write)
        pump.drain(DRAIN_SECONDS)  # why the JVM did not start, before the Python error
        raise
    os.close(write)
    atexit.register(pump.drain, DRAIN_SECONDS)
    SparkContext(conf=conf, gateway=gateway)
    return SparkSession.builder.getOrCreate()


class _Pump:
    """A thread writing the lines of file descriptor ``fd`` through :func:`filter_lines`."""

    def __init__(self, fd: int, write: Callable[[str], None]) -> None:
        self.last = time.monotonic()
        self._write = write
        self._file = os.fdopen(fd, "rb")
        self._thread = threading.Thread(target=self._run, name="txmq-spark-stderr", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self._file:
            filter_lines(self._lines(), self._out)

    def _out(self, line: str) -> None:
        try:
            self._write(line)
        except (ValueError, OSError):  # sys.stderr closed under it (a test's capture, say)
            if sys.__stderr__ is not None:
                sys.__stderr__.write(line)

    def _lines(self) -> Iterator[bytes]:
        for line in self._file:
            self.last = time.monotonic()
            yield line

    def drain(self, timeout: float) -> None:
        """Wait (``timeout`` at most) until the lines stop coming, or the JVM has gone."""
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            if time.monotonic() - self.last >= QUIET_SECONDS:
                return
            time.sleep(0.02)


@contextmanager
def _environ(**values: str | None) -> Iterator[None]:
    """Environment variables set while the block runs (None, or set already: left as is)."""
    added = {k: v for k, v in values.items() if v is not None and k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)
