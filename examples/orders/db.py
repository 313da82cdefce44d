"""Databases of the orders example: URLs, migrations per service, seeding the stock and the
customers' accounts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, MetaData, create_engine, delete, make_url
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from examples.orders.models import Account, InventoryBase, OrderBase, PaymentBase, Stock

__all__ = [
    "SERVICES",
    "Service",
    "connect",
    "seed_accounts",
    "seed_stock",
    "sync_url",
    "upgrade",
]

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


@dataclass(frozen=True)
class Service:
    name: str
    metadata: MetaData
    version_table: str


SERVICES = {
    "orders": Service("orders", OrderBase.metadata, "orders_alembic_version"),
    "inventory": Service("inventory", InventoryBase.metadata, "inventory_alembic_version"),
    "payment": Service("payment", PaymentBase.metadata, "payment_alembic_version"),
}


def sync_url(url: str | URL) -> URL:
    """The blocking-driver form of a URL (``sqlite+aiosqlite`` → ``sqlite``)."""
    u = make_url(url)
    if u.drivername == "sqlite+aiosqlite":
        return u.set(drivername="sqlite")
    if u.drivername in ("postgresql", "postgresql+asyncpg"):
        return u.set(drivername="postgresql+psycopg")
    return u


def connect(url: str | URL) -> Engine:
    """A blocking engine; SQLite waits up to 30 s for the database's lock (the services
    and the relay share one file) and runs in WAL mode (readers never wait for writers)."""
    u = sync_url(url)
    if u.get_backend_name() == "sqlite":
        return create_engine(u, connect_args={"timeout": 30})
    return create_engine(u)


def upgrade(service: str, url: str | URL) -> None:
    """Bring ``service``'s database to its head: txmq's tables, then the service's own."""
    if service not in SERVICES:
        raise ValueError(f"unknown service {service!r}: one of {', '.join(SERVICES)}")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("version_locations", str(MIGRATIONS / service))
    cfg.set_main_option("path_separator", "os")
    engine = connect(url)
    try:
        with engine.begin() as conn:
            if conn.dialect.name == "sqlite":
                conn.exec_driver_sql("PRAGMA journal_mode=WAL")
        with engine.connect() as conn:
            cfg.attributes["service"] = service
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
            conn.commit()
    finally:
        engine.dispose()


def seed_stock(url: str | URL, stock: dict[str, int]) -> None:
    """Replace the inventory's stock with ``stock`` (product → units), nothing reserved."""
    _replace(
        url, Stock, [Stock(product=p, initial=n, available=n, reserved=0) for p, n in stock.items()]
    )


def seed_accounts(url: str | URL, balances: dict[str, int]) -> None:
    """Replace the payment service's accounts with ``balances`` (customer → money)."""
    _replace(url, Account, [Account(customer=c, initial=n, balance=n) for c, n in balances.items()])


def _replace(url: str | URL, model: type[Any], rows: list[Any]) -> None:
    """Every row of ``model``'s table replaced by ``rows``, in one transaction."""
    engine = connect(url)
    try:
        with Session(engine) as session, session.begin():
            session.execute(delete(model))
            session.add_all(rows)
    finally:
        engine.dispose()
