"""Name-server settings: a frozen dataclass read from TOML ``[namesrv]`` and
``TXMQ_NAMESRV_*`` environment variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from txmq.serving import ConnectionSettings
from txmq.settings import SettingsError, load_settings

__all__ = ["NamesrvConfig"]


@dataclass(frozen=True)
class NamesrvConfig(ConnectionSettings):
    host: str = "127.0.0.1"
    #: RocketMQ's name-server port
    port: int = 9876
    #: a broker not heard from (no registration) for this long is dropped from the routes
    #: (RocketMQ: 120 s)
    broker_expiry_s: float = 120.0
    #: how often the name server looks for silent brokers (RocketMQ: 10 s)
    scan_interval_s: float = 10.0

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
