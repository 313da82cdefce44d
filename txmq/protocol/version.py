"""txmq's version: its installed distribution's (pyproject.toml's, as installed), looked up
when first asked for — importlib.metadata alone costs more than ``import txmq``.  Sources on
``sys.path`` that were never installed have no metadata: ``0+unknown`` (a valid version,
lower than any release).  Shown by ``txmq --version``, a broker's runtime information and
metrics, and the client's user agent for RocketMQ 5's endpoint."""

from __future__ import annotations

from functools import cache

__all__ = ["installed_version"]


@cache
def installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("txmq")
    except PackageNotFoundError:
        return "0+unknown"
