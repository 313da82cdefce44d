"""Alembic environment and revisions for every table txmq owns in an application database.

Run them with ``txmq db upgrade --url URL`` or ``txmq.sqla.upgrade(connection)``; the
version table is ``txmq_alembic_version``, apart from the application's own.
"""
