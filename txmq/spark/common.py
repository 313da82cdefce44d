"""What the passes of one reconciliation share: the clock, the window, the frames they cache
and the counts they take on the way (Spark Observations, so no extra pass counts them)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from py4j.protocol import Py4JError  # type: ignore[import-untyped]
from pyspark.sql import Column, DataFrame, Observation, SparkSession
from pyspark.sql import functions as F

from txmq.spark.progress import Phase, Progress

__all__ = ["Run", "local_frame", "mapped", "ms"]


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def ms(t: datetime) -> int:
    """``t`` (naive: UTC) as epoch milliseconds: exact, floored as PostgreSQL's are."""
    return ((t if t.tzinfo else t.replace(tzinfo=UTC)) - _EPOCH) // timedelta(milliseconds=1)


def mapped(col: Column, mapping: Mapping[Any, Any], default: Any = None) -> Column:
    """``mapping[col]`` (``default`` when absent), as a CASE expression (for a few keys)."""
    out: Any = F
    for k, v in mapping.items():
        out = out.when(col == F.lit(k), F.lit(v))
    return F.lit(default) if out is F else out.otherwise(F.lit(default))


def local_frame(spark: SparkSession, rows: Sequence[Sequence[Any]], schema: str) -> DataFrame:
    """``rows`` (tuples of plain values) as a DataFrame of ``schema`` (Spark DDL), handed to
    Spark through Arrow: a local relation, which Spark scans, sizes and broadcasts without a
    job of its own (``createDataFrame`` of a list is an RDD, a job each time it is read or
    broadcast).  A timestamp without a time zone is local time, as ``createDataFrame``
    takes it."""
    import pyarrow as pa  # type: ignore[import-untyped]
    from pyspark.sql.pandas.types import to_arrow_type
    from pyspark.sql.types import DataType, StructType, TimestampType

    struct = DataType.fromDDL(schema)
    assert isinstance(struct, StructType)
    columns: list[Any] = list(zip(*rows, strict=True)) if rows else [()] * len(struct.fields)
    arrays = []
    for f, values in zip(struct.fields, columns, strict=True):
        if isinstance(f.dataType, TimestampType):
            values = [
                v.astimezone(UTC) if isinstance(v, datetime) and v.tzinfo is None else v
                for v in values
            ]
        arrays.append(pa.array(values, type=to_arrow_type(f.dataType, timezone="UTC")))
    table = pa.Table.from_arrays(arrays, names=struct.names)
    return spark.createDataFrame(table, schema=struct)


@dataclass
class Run:
    """One run's settings and bookkeeping."""

    spark: SparkSession
    now: datetime
    sla: timedelta
    since: datetime | None = None
    until: datetime | None = None
    #: frames cached by keep(): the caller unpersists them when done
    cached: list[DataFrame] = field(default_factory=list)
    observations: dict[str, tuple[Observation, DataFrame]] = field(default_factory=dict)
    #: what observe() asked for: (its observation, the frame unobserved, the aggregates)
    metrics: dict[str, tuple[Observation, DataFrame, dict[str, Column]]] = field(
        default_factory=dict
    )
    #: wall-clock seconds of each step (see step())
    seconds: dict[str, float] = field(default_factory=dict)
    #: told of each step as a phase (see step())
    progress: Progress = field(default_factory=Progress.off)

    @contextmanager
    def step(
        self, name: str, doing: str | None = None, total: int | None = None, unit: str = ""
    ) -> Iterator[Phase]:
        """Time a step, name the Spark jobs it starts after it (the Spark UI shows it), and
        tell :attr:`progress` of it: a phase ``doing`` (default: ``name``) of ``total``
        ``unit`` (the caller advances it)."""
        sc = self.spark.sparkContext
        sc.setJobDescription(f"txmq reconcile: {name}")
        started = time.perf_counter()
        try:
            with self.progress.phase(doing or name, total, unit) as phase:
                yield phase
        finally:
            took = time.perf_counter() - started
            self.seconds[name] = round(self.seconds.get(name, 0.0) + took, 3)
            sc.setJobDescription(None)  # type: ignore[arg-type]

    @property
    def cutoff(self) -> Column:
        """Anything older (ms) had the whole SLA to settle."""
        return F.lit(ms(self.now - self.sla))

    def window(self, at_ms: Column) -> Column:
        """``at_ms`` is inside the run's window."""
        cond = F.lit(True)
        if self.since is not None:
            cond = cond & (at_ms >= F.lit(ms(self.since)))
        if self.until is not None:
            cond = cond & (at_ms < F.lit(ms(self.until)))
        return cond

    def keep(self, df: DataFrame) -> DataFrame:
        """``df`` cached and computed now, once (later frames read the cache)."""
        self.cached.append(df.cache())
        df.count()
        return df

    def counted(self, df: DataFrame, name: str, cond: Column) -> DataFrame:
        """``df``, counting its rows that meet ``cond`` as it is computed (see counts)."""
        obs = Observation(name)
        self.observations[name] = (obs, df.where(cond))
        return df.observe(obs, F.sum(F.when(cond, 1).otherwise(0)).alias("n"))

    def observe(self, df: DataFrame, name: str, **metrics: Column) -> DataFrame:
        """``df``, computing ``metrics`` (aggregates, by name) as it is computed: read them
        with :meth:`observed` once an action computed it (no pass of their own)."""
        obs = Observation(name)
        self.metrics[name] = (obs, df, metrics)
        return df.observe(obs, *(m.alias(n) for n, m in metrics.items()))

    def observed(self, name: str) -> dict[str, Any]:
        """The metrics :meth:`observe` asked for as ``name``."""
        obs, df, metrics = self.metrics[name]
        try:
            got = obs.get
        except Py4JError:  # a pass over empty input may have been skipped, metric and all
            got = {}
        if metrics.keys() <= got.keys():
            return got
        # not observed: Spark reports no metrics when it optimized their operator away
        return df.agg(*(m.alias(n) for n, m in metrics.items())).collect()[0].asDict()

    def counts(self) -> dict[str, int]:
        out = {}
        for name, (obs, df) in self.observations.items():
            try:
                out[name] = int(obs.get["n"] or 0)
            # a pass over empty input may have been skipped, metric and all (Spark then
            # reports no metrics, or none of this name)
            except (Py4JError, KeyError):
                out[name] = int(df.count())
        return out

    def unpersist(self) -> None:
        for df in self.cached:
            df.unpersist()
        self.cached.clear()
