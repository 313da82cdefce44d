"""Alembic environment of the orders example's two services (each its own database).

It does what the README tells an application to do: txmq's tables first
(``txmq.sqla.upgrade``, its own version table), then the service's own revisions, with
autogenerate told to leave txmq's tables alone (``txmq.sqla.include_name``). Run it
through :func:`examples.orders.db.upgrade`, which names the service and the connection.
"""

from __future__ import annotations

from alembic import context

import txmq.sqla
from examples.orders.db import SERVICES

config = context.config
service = SERVICES[config.attributes["service"]]
connection = config.attributes["connection"]

txmq.sqla.upgrade(connection)  # the transaction log, the outbox, the consumed keys
context.configure(
    connection=connection,
    target_metadata=service.metadata,
    version_table=service.version_table,
    include_name=txmq.sqla.include_name,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
