"""A broker's part in its broker set: its role, its HA port, following a master, and (under a
controller) taking the role the controller gives.

Every broker opens an HA port (``ha_port``, default the client port + 1): slaves copy the
master's commit log from it.  Without a controller, broker id 0 is the master (ASYNC_MASTER,
or SYNC_MASTER with ``replication = "sync"``) and any other id a slave, for good.  With
``controller`` set, every replica starts with no role and heartbeats to the controller
(``broker/ha/controlled.py``), which elects the master and tells the others whom to follow;
the master registers with the name servers as id 0 (as in RocketMQ 5), a slave under its
own id (a slave whose own id is 0 under the id its master has in its own configuration).
A slave's store takes replicated bytes only: sends to it answer NOT_MASTER, pulls are served
from its own consume queues.  The pieces are in ``broker/ha/``; this module joins them to the
broker's tables.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Protocol

import anyio
import anyio.abc
import msgspec
from anyio.abc import SocketAttribute

from txmq.broker.delivery.schedule import ScheduleMessageService
from txmq.broker.ha.controlled import ControllerLink
from txmq.broker.ha.epochs import EpochLog
from txmq.broker.ha.master import HaService
from txmq.broker.ha.metadata import Metadata
from txmq.broker.ha.role import Role
from txmq.broker.ha.slave import HaClient
from txmq.broker.state.config import BrokerConfig
from txmq.broker.state.context import BrokerContext
from txmq.broker.state.topics import has_queue
from txmq.broker.transactions.service import TransactionService
from txmq.protocol.peer import ask_controller
from txmq.protocol.rpc import Gate
from txmq.protocol.wire import ControllerAnswer, ControllerHeartbeat
from txmq.protocol.wire.errors import TxmqError
from txmq.server.serving import Acceptor

__all__ = ["MasterDuties", "Replication", "physical_memory"]

log = logging.getLogger("txmq.broker.ha")

#: the id a slave registers under while its own is 0 and its master is not known
UNKNOWN_SLOT = 1024
#: without a controller, a slave that cannot reach its master asks the name servers where
#: the master is (a registration) this often
REDISCOVER_S = 2.0


def physical_memory() -> int:
    """The machine's memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class MasterDuties(Protocol):
    """What only a master runs (the schedule, the transaction check-back)."""

    async def became_master(self) -> None: ...
    async def became_slave(self) -> None: ...


class Replication:
    def __init__(
        self,
        config: BrokerConfig,
        ctx: BrokerContext,
        schedule: ScheduleMessageService,
        transactions: TransactionService,
        address: Callable[[], str],
        duties: MasterDuties,
        *,
        guard: Gate | None = None,
        on_change: Callable[[], object] = lambda: None,
        rediscover: Callable[[], object] = lambda: None,
    ) -> None:
        """``guard``: the broker's access control (its HA port's too); ``on_change``: told
        when this broker's role or registered id changed (the registration);
        ``rediscover``: register with the name servers now (their answer names the set's
        master)."""
        self.config = config
        self.ctx = ctx
        self.store = ctx.store
        self.duties = duties
        self._address = address
        self.epochs = EpochLog(config.store / "config" / "epochs.json")
        controlled = bool(config.controller_addresses)
        self.role = Role(
            replication=config.replication,
            is_master=not controlled and config.broker_id == 0,
            epoch=self.epochs.last.epoch,
            controlled=controlled,
        )
        self.metadata = Metadata(ctx, schedule, transactions)
        self.link: ControllerLink | None = None
        if controlled:
            self.link = ControllerLink(
                config.controller_addresses,
                config.controller_heartbeat_interval_s,
                self._heartbeat,
                self._apply,
                security=config.peer_security(),
            )
        self.service = HaService(
            ctx.store,
            self.role,
            self.epochs,
            self.metadata.take,
            in_sync_lag_s=config.ha_in_sync_lag_s,
            take_offsets=self._take_offsets,
            on_caught_up=self.link.poke if self.link is not None else lambda: None,
            guard=guard,
        )
        self.client = HaClient(
            ctx.store,
            self.epochs,
            broker_name=config.broker_name,
            broker_id=config.broker_id,
            master=config.ha_master_address if not controlled else "",
            metadata_interval_s=config.ha_metadata_sync_interval_s,
            notify=ctx.arrivals.notify,
            apply_metadata=self.metadata.apply,
            address=address,
            pending_offsets=ctx.offsets.pending,
            security=config.peer_security(),
        )
        self.acceptor = Acceptor(
            self.service.router.handle,
            max_frame_size=config.max_frame_size,
            limits=config.connection_limits(),
            log_to="txmq.broker.ha",
            tls=config.server_ssl_context(),
        )
        ctx.topics.on_change.append(self._metadata_changed)
        ctx.topics.on_delete.append(self._metadata_changed)
        self.ha_port = 0
        self.store.writable = self.role.is_master
        ctx.acks.gate = self
        ctx.replica = self
        #: a reader this far behind the log's end reads what the master no longer has in
        #: memory: its pull answer sends it to a slave (RocketMQ's
        #: accessMessageInMemoryMaxRatio of the machine's memory)
        self.slow_read_bytes = int(config.access_message_in_memory_max_ratio * physical_memory())
        self.on_change = on_change
        #: set when another broker is the master (a clean stop waits for it)
        self._successor = anyio.Event()
        self.rediscover = rediscover

    @property
    def ha_address(self) -> str:
        host = (self.config.advertised_address or self.config.host).rpartition(":")[0]
        host = host or self.config.host
        return f"{host}:{self.ha_port}"

    def _metadata_changed(self, _: object) -> None:
        if self.role.is_master:
            self.service.meta_version += 1

    @property
    def registered_id(self) -> int:
        """The id this broker registers under with the name servers: 0 as the master."""
        if self.role.is_master:
            return 0
        own = self.config.broker_id
        if own:
            return own
        return self.role.master_id if self.role.master_id > 0 else UNKNOWN_SLOT

    # -- what the pulls ask (broker.context.ReplicaView) ----------------------------------

    def is_master(self) -> bool:
        return self.role.is_master

    def read_from(self, behind: int) -> int:
        """Where a reader ``behind`` bytes before the log's end pulls next: 0 the master, 1 a
        slave (RocketMQ's suggestWhichBrokerId)."""
        slow = behind > self.slow_read_bytes
        if self.role.is_master:
            return 1 if slow and self.service.slaves else 0
        return 1 if slow else 0  # a slave sends a reader that caught up back to the master

    def committable(self, group: str, topic: str, queue_id: int) -> bool:
        """Whether a consumer offset may be kept here (a group, a queue this broker has)."""
        return bool(group) and has_queue(self.ctx.topics, topic, queue_id)

    def _take_offsets(self, offsets: dict[str, dict[str, dict[int, int]]]) -> None:
        taken = self.ctx.offsets.commit_larger(offsets, self.committable)
        if taken:
            log.info("took %d consumer offset(s) a slave kept while this broker was away", taken)

    # -- the gate of acknowledgements (broker.context.ReplicationGate) ---------------------

    def may_acknowledge(self, confirmed: bool = False) -> bool:
        return self.role.may_acknowledge(confirmed)

    def sync_replication(self) -> bool:
        return self.role.is_master and self.role.replication == "sync"

    def when_copied(
        self, end_offset: int, done: Callable[[str], None], timeout_s: float
    ) -> str | None:
        return self.service.when_copied(end_offset, done, timeout_s)

    # -- running ----------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        listener = await self._listen()
        self.ha_port = listener.extra(SocketAttribute.local_port)
        self.service.bind()
        async with listener, anyio.create_task_group() as tg:
            self.acceptor.serve(listener, tg)
            tg.start_soon(self.client.run)
            log.info(
                "%s of broker set %s (id %d), HA port %s",
                "under controller " + ";".join(self.config.controller_addresses)
                if self.link is not None
                else self.role.name.value,
                self.config.broker_name,
                self.config.broker_id,
                self.ha_address,
            )
            if self.link is not None:
                tg.start_soon(self.link.run)
            else:
                tg.start_soon(self._rediscover_loop)
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

    async def _rediscover_loop(self) -> None:
        """A slave whose master is unreachable (it may have come back elsewhere) asks the
        name servers every REDISCOVER_S seconds rather than at the next registration."""
        while True:
            await anyio.sleep(REDISCOVER_S)
            if not self.role.is_master and not self.client.connected:
                self.rediscover()

    def registered(self, master_address: str, master_ha_address: str) -> None:
        """What a name server answered this broker's registration: its set's master."""
        if not self.role.is_master and master_ha_address and not self.role.controlled:
            self.role.master_address = master_address
            self.client.follow(master_ha_address)

    # -- under a controller -----------------------------------------------------------------

    def _heartbeat(self) -> ControllerHeartbeat:
        role, cfg = self.role, self.config
        if role.is_master:
            role.proposed = self.service.propose()
        return ControllerHeartbeat(
            cluster=cfg.cluster,
            broker_name=cfg.broker_name,
            broker_id=cfg.broker_id,
            address=self._address(),
            ha_address=self.ha_address,
            offset=self.store.commit_log_max_offset,
            epoch=self.epochs.last.epoch,
            master=role.is_master,
            following=self.client.following,
            master_silent_ms=self.client.silent_ms(),
            in_sync=sorted(role.proposed) if role.is_master else [],
            handing_over=role.handing_over,
        )

    async def _apply(self, answer: ControllerAnswer, sent_at: float) -> None:
        """Take the role the controller's answer gives (``sent_at``: when the heartbeat it
        answers was sent, the start of a master's lease)."""
        role = self.role
        before = (role.is_master, self.registered_id)
        changed = False
        if answer.electing:
            if role.is_master:
                await self._demote("an election runs", step_down=True)
                changed = True
            if self.client.following:
                await self.client.stop()
                changed = True
        elif answer.master_id == self.config.broker_id:
            if role.in_sync != (approved := frozenset(answer.in_sync)):
                role.in_sync = approved
                self.service.recheck()
            if answer.lease_ms:
                role.lease_s = answer.lease_ms / 1000
                role.renew(sent_at)
            if not role.is_master or role.epoch != answer.epoch:
                await self._promote(answer)
                changed = True
        elif answer.master_id >= 0:
            role.master_id = answer.master_id
            role.master_address = answer.master_address
            if role.is_master:
                await self._demote(
                    f"broker {answer.master_id} is the master of epoch {answer.epoch}"
                )
                changed = True
            role.stepped_down = False
            role.epoch = max(role.epoch, answer.epoch)
            self.client.follow(answer.master_ha_address, answer.epoch)
            self._successor.set()
        if changed and self.link is not None:
            self.link.poke()  # tell the controller at once
        if (role.is_master, self.registered_id) != before:
            self.on_change()

    async def _promote(self, answer: ControllerAnswer) -> None:
        role = self.role
        await self.client.stop()  # no replicated append runs or starts from here on
        end = self.store.commit_log_max_offset
        self.epochs.begin(answer.epoch, end)
        role.epoch = answer.epoch
        role.master_id = self.config.broker_id
        role.in_sync = role.proposed = frozenset(answer.in_sync)
        # every write up to here may have been acknowledged by the old master: the sync
        # state set keeps a slave that has it all
        self.service.confirmed_end = end
        self.service.promoted_at = time.monotonic()
        self.store.writable = True
        role.is_master, role.stepped_down = True, False
        log.warning(
            "now the %s of broker set %s in epoch %d (log ends at %d; in sync: %s)",
            role.name.value,
            self.config.broker_name,
            answer.epoch,
            end,
            sorted(answer.in_sync) or "none",
        )
        await self.duties.became_master()

    async def _demote(self, why: str, *, step_down: bool = False) -> None:
        """No longer the master (``step_down``: an election runs; go on serving the log
        to the slaves until told whom to follow)."""
        role = self.role
        role.is_master, role.stepped_down = False, step_down
        self.store.writable = False
        self.service.drop_waiters()
        role.in_sync = role.proposed = frozenset()
        role.lease_until = 0.0
        log.warning("no longer the master of broker set %s: %s", self.config.broker_name, why)
        await self.duties.became_slave()

    async def hand_over(self, timeout_s: float = 5.0) -> None:
        """A clean stop of a master under a controller: stop acknowledging and hand the
        role to the best in-sync slave (a switchover: it copies what it lacks first), so
        that sends move at once rather than after an election."""
        if self.link is None or not self.role.is_master or not self.role.in_sync:
            return
        self.role.handing_over = True
        await self._demote("stopping: handing the role over", step_down=True)
        self._successor = anyio.Event()
        self.link.poke()
        with anyio.move_on_after(timeout_s):
            await self._successor.wait()
            log.info("handed the master's role to broker %d", self.role.master_id)
            return
        log.warning("stopping without a successor in %g s (none could take the role)", timeout_s)

    async def leave(self) -> None:
        """A clean stop: tell the controller this replica is gone (it is not chosen, nor
        waited for, in an election)."""
        if self.link is None:
            return
        try:
            leaving = msgspec.structs.replace(self._heartbeat(), leaving=True)
            await ask_controller(
                self.config.controller_addresses,
                leaving,
                1.0,
                security=self.config.peer_security(),
            )
        except TxmqError:
            pass

    # -- what admin shows ---------------------------------------------------------------------

    def describe(self) -> dict[str, object]:
        role = self.role
        out: dict[str, object] = {
            "role": role.name.value,
            "epoch": role.epoch,
            "ha_address": self.ha_address,
            "controlled": role.controlled,
        }
        if role.is_master:
            out["slaves"] = {
                str(i): {"lag_bytes": b, "lag_s": round(s, 1)}
                for i, (b, s) in sorted(self.service.lag().items())
            }
            out["in_sync"] = sorted(role.in_sync) if role.controlled else self.service.in_sync()
        else:
            out["master"] = self.client.master
            out["connected"] = self.client.connected
            out["lag_bytes"] = self.client.lag_bytes()
            contact = self.client.last_contact
            out["last_contact_s"] = round(time.monotonic() - contact, 1) if contact else -1
        return out
