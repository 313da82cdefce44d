"""Name-server settings: a frozen dataclass read from TOML ``[namesrv]`` and
``TXMQ_NAMESRV_*`` environment variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from txmq.namesrv.controller import ControllerTimings
from txmq.protocol.settings import SettingsError, load_settings
from txmq.server.serving import ConnectionSettings

__all__ = ["ControllerConfig", "NamesrvConfig", "controller_address"]


@dataclass(frozen=True)
class NamesrvConfig(ConnectionSettings):
    """A name server (``txmq namesrv start``): ``[namesrv]`` in TOML, ``TXMQ_NAMESRV_*`` in
    the environment."""

    #: the address the name server listens on (127.0.0.1: this machine only)
    host: str = "127.0.0.1"
    #: the port brokers register on and clients ask for routes; 9876, RocketMQ's
    #: name-server port (RocketMQ's `listenPort`)
    port: int = 9876
    #: a broker not heard from (no registration) for this long is dropped from the routes
    #: (RocketMQ: 120 s)
    broker_expiry_s: float = 120.0
    #: how often the name server looks for silent brokers (RocketMQ's
    #: `scanNotActiveBrokerInterval`; 10 s in RocketMQ 4)
    scan_interval_s: float = 10.0
    #: run the controller in this name server too, with its state in this folder
    #: (RocketMQ's `enableControllerInNamesrv`; "": no controller here, unless etcd is set)
    controller_store: str = ""
    #: controllers on etcd: etcd's client endpoints, "h1:2379,h2:2379,h3:2379" (empty: one
    #: controller, its state in a folder); any number of controllers may share them, one
    #: leads (RocketMQ 5 runs its controllers on DLedger or jRaft)
    etcd: str = ""
    #: the etcd key prefix of this cluster's controllers (several clusters may share one
    #: etcd)
    etcd_prefix: str = "/txmq"
    #: the etcd lease asked for the leading controller, in whole seconds: a leader that
    #: died is replaced after about this long.  etcd grants at least its shortest, 1.5 of
    #: its election timeouts rounded up (2 s with etcd's defaults; 1 s with
    #: `--heartbeat-interval 50 --election-timeout 500`, fine on a LAN), and that is used
    etcd_lease_s: int = 1
    #: the address brokers are told to reach this controller at when it leads
    #: (default: host:port; required when host is a wildcard such as 0.0.0.0)
    advertised_address: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"port {self.port} is not between 0 and 65535")
        if not self.broker_expiry_s > 0:
            raise SettingsError("broker_expiry_s must be positive")
        if not self.scan_interval_s > 0:
            raise SettingsError("scan_interval_s must be positive")
        _check_etcd(self.etcd, self.etcd_lease_s)
        super().__post_init__()

    @classmethod
    def load(
        cls,
        file: str | Path | None = None,
        *,
        env: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> NamesrvConfig:
        return load_settings(
            cls,
            file=file,
            section="namesrv",
            env_prefix="TXMQ_NAMESRV_",
            env=env,
            overrides=overrides,
        )


@dataclass(frozen=True)
class ControllerConfig(ConnectionSettings):
    """A controller of its own (``txmq controller start``): ``[controller]`` in TOML,
    ``TXMQ_CONTROLLER_*`` in the environment."""

    #: the address the controller listens on (127.0.0.1: this machine only)
    host: str = "127.0.0.1"
    #: the port brokers heartbeat to; 9878, RocketMQ's controller port
    port: int = 9878
    #: where the controller keeps its state (``controller.json``)
    #: (RocketMQ's `controllerStorePath`)
    store: Path = Path("./txmq-controller")
    #: a master silent for this long is replaced
    heartbeat_timeout_s: float = 2.0
    #: how long a master may acknowledge writes no in-sync slave confirmed, after a
    #: heartbeat the controller answered (shorter than heartbeat_timeout_s)
    lease_s: float = 1.5
    #: a master whose connection closed gets this long to come back before an election
    reconnect_grace_s: float = 0.6
    #: brokers with all_ack_in_sync = false: a failover that waited this long for in-sync
    #: slaves that do not report elects among those that did, losing what only the silent
    #: ones hold (as `txmq admin switchover --force` does; RocketMQ's
    #: enableElectUncleanMaster).  0: never, an operator decides
    unclean_election_after_s: float = 0.0
    #: controllers on etcd: etcd's client endpoints, "h1:2379,h2:2379,h3:2379" (empty: one
    #: controller, its state in a folder); any number of controllers may share them, one
    #: leads (RocketMQ 5 runs its controllers on DLedger or jRaft)
    etcd: str = ""
    #: the etcd key prefix of this cluster's controllers (several clusters may share one
    #: etcd)
    etcd_prefix: str = "/txmq"
    #: the etcd lease asked for the leading controller, in whole seconds: a leader that
    #: died is replaced after about this long.  etcd grants at least its shortest, 1.5 of
    #: its election timeouts rounded up (2 s with etcd's defaults; 1 s with
    #: `--heartbeat-interval 50 --election-timeout 500`, fine on a LAN), and that is used
    etcd_lease_s: int = 1
    #: the address brokers are told to reach this controller at when it leads
    #: (default: host:port; required when host is a wildcard such as 0.0.0.0)
    advertised_address: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.store, str):
            object.__setattr__(self, "store", Path(self.store))
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"port {self.port} is not between 0 and 65535")
        if not 0 < self.lease_s < self.heartbeat_timeout_s:
            raise SettingsError("lease_s must be positive and shorter than heartbeat_timeout_s")
        if not self.reconnect_grace_s >= 0:
            raise SettingsError("reconnect_grace_s must not be negative")
        if not self.unclean_election_after_s >= 0:
            raise SettingsError("unclean_election_after_s must not be negative (0: never)")
        _check_etcd(self.etcd, self.etcd_lease_s)
        super().__post_init__()

    def timings(self) -> ControllerTimings:
        return ControllerTimings(
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            lease_s=self.lease_s,
            reconnect_grace_s=self.reconnect_grace_s,
            unclean_election_after_s=self.unclean_election_after_s,
        )

    @classmethod
    def load(
        cls,
        file: str | Path | None = None,
        *,
        env: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> ControllerConfig:
        return load_settings(
            cls,
            file=file,
            section="controller",
            env_prefix="TXMQ_CONTROLLER_",
            env=env,
            overrides=overrides,
        )


def _check_etcd(endpoints: str, lease_s: int) -> None:
    from txmq.namesrv.etcd import parse_endpoints

    if endpoints:
        try:
            parse_endpoints(endpoints)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
    if lease_s < 1:
        raise SettingsError("etcd_lease_s must be at least 1 (etcd counts leases in seconds)")


def controller_address(host: str, port: int, advertised: str) -> str:
    """Where brokers reach a controller that leads."""
    if advertised:
        return advertised
    if host in ("0.0.0.0", "::", ""):
        raise SettingsError(
            f"a controller on etcd listening on {host or 'every address'} needs "
            "advertised_address (--advertised-address HOST:PORT): the address the others "
            "name when brokers ask them"
        )
    return f"{host}:{port}"
