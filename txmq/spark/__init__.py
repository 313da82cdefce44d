"""PySpark reconciliation of transaction states across the producer databases, the broker
and the consumer databases (``txmq reconcile``, or ``spark-submit spark/job.py``)."""

from txmq.spark.job import Options, Result, main, run, session

__all__ = ["Options", "Result", "main", "run", "session"]
