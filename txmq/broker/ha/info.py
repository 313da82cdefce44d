"""A broker's part in its broker set, as ``txmq admin`` shows it: the replication fields of
:class:`~txmq.protocol.wire.RuntimeInfo`, from :meth:`Replication.describe`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from txmq.protocol.wire import RuntimeInfo

if TYPE_CHECKING:
    from txmq.broker.ha.replication import Replication

__all__ = ["with_replication"]


def with_replication(info: RuntimeInfo, replication: Replication) -> RuntimeInfo:
    """``info`` with this broker's role, epoch, and its slaves' lag and in-sync set (a
    master) or its master and its lag (a slave)."""
    d = replication.describe()
    role = replication.role
    controllers = list(replication.config.controller_addresses)
    common = {
        "broker_role": str(d.get("role", "")),
        "epoch": _int(d.get("epoch"), 0),
        "controlled": bool(d.get("controlled", False)),
        "controllers": controllers,
        "ha_address": str(d.get("ha_address", "")),
    }
    if role.is_master:
        slaves = d.get("slaves")
        lag_bytes: dict[int, int] = {}
        lag_s: dict[int, float] = {}
        if isinstance(slaves, dict):
            for key, lag in slaves.items():
                if isinstance(lag, dict):
                    lag_bytes[int(key)] = _int(lag.get("lag_bytes"), 0)
                    lag_s[int(key)] = _float(lag.get("lag_s"), -1.0)
        in_sync = d.get("in_sync")
        return msgspec.structs.replace(
            info,
            **common,
            slave_lag_bytes=lag_bytes,
            slave_lag_s=lag_s,
            in_sync=sorted(int(i) for i in in_sync) if isinstance(in_sync, list) else [],
        )
    # describe() names the master by its HA address only: its id and client address are
    # the role's (without a controller the master is broker 0, for good)
    master_id = role.master_id if role.master_id >= 0 or role.controlled else 0
    return msgspec.structs.replace(
        info,
        **common,
        master_id=master_id,
        master_address=role.master_address,
        master_ha_address=str(d.get("master") or ""),
        connected=bool(d.get("connected", False)),
        lag_bytes=_int(d.get("lag_bytes"), 0),
        last_contact_s=_float(d.get("last_contact_s"), -1.0),
    )


def _int(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _float(value: object, default: float) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return default
