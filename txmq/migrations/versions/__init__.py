"""txmq's alembic revisions (one module per revision; alembic skips this file)."""
