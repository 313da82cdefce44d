"""Three services whose orders are sagas across them, kept consistent by txmq.

- The **order service** (:mod:`examples.orders.order_service`, blocking code: ``Session``,
  ``txmq.sync``) creates each order PENDING and starts its ``place-order`` saga in one local
  transaction; it coordinates the saga (its state in the order service's database, each
  step's command a transactional message of the transaction that decided it) and runs its
  last step, the order review (CONFIRMED); a compensated saga cancels the order.
- The **inventory service** (:mod:`examples.orders.inventory_service`, async:
  ``AsyncSession``) reserves the stock, and releases it when the saga compensates.
- The **payment service** (:mod:`examples.orders.payment_service`, blocking) charges the
  customer, and refunds the charge when the saga compensates; the saga gives up on a
  charge that does not answer by its deadline.

Each service has its own database (SQLite by default, PostgreSQL by URL) migrated by its
own alembic environment, and a small HTTP front. ``python -m examples.orders demo`` runs
them with a broker (or a local cluster), places a few hundred orders while injecting faults,
and checks the books (:mod:`examples.orders.checker`).
"""
