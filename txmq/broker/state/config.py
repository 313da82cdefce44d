"""Broker settings: a frozen dataclass read from TOML ``[broker]`` and ``TXMQ_BROKER_*``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from txmq.broker.store import FlushMode, StoreConfig
from txmq.protocol.peer import parse_address, parse_namesrv
from txmq.protocol.settings import (
    DEFAULT_DELAY_LEVELS,
    SettingsError,
    load_settings,
    parse_delay_levels,
)
from txmq.security.client import ClientSecurity
from txmq.server.serving import ConnectionSettings

__all__ = ["DEFAULT_DELAY_LEVELS", "BrokerConfig", "parse_delay_levels"]


def _address_list(text: str, setting: str) -> tuple[str, ...]:
    """``"h1:p;h2:p"`` checked: SettingsError naming ``setting`` and the bad entry."""
    try:
        return parse_namesrv(text, setting=setting)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


@dataclass(frozen=True)
class BrokerConfig(ConnectionSettings):
    #: the folder of the broker's store (commit log, consume queues, index, state files),
    #: created if missing (RocketMQ's `storePathRootDir`)
    store: Path = Path("./txmq-store")
    #: the address the broker listens on (127.0.0.1: this machine only; 0.0.0.0: every
    #: interface, then give access control and TLS a thought)
    host: str = "127.0.0.1"
    #: the port clients, other brokers and the admin tools reach it on (0: any free port)
    #: (RocketMQ's `listenPort`)
    port: int = 10911
    #: name servers to register with, "h1:9876;h2:9876" (empty: the broker runs alone)
    #: (RocketMQ's `namesrvAddr`)
    namesrv: str = ""
    #: the cluster this broker belongs to (RocketMQ's `brokerClusterName`)
    cluster: str = "DefaultCluster"
    #: the broker set this broker belongs to, unique in the cluster (RocketMQ's `brokerName`)
    broker_name: str = "broker-a"
    #: this broker's id in its set: 0 the master, above 0 its slaves; under a controller
    #: only this replica's id (RocketMQ's `brokerId`)
    broker_id: int = 0
    #: as master: "async" (ASYNC_MASTER: acknowledge at once) or "sync" (SYNC_MASTER:
    #: acknowledge once a slave has the bytes) (RocketMQ's `brokerRole`)
    replication: str = "async"
    #: the port slaves copy the commit log from (-1: port + 1; 0: any free port)
    #: (RocketMQ's `haListenPort`)
    ha_port: int = -1
    #: a slave's master's HA address, HOST:PORT (default: what the name servers say)
    #: (RocketMQ's `haMasterAddress`)
    ha_master_address: str = ""
    #: the HA address, HOST:PORT, this broker tells its controller and name servers, which
    #: pass it on to the slaves that copy from it (default: the advertised host, else
    #: ``host``, and the bound HA port) — e.g. a proxy or a NAT in front of the HA port
    #: (RocketMQ's `brokerIP2`, with the port)
    ha_advertised_address: str = ""
    #: SYNC_MASTER: how long a write waits for a slave before it is answered
    #: FLUSH_SLAVE_TIMEOUT (RocketMQ's `syncFlushTimeout` bounds this wait as well as the
    #: disk's, 5 s there); keep it under the producers' send timeout (3 s by default), or
    #: they time out before the answer comes and never see FLUSH_SLAVE_TIMEOUT
    sync_replication_timeout_s: float = 2.0
    #: how often a slave copies topics, consumer offsets, delay and transaction offsets
    ha_metadata_sync_interval_s: float = 3.0
    #: a slave that had everything within this long counts as in sync
    #: (RocketMQ's `haMaxTimeSlaveNotCatchup`)
    ha_in_sync_lag_s: float = 15.0
    #: SYNC_MASTER under a controller: acknowledge a write once *every* slave of the sync
    #: state set has it (RocketMQ 5's `allAckInSyncStateSet`).  Then any reachable in-sync
    #: slave may be elected once the old master's lease ran out, without waiting for the
    #: others; a slave that lags is dropped from the set after about a second
    #: (sync_replication_timeout_s / 2), stalling sends meanwhile.  false: once *one* has it
    #: (about 10 % more throughput), and an election waits for every in-sync slave to
    #: report, however long one is cut off.  Without a controller a SYNC_MASTER waits for one
    all_ack_in_sync: bool = True
    #: a consumer reading this share of the machine's memory (or more) behind the commit
    #: log's end is sent to a slave (RocketMQ's `accessMessageInMemoryMaxRatio`, 40 %)
    access_message_in_memory_max_ratio: float = 0.40
    #: controllers to heartbeat to, "h1:9878;h2:9878" (empty: roles are fixed by broker_id);
    #: under a controller it decides which replica is the master (RocketMQ 5's controller
    #: mode), and broker_id is only this replica's id within its set
    #: (RocketMQ's `controllerAddr`)
    controller: str = ""
    #: how often a broker under a controller heartbeats to it
    #: (RocketMQ's `brokerHeartbeatInterval`)
    controller_heartbeat_interval_s: float = 0.5
    #: the address clients are told to use (default: host:port, the port actually bound)
    #: (RocketMQ's `brokerIP1`, with the port)
    advertised_address: str = ""
    #: RocketMQ 5's gRPC protocol (``apache.rocketmq.v2.MessagingService``, what the
    #: official clients speak) on this port, bound to ``host``; needs ``txmq[grpc]``.
    #: -1 (the default): port 8081, or off with a warning when 8081 is taken or the extra
    #: is missing; 0: off; any other port: that port, and the broker does not start
    #: without it (RocketMQ's `grpcServerPort`, of its proxy)
    grpc_port: int = -1
    #: Prometheus metrics (``GET /metrics``) on this port, bound to ``host``.  -1 (the
    #: default): port 5557 (the RocketMQ exporter's), or when it is taken the next free of
    #: 5558-5566, else any free port (a warning says which); 0: off; any other port: that
    #: port, and the broker does not start without it (RocketMQ's `metricsPromExporterPort`)
    metrics_port: int = -1
    #: the gRPC address clients are told to use (default: host:grpc port)
    grpc_advertised_address: str = ""
    #: how often a broker registers with its name servers
    #: (RocketMQ's `registerNameServerPeriod`: 30 s)
    register_interval_s: float = 30.0
    #: "async": a send is acknowledged once written, the commit log is flushed every
    #: flush_interval_ms; "sync": the acknowledgement waits for fsync (a group commit)
    #: (RocketMQ's `flushDiskType`)
    flush: FlushMode = FlushMode.ASYNC
    #: a send to a topic that does not exist creates it, with default_queue_nums queues
    #: (RocketMQ's `autoCreateTopicEnable`)
    auto_create_topic: bool = True
    #: the queues of a topic created without a count (RocketMQ's `defaultTopicQueueNums`)
    default_queue_nums: int = 4
    #: the largest message body a send may carry, in bytes (RocketMQ's `maxMessageSize`)
    max_message_size: int = 4 * 1024 * 1024
    #: the size of a commit-log segment file, in bytes (RocketMQ's `mappedFileSizeCommitLog`)
    segment_size: int = 256 * 1024 * 1024
    #: entries (20 bytes each) of a consume-queue file (RocketMQ's
    #: `mappedFileSizeConsumeQueue`, which counts bytes)
    cq_entries_per_file: int = 300_000
    #: ASYNC flush: how often the commit log is flushed to disk
    #: (RocketMQ's `flushIntervalCommitLog`)
    flush_interval_ms: int = 500
    #: SYNC flush: how long a send waits for its fsync before it is answered
    #: FLUSH_DISK_TIMEOUT (RocketMQ's `syncFlushTimeout`)
    sync_flush_timeout_s: float = 5.0
    #: commit-log segments older than this are deleted, with what only they hold
    #: (RocketMQ's `fileReservedTime`)
    retention_hours: float = 72.0
    #: refuse writes (answer DISK_FULL, retriable) while the disk holding the store is used
    #: over this share, before it is full; take them again once it is at most that
    #: (RocketMQ's `diskSpaceWarningLevelRatio`, 0.90).  1.0: only when a write fails for
    #: want of space
    disk_max_used_ratio: float = 0.90
    #: how often the broker looks at the disk's usage
    disk_check_interval_s: float = 1.0
    #: export each sealed commit-log segment as ``<store>/export/<segment>.parquet`` (in a
    #: child process, for the reconciliation jobs in ``spark/``); needs pyarrow
    export_segments: bool = True
    #: the longest a pull with no message to answer is held (long polling), whatever the
    #: consumer asks for
    long_polling_max_s: float = 30.0
    #: how often consumer offsets, delay-level and timer progress are saved to the store's
    #: state files (RocketMQ's `flushConsumerOffsetInterval`)
    offset_persist_interval_s: float = 5.0
    #: delay of each level (1-based) for delayed messages and consumer retries
    #: (RocketMQ's `messageDelayLevel`)
    message_delay_levels: str = DEFAULT_DELAY_LEVELS
    #: how far ahead a timer message (an exact delivery time) may be: 3 days (RocketMQ 5's
    #: `timerMaxDelaySec`; at most 30 days; keep the commit log's retention above it)
    timer_max_delay_s: int = 3 * 86_400
    #: a queue lock (orderly consumption) not renewed for this long may be taken by another
    #: (RocketMQ's `rocketmq.broker.rebalance.lockMaxLiveTime`)
    lock_expiry_s: float = 60.0
    #: a consumer or producer that sent no heartbeat for this long is dropped from its group
    #: (RocketMQ's `channelExpiredTimeout`)
    consumer_channel_expiry_s: float = 120.0
    #: how often the broker looks for half messages to check back with their producer group
    #: (RocketMQ's `transactionCheckInterval`)
    transaction_check_interval_s: float = 30.0
    #: a half message is not checked before it is this old (its CHECK_IMMUNITY_TIME_IN_SECONDS
    #: property overrides it) (RocketMQ's `transactionTimeOut`)
    transaction_timeout_s: float = 6.0
    #: a half message still undecided after this many checks is parked
    #: (RocketMQ's `transactionCheckMax`)
    transaction_check_max: int = 15
    #: a send of a message id (UNIQ_KEY) that a client stored this recently (same topic,
    #: same kind) is a retry: it is answered with the original's result and stores nothing
    #: (0: off).  2 minutes, NATS JetStream's duplicate window: a producer's whole retry
    #: horizon (3 attempts of 3 s) with a broker restart or a failover in between, and an
    #: outbox relay's resend after it was killed
    dedupe_window_s: float = 120.0
    #: at most this many ids remembered (about 75 bytes each: 37 MB at most); the newest
    #: half are always there — at this broker's top rate (~30,000 sends/s) 8 s of sends,
    #: the whole window up to ~2,000 sends/s
    dedupe_max_entries: int = 500_000
    #: this broker's own access key (a user of the ACL files of its name servers,
    #: controllers and master): what signs its registrations, heartbeats and replication.
    #: From [broker] of the TOML file or $TXMQ_BROKER_ACCESS_KEY, never the command line
    access_key: str = ""
    #: the secret key that goes with access_key ($TXMQ_BROKER_SECRET_KEY; never the
    #: command line)
    secret_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if bool(self.access_key) != bool(self.secret_key):
            raise SettingsError(
                "access_key and secret_key go together (TXMQ_BROKER_ACCESS_KEY and "
                "TXMQ_BROKER_SECRET_KEY): set both or neither"
            )
        if isinstance(self.store, str):  # BrokerConfig(store="/var/lib/txmq") in code
            object.__setattr__(self, "store", Path(self.store))
        if not isinstance(self.store, Path):
            raise SettingsError(f"store must be a path, not {type(self.store).__name__}")
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"port {self.port} is not between 0 and 65535")
        if not 1 <= self.default_queue_nums <= 1024:
            raise SettingsError("default_queue_nums must be between 1 and 1024")
        if self.max_message_size <= 0 or self.max_message_size + 65536 > self.max_frame_size:
            raise SettingsError(
                "max_message_size must be positive and at least 64 KiB below max_frame_size"
            )
        if self.segment_size < self.max_message_size + 4096:
            raise SettingsError(
                "segment_size must exceed max_message_size by at least 4096 bytes "
                "(a record never spans two segments)"
            )
        _ = self.delay_levels  # parsed once here: a bad value fails at start
        if not 1 <= self.timer_max_delay_s <= 30 * 86_400:
            raise SettingsError(
                f"timer_max_delay_s must be between 1 and 2592000 (30 days), "
                f"not {self.timer_max_delay_s}"
            )
        for name, value in (("cluster", self.cluster), ("broker_name", self.broker_name)):
            if not value or len(value) > 255 or any(c in value for c in "/\\;:% \t\n"):
                raise SettingsError(
                    f"{name} {value!r} must be 1-255 characters without spaces, "
                    "'/', ';', ':' or '%'"
                )
        if not 0 <= self.broker_id <= 1024:
            raise SettingsError("broker_id must be between 0 (the master) and 1024")
        if self.replication not in ("async", "sync"):
            raise SettingsError(
                f"replication must be 'async' (ASYNC_MASTER) or 'sync' (SYNC_MASTER), "
                f"not {self.replication!r}"
            )
        if not -1 <= self.ha_port <= 65535:
            raise SettingsError(f"ha_port {self.ha_port} is not between 0 and 65535 (-1: port + 1)")
        if not -1 <= self.grpc_port <= 65535:
            raise SettingsError(
                f"grpc_port {self.grpc_port} is not between 0 (off) and 65535 (-1: 8081 if free)"
            )
        if not -1 <= self.metrics_port <= 65535:
            raise SettingsError(
                f"metrics_port {self.metrics_port} is not between 0 (off) and 65535 "
                "(-1: 5557, or a free port when it is taken)"
            )
        if self.ha_master_address:
            try:
                parse_address(self.ha_master_address)
            except ValueError as exc:
                raise SettingsError(f"ha_master_address: {exc}") from None
        if self.ha_advertised_address:
            try:
                parse_address(self.ha_advertised_address)
            except ValueError as exc:
                raise SettingsError(f"ha_advertised_address: {exc}") from None
        for name in (
            "sync_replication_timeout_s",
            "ha_metadata_sync_interval_s",
            "ha_in_sync_lag_s",
        ):
            if not getattr(self, name) > 0:
                raise SettingsError(f"{name} must be positive")
        if not self.register_interval_s > 0:
            raise SettingsError("register_interval_s must be positive")
        _ = self.namesrv_addresses  # a bad name-server list fails at start
        _ = self.controller_addresses
        if not 0 <= self.access_message_in_memory_max_ratio <= 1:
            raise SettingsError("access_message_in_memory_max_ratio must be between 0 and 1")
        if not 0 < self.controller_heartbeat_interval_s <= 10:
            raise SettingsError("controller_heartbeat_interval_s must be above 0 and at most 10")
        if not self.lock_expiry_s > 0:
            raise SettingsError("lock_expiry_s must be positive")
        if not self.consumer_channel_expiry_s > 0:
            raise SettingsError("consumer_channel_expiry_s must be positive")
        if not self.transaction_check_interval_s > 0:
            raise SettingsError("transaction_check_interval_s must be positive")
        if not self.transaction_timeout_s >= 0:
            raise SettingsError("transaction_timeout_s must not be negative")
        if self.transaction_check_max < 1:
            raise SettingsError("transaction_check_max must be at least 1")
        if not self.idle_timeout_s > self.long_polling_max_s:
            raise SettingsError("idle_timeout_s must be longer than long_polling_max_s")
        if not 0 < self.disk_max_used_ratio <= 1:
            raise SettingsError(
                f"disk_max_used_ratio must be above 0 and at most 1 (0.9 is 90 %), "
                f"not {self.disk_max_used_ratio}"
            )
        if not self.disk_check_interval_s > 0:
            raise SettingsError("disk_check_interval_s must be positive")
        if not 0 <= self.dedupe_window_s <= 86_400:
            raise SettingsError(
                f"dedupe_window_s must be between 0 (off) and 86400 (a day), "
                f"not {self.dedupe_window_s}"
            )
        if not 1 <= self.dedupe_max_entries <= 100_000_000:
            raise SettingsError(
                f"dedupe_max_entries must be between 1 and 100000000, not {self.dedupe_max_entries}"
            )

    @cached_property
    def namesrv_addresses(self) -> tuple[str, ...]:
        """The name servers of :attr:`namesrv`, checked (empty: the broker runs alone)."""
        return _address_list(self.namesrv, "namesrv")

    @cached_property
    def controller_addresses(self) -> tuple[str, ...]:
        """The controllers of :attr:`controller`, checked (empty: no controller)."""
        return _address_list(self.controller, "controller")

    @cached_property
    def delay_levels(self) -> tuple[int, ...]:
        """:attr:`message_delay_levels` in milliseconds; index 0 is level 1."""
        return parse_delay_levels(self.message_delay_levels)

    @classmethod
    def load(
        cls,
        file: str | Path | None = None,
        *,
        env: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> BrokerConfig:
        return load_settings(
            cls,
            file=file,
            section="broker",
            env_prefix="TXMQ_BROKER_",
            env=env,
            overrides=overrides,
        )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def peer_security(self) -> ClientSecurity:
        """How this broker connects to other servers (its name servers, controllers, its
        master's HA port, other brokers): with TLS on (``tls_cert``), over TLS, checking
        them against ``tls_ca`` (else the system's authorities) and showing its own
        certificate to those that ask for one; else in plaintext."""
        return self._peer_security

    @cached_property
    def _peer_security(self) -> ClientSecurity:
        ak, sk = self.access_key or None, self.secret_key or None
        if self.tls_cert is None:
            return ClientSecurity(access_key=ak, secret_key=sk)
        return ClientSecurity(
            access_key=ak,
            secret_key=sk,
            tls=True,
            tls_ca=self.tls_ca,
            tls_cert=self.tls_cert,
            tls_key=self.tls_key,
        )

    def store_config(self) -> StoreConfig:
        return StoreConfig(
            root=self.store,
            segment_size=self.segment_size,
            cq_entries_per_file=self.cq_entries_per_file,
            flush_mode=self.flush,
            flush_interval_ms=self.flush_interval_ms,
            retention_hours=self.retention_hours,
            max_message_size=self.max_message_size,
            export_segments=self.export_segments,
            disk_max_used_ratio=self.disk_max_used_ratio,
        )
