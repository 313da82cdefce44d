"""txmq's web console: an ASGI application (Starlette, Jinja2 templates, static files
shipped in the package) over :class:`txmq.admin.client.AdminClient` — cluster and brokers,
topics, consumer groups and their lag, messages by id or key, undecided and parked
transactions with COMMIT / ROLLBACK, dead letters and their re-sending.  Run it with
``txmq console``; it needs the ``console`` extra (``pip install 'txmq[console]'``)."""

from txmq.console.app import create_app
from txmq.console.state import ConsoleConfig

__all__ = ["ConsoleConfig", "create_app"]
