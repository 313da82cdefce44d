"""An order service and an inventory service that stay consistent through txmq.

- The **order service** (:mod:`examples.orders.order_service`, blocking code: ``Session``,
  ``txmq.sync``) creates each order in a local transaction with a transactional
  (half-message) send of ``OrderCreated``, sharded by order id; the broker's check-back
  settles a crash between its database commit and the broker. It consumes the inventory's
  replies idempotently and moves the order to CONFIRMED, or CANCELLED when stock is short.
- The **inventory service** (:mod:`examples.orders.inventory_service`, async:
  ``AsyncSession``) consumes ``OrderCreated`` idempotently and orderly, reserves stock in
  its own database and publishes ``StockReserved`` / ``StockRejected`` through the
  transactional outbox, relayed by an ``OutboxRelay`` in the same process.

Each service has its own database (SQLite by default, PostgreSQL by URL) migrated by its
own alembic environment, and a small HTTP front. ``python -m examples.orders demo`` runs
both with a broker, places a few hundred orders while injecting faults, and checks the
books (:mod:`examples.orders.checker`).
"""
