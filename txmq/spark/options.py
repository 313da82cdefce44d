"""What the job's options share with its passes (no Spark needed to import it): the error of
an option the job cannot follow, and the default row limit."""

from __future__ import annotations

__all__ = ["MAX_ROWS", "BadOption"]

#: the most rows of one class the job puts together and writes, by default
MAX_ROWS = 1_000_000


class BadOption(ValueError):
    """An option, or what it asks of the data, the job cannot do: exit code 2."""
