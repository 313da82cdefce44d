"""A broker's part in its broker set: its role, its HA port, and following a master.

Every broker opens an HA port (``ha_port``, default the client port + 1): slaves copy the
master's commit log from it.  Broker id 0 starts as the master (ASYNC_MASTER, or
SYNC_MASTER with ``replication = "sync"``), any other id as a slave; under a controller
the controller decides (``broker/ha/controlled.py``).  A slave's store takes replicated
bytes only: sends to it answer NOT_MASTER, pulls are served from its own consume queues.
The pieces are in ``broker/ha/``; this module joins them to the broker's tables.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import anyio
import anyio.abc
from anyio.abc import SocketAttribute

from txmq.broker.config import BrokerConfig
from txmq.broker.context import BrokerContext
from txmq.broker.ha.epochs import EpochLog
from txmq.broker.ha.master import HaService
from txmq.broker.ha.role import Role
from txmq.broker.ha.slave import HaClient
from txmq.broker.replica_metadata import Metadata
from txmq.broker.schedule import ScheduleMessageService
from txmq.broker.transaction import TransactionService
from txmq.serving import Acceptor

__all__ = ["Replication"]

log = logging.getLogger("txmq.broker.ha")


class Replication:
    def __init__(
        self,
        config: BrokerConfig,
        ctx: BrokerContext,
        schedule: ScheduleMessageService,
        transactions: TransactionService,
        address: Callable[[], str],
    ) -> None:
        self.config = config
        self.ctx = ctx
        self.store = ctx.store
        self.epochs = EpochLog(config.store / "config" / "epochs.json")
        self.role = Role(
            replication=config.replication,
            is_master=config.broker_id == 0,
            epoch=self.epochs.last.epoch,
        )
        self.metadata = Metadata(ctx, schedule, transactions)
        self.service = HaService(
            ctx.store,
            self.role,
            self.epochs,
            self.metadata.take,
            in_sync_lag_s=config.ha_in_sync_lag_s,
        )
        self.client = HaClient(
            ctx.store,
            self.epochs,
            broker_name=config.broker_name,
            broker_id=config.broker_id,
            master=config.ha_master_address,
            metadata_interval_s=config.ha_metadata_sync_interval_s,
            notify=ctx.arrivals.notify,
            apply_metadata=self.metadata.apply,
            address=address,
        )
        self.acceptor = Acceptor(
            self.service.router.handle,
            max_frame_size=config.max_frame_size,
            limits=config.connection_limits(),
            log_to="txmq.broker.ha",
        )
        self.ha_port = 0
        self.store.writable = self.role.is_master
        ctx.acks.gate = self
        self._client_scope: anyio.CancelScope | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    @property
    def ha_address(self) -> str:
        host = (self.config.advertised_address or self.config.host).rpartition(":")[0]
        host = host or self.config.host
        return f"{host}:{self.ha_port}"

    # -- the gate of acknowledgements (broker.context.ReplicationGate) ---------------------

    def may_acknowledge(self) -> bool:
        return self.role.may_acknowledge()

    def sync_replication(self) -> bool:
        return self.role.is_master and self.role.replication == "sync"

    def replicated_future(self, end_offset: int) -> asyncio.Future[None] | None:
        return self.service.replicated_future(end_offset)

    # -- running ----------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        listener = await self._listen()
        self.ha_port = listener.extra(SocketAttribute.local_port)
        self.service.bind()
        async with listener, anyio.create_task_group() as tg:
            self._tg = tg
            self.acceptor.serve(listener, tg)
            log.info(
                "%s of broker set %s (id %d), HA port %s",
                self.role.name.value,
                self.config.broker_name,
                self.config.broker_id,
                self.ha_address,
            )
            if not self.role.is_master:
                self._start_following()
            task_status.started()
            await anyio.sleep_forever()

    async def _listen(self) -> anyio.abc.Listener[anyio.abc.SocketStream]:
        cfg = self.config
        wanted = cfg.ha_port
        if wanted == -1:
            wanted = cfg.port + 1 if cfg.port else 0
        try:
            return await anyio.create_tcp_listener(
                local_host=cfg.host, local_port=wanted, reuse_port=False
            )
        except OSError as exc:
            if cfg.ha_port != -1:
                raise OSError(f"cannot open the HA port {cfg.host}:{wanted}: {exc}") from exc
            log.warning("the HA port %d (port + 1) is taken (%s): using a free one", wanted, exc)
            return await anyio.create_tcp_listener(
                local_host=cfg.host, local_port=0, reuse_port=False
            )

    def _start_following(self) -> None:
        assert self._tg is not None
        scope = self._client_scope = anyio.CancelScope()

        async def follow() -> None:
            with scope:
                await self.client.run()

        self._tg.start_soon(follow)

    def registered(self, master_address: str, master_ha_address: str) -> None:
        """What a name server answered this broker's registration: its set's master."""
        if not self.role.is_master and master_ha_address and not self.role.controlled:
            self.role.master_address = master_address
            self.client.follow(master_ha_address)

    # -- what admin shows ---------------------------------------------------------------------

    def describe(self) -> dict[str, object]:
        role = self.role
        out: dict[str, object] = {
            "role": role.name.value,
            "epoch": role.epoch,
            "ha_address": self.ha_address,
        }
        if role.is_master:
            out["slaves"] = {
                str(i): {"lag_bytes": b, "lag_s": round(s, 1)}
                for i, (b, s) in sorted(self.service.lag().items())
            }
            out["in_sync"] = self.service.in_sync()
        else:
            out["master"] = self.client.master
            out["connected"] = self.client.connected
            out["lag_bytes"] = self.client.lag_bytes()
            contact = self.client.last_contact
            out["last_contact_s"] = round(time.monotonic() - contact, 1) if contact else -1
        return out
