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

__all__ = ["ControllerConfig", "NamesrvConfig"]


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
    #: (RocketMQ's `enableControllerInNamesrv`; "": no controller here)
    controller_store: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"port {self.port} is not between 0 and 65535")
        if not self.broker_expiry_s > 0:
            raise SettingsError("broker_expiry_s must be positive")
        if not self.scan_interval_s > 0:
            raise SettingsError("scan_interval_s must be positive")
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
    heartbeat_timeout_s: float = 3.0
    #: how long a master may acknowledge writes no in-sync slave confirmed, after a
    #: heartbeat the controller answered (shorter than heartbeat_timeout_s)
    lease_s: float = 2.0
    #: a master whose connection closed gets this long to come back before an election
    reconnect_grace_s: float = 0.6

    def __post_init__(self) -> None:
        if isinstance(self.store, str):
            object.__setattr__(self, "store", Path(self.store))
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"port {self.port} is not between 0 and 65535")
        if not 0 < self.lease_s < self.heartbeat_timeout_s:
            raise SettingsError("lease_s must be positive and shorter than heartbeat_timeout_s")
        if not self.reconnect_grace_s >= 0:
            raise SettingsError("reconnect_grace_s must not be negative")
        super().__post_init__()

    def timings(self) -> ControllerTimings:
        return ControllerTimings(
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            lease_s=self.lease_s,
            reconnect_grace_s=self.reconnect_grace_s,
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
