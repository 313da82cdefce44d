"""Which broker set a store belongs to: ``<store>/config/broker.json`` names its cluster,
broker name and broker id, so that tools reading the store (the reconciliation job) know
whose it is, and a broker started on another broker set's store refuses to."""

from __future__ import annotations

import msgspec

from txmq.broker.state.config import BrokerConfig
from txmq.broker.store import StoreError
from txmq.server.jsonfile import load_json, write_json_atomic

__all__ = ["BrokerIdentity", "claim_store"]

FILE = ("config", "broker.json")


class BrokerIdentity(msgspec.Struct, frozen=True, kw_only=True):
    cluster: str = ""
    broker_name: str = ""
    broker_id: int = 0


def claim_store(config: BrokerConfig) -> None:
    """Record this broker in its store; StoreError if the store is another broker set's
    (call with the store's lock held)."""
    path = config.store.joinpath(*FILE)
    mine = BrokerIdentity(
        cluster=config.cluster, broker_name=config.broker_name, broker_id=config.broker_id
    )
    found = load_json(path, BrokerIdentity) if path.exists() else BrokerIdentity()
    if found.broker_name and (found.cluster, found.broker_name) != (mine.cluster, mine.broker_name):
        raise StoreError(
            f"store {config.store} belongs to broker set {found.broker_name!r} of cluster "
            f"{found.cluster!r} (its {'/'.join(FILE)}): start it with --cluster "
            f"{found.cluster} --broker-name {found.broker_name}, or give another --store"
        )
    if found != mine:
        write_json_atomic(path, mine)
