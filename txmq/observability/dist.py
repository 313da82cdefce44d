"""Histograms kept in plain numbers, turned into Prometheus metrics only when scraped.

``prometheus_client``'s own ``Histogram.observe`` takes a lock per bucket and per sum and
walks the buckets in Python: a few microseconds, on a path that runs for every message.
A :class:`Dist` is a list of counts found with ``bisect`` and a sum: a fraction of that.
The broker's metrics (broker/metrics.py) and the client's (txmq/observe.py) keep theirs
so; :func:`histogram_family` makes the Prometheus histogram of some of them at scrape
time, :class:`DistCollector` is a labelled histogram a ``CollectorRegistry`` scrapes.

No lock: the broker observes on its event loop; a client may observe from a listener's
worker threads too, where two increments at the same instant can (rarely) count once —
a scrape never sees a count go down.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["Dist", "DistCollector", "histogram_family"]


class Dist:
    """A histogram of plain numbers: how many observations fell at or under each bound
    (the last count: above them all) and their sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        #: an int while only ints are observed (the size histogram's bytes stay exact)
        self.total: float = 0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value


def histogram_family(
    name: str, doc: str, labels: list[str], dists: Iterable[tuple[list[str], Dist]]
) -> Any:
    """A ``HistogramMetricFamily`` with a sample set per (label values, :class:`Dist`)."""
    from prometheus_client.core import HistogramMetricFamily

    family = HistogramMetricFamily(name, doc, labels=labels)
    for values, dist in dists:
        buckets: list[tuple[str, float]] = []
        seen = 0
        for bound, count in zip(dist.bounds, dist.counts, strict=False):
            seen += count
            buckets.append((_bound(bound), seen))
        buckets.append(("+Inf", seen + dist.counts[-1]))
        family.add_metric(values, buckets, dist.total)
    return family


def _bound(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class DistCollector:
    """A labelled histogram for a ``prometheus_client`` registry:
    ``collector.labels(*values).observe(x)`` as with a ``Histogram``, cheaper."""

    def __init__(
        self, name: str, doc: str, labelnames: Iterable[str], bounds: tuple[float, ...]
    ) -> None:
        self.name, self.doc, self.bounds = name, doc, bounds
        self.labelnames = list(labelnames)
        self._children: dict[tuple[str, ...], Dist] = {}

    def labels(self, *values: str) -> Dist:
        found = self._children.get(values)
        if found is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, not {values}")
            found = self._children.setdefault(values, Dist(self.bounds))
        return found

    def observe(self, values: tuple[str, ...], value: float) -> None:
        """``labels(*values).observe(value)`` in one call (for a path that runs for every
        message)."""
        d = self._children.get(values)
        if d is None:
            d = self.labels(*values)
        d.counts[bisect_left(d.bounds, value)] += 1
        d.total += value

    def describe(self) -> list[Any]:
        """What the registry registers the names by (no samples)."""
        return [histogram_family(self.name, self.doc, self.labelnames, [])]

    def collect(self) -> Iterator[Any]:
        children = list(self._children.items())
        yield histogram_family(
            self.name, self.doc, self.labelnames, [(list(k), d) for k, d in children]
        )
