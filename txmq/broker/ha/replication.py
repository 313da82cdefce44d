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
import time
from collections.abc import Callable
from typing import Protocol

import anyio
import anyio.abc
import msgspec
from anyio.abc import SocketAttribute

from txmq.broker.delivery.schedule import ScheduleMessageService
from txmq.broker.ha.controlled import ControllerLink
from txmq.broker.ha.metadata import Metadata
from txmq.broker.ha.replica import Replica
from txmq.broker.ha.slave import HaClient
from txmq.broker.state.config import BrokerConfig
from txmq.broker.state.context import BrokerContext
from txmq.broker.transactions.service import TransactionService
from txmq.protocol.peer import ask_controller
from txmq.protocol.wire import ControllerAnswer, ControllerHeartbeat
from txmq.protocol.wire.errors import TxmqError
from txmq.server.serving import Acceptor

__all__ = ["MasterDuties", "Replication"]

log = logging.getLogger("txmq.broker.ha")

#: the id a slave registers under while its own is 0 and its master is not known
UNKNOWN_SLOT = 1024
#: without a controller, a slave that cannot reach its master asks the name servers where
#: the master is (a registration) this often
REDISCOVER_S = 2.0
#: under a controller, a slave that reaches neither its master nor any controller asks them
#: this often (a master of a newer epoch may have been elected without it)
ORPHAN_REDISCOVER_S = 0.5
#: a slave whose master has not answered for this long (an idle master answers every
#: second) heartbeats to the controller as often as during an election
MASTER_LOST_S = 1.5


class MasterDuties(Protocol):
    """What only a master runs (the schedule, the transaction check-back)."""

    async def became_master(self) -> None: ...
    async def became_slave(self) -> None: ...


class Replication:
    def __init__(
        self,
        config: BrokerConfig,
        ctx: BrokerContext,
        replica: Replica,
        schedule: ScheduleMessageService,
        transactions: TransactionService,
        address: Callable[[], str],
        duties: MasterDuties,
        *,
        on_change: Callable[[], object] = lambda: None,
        rediscover: Callable[[], object] = lambda: None,
    ) -> None:
        """``replica``: this broker's role, epochs and HA service (built before ``ctx``,
        which holds it); ``on_change``: told when this broker's role or registered id
        changed (the registration); ``rediscover``: register with the name servers now
        (their answer names the set's master)."""
        self.config = config
        self.ctx = ctx
        self.store = ctx.store
        self.duties = duties
        self._address = address
        self.replica = replica
        self.epochs = replica.epochs
        self.role = replica.role
        self.service = replica.service
        self.metadata = Metadata(ctx, schedule, transactions)
        self.link: ControllerLink | None = None
        if self.role.controlled:
            self.link = ControllerLink(
                config.controller_addresses,
                config.controller_heartbeat_interval_s,
                self._heartbeat,
                self._apply,
                security=config.peer_security(),
                urgent=self._master_lost,
            )
        self.client = HaClient(
            ctx.store,
            self.epochs,
            broker_name=config.broker_name,
            broker_id=config.broker_id,
            master=config.ha_master_address if not self.role.controlled else "",
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
        self.on_change = on_change
        #: set when another broker is the master (a clean stop waits for it)
        self._successor = anyio.Event()
        self.rediscover = rediscover

    def _master_lost(self) -> bool:
        """A slave that lost its master (not connected, or no answer for MASTER_LOST_S):
        the controller is about to fence it and waits for its report."""
        if self.role.is_master or not self.client.master:
            return False
        return not self.client.connected or self.client.silent_ms() > MASTER_LOST_S * 1000

    def caught_up(self) -> None:
        """Under a controller: a slave outside the proposed sync state set caught up (the
        controller hears at once)."""
        if self.link is not None:
            self.link.poke()

    @property
    def ha_address(self) -> str:
        """Where slaves reach this broker's HA port: ha_advertised_address, else the
        advertised host (or ``host``) and the bound HA port."""
        if self.config.ha_advertised_address:
            return self.config.ha_advertised_address
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
        name servers every REDISCOVER_S seconds rather than at the next registration;
        under a controller only while no controller answers either (ORPHAN_REDISCOVER_S)."""
        link = self.link
        while True:
            await anyio.sleep(REDISCOVER_S if link is None else ORPHAN_REDISCOVER_S)
            if self.role.is_master or self.client.connected:
                continue
            if link is None or link.failing:
                self.rediscover()

    def registered(self, master_address: str, master_ha_address: str) -> None:
        """What a name server answered this broker's registration: its set's master.

        Under a controller the controller says whom to follow, except when no controller
        answers and the master followed is gone: then a slave follows the master the name
        servers name, if it is another broker and only once it says it is the master of a
        newer epoch than this slave knows (so never the deposed master, whose epoch it
        knows; the master cuts back whatever tail of this slave's log it never had, as
        after any election).  A slave cut from the controllers while its master died
        would else wait for its link to heal, and the new master, under all_ack, for it."""
        role = self.role
        if role.is_master or not master_ha_address:
            return
        if not role.controlled:
            role.master_address = master_address
            self.client.follow(master_ha_address)
            return
        link = self.link
        if (
            link is None
            or not link.failing
            or self.client.connected
            or master_ha_address in (self.client.master, self.ha_address)
        ):
            return
        log.warning(
            "no controller answers and master %s is gone: following %s, which the name "
            "servers name, once it is the master of an epoch after %d",
            self.client.master or "(none)",
            master_ha_address,
            role.epoch,
        )
        role.master_address = master_address
        self.client.follow(master_ha_address, role.epoch + 1)

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
            all_ack=role.is_master and role.all_ack and role.replication == "sync",
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
