"""An operator's requests to a controller: its view of the broker sets
(:func:`replica_info`) and a planned switchover of a set's master (:func:`switchover`).

A controller runs inside a name server (``txmq namesrv start --controller-store``) or alone
(``txmq controller start``); callers give the addresses to try (the name servers are a good
guess), and the first one that hosts a controller answers.  An address that is down or
hosts no controller is passed over; when none answers, :class:`NoController` says why for
each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from txmq.protocol.peer import CONNECT_TIMEOUT_S, NoController, RemotingClient, ask_controller
from txmq.protocol.wire import (
    BrokerSetState,
    ControllerAnswer,
    ElectMaster,
    GetReplicaInfo,
    ReplicaInfo,
    ReplicaState,
)
from txmq.protocol.wire.errors import BrokerUnavailable, TxmqError, UnsupportedRequest
from txmq.security.client import ClientSecurity, client_security

__all__ = ["SwitchoverFailed", "SwitchoverResult", "replica_info", "switchover"]


class SwitchoverFailed(TxmqError):
    """The controller did not (or could not) make the broker asked for the master."""


@dataclass(frozen=True, slots=True)
class SwitchoverResult:
    controller: str
    broker_name: str
    #: the set's master (its own broker id) and epoch before and after
    old_master: int
    old_epoch: int
    master_id: int
    epoch: int
    master_address: str

    @property
    def changed(self) -> bool:
        return self.epoch != self.old_epoch or self.master_id != self.old_master


async def replica_info(
    addresses: Sequence[str],
    broker_name: str = "",
    timeout: float = 5.0,
    *,
    security: ClientSecurity | None = None,
) -> tuple[str, ReplicaInfo]:
    """The controller's view of every broker set (or only ``broker_name``): epoch, master,
    sync state set, each replica's state; and the controller's address (``security``: TLS
    and credentials; None: as a client's are, from ``$TXMQ_TLS``, ...
    :func:`txmq.security.client_security`)."""
    return await ask_controller(
        addresses,
        GetReplicaInfo(broker_name=broker_name),
        timeout,
        security=client_security(security),
    )


async def switchover(
    addresses: Sequence[str],
    broker_name: str,
    to: int = -1,
    *,
    timeout_s: float = 10.0,
    security: ClientSecurity | None = None,
    force: bool = False,
) -> SwitchoverResult:
    """Make broker ``to`` (its own id; -1: the best in-sync slave) the master of broker set
    ``broker_name``, once it has everything the current master wrote (the master stops
    acknowledging meanwhile; ``timeout_s`` bounds the wait).  ``force``: a failover waits
    for in-sync slaves that do not report — elect among those that did, accepting the
    loss of acknowledged writes only the silent ones may hold.  Raises
    :class:`NoController`, :class:`SwitchoverFailed` (with the reason: no such set or
    broker, not alive, an election runs, did not catch up in time), or ValueError."""
    if to < -1 or to > 1024:
        raise ValueError(f"--to {to}: a broker id is 0 to 1024")
    if not 0.1 <= timeout_s <= 600:
        raise ValueError(f"a switchover's time-out is 0.1 to 600 s, not {timeout_s:g}")
    security = client_security(security)
    controller, info = await replica_info(addresses, broker_name, security=security)
    state = next((s for s in info.sets if s.broker_name == broker_name), None)
    if state is None:
        _, every = await replica_info([controller], security=security)
        known = ", ".join(s.broker_name for s in every.sets) or "none"
        raise SwitchoverFailed(
            f"the controller at {controller} knows no broker set {broker_name!r} (known: {known})"
        )
    if force:
        if not state.electing:
            raise SwitchoverFailed(
                f"broker set {broker_name} has no failover under way: --force only ends one "
                "that waits for in-sync slaves that do not report"
            )
    else:
        _check(state, to)
    if to >= 0 and to == state.master_id and not force:  # nothing to do
        return _result(controller, state, state.master_id, state.epoch, state)
    request = ElectMaster(
        broker_name=broker_name, broker_id=to, timeout_ms=int(timeout_s * 1000), force=force
    )
    try:
        async with RemotingClient(
            controller, connect_timeout=CONNECT_TIMEOUT_S, security=security
        ) as client:
            answer: ControllerAnswer = (await client.call(request, timeout=timeout_s + 5)).header
    except UnsupportedRequest as exc:  # pragma: no cover - it answered GetReplicaInfo
        raise NoController(f"{controller} hosts no controller: {exc}") from None
    except BrokerUnavailable:
        raise
    except TxmqError as exc:
        raise SwitchoverFailed(f"broker set {broker_name}: switchover failed: {exc}") from None
    return _result(controller, state, answer.master_id, answer.epoch, answer=answer)


def _check(state: BrokerSetState, to: int) -> None:
    """A clear reason why ``to`` cannot be made the master of ``state`` now, if one."""
    name = state.broker_name
    if state.electing:
        raise SwitchoverFailed(
            f"broker set {name}: an election runs ({state.electing}); try again once it is over"
        )
    if to < 0:
        return
    replica: ReplicaState | None = next((r for r in state.replicas if r.broker_id == to), None)
    if replica is None:
        ids = ", ".join(str(r.broker_id) for r in state.replicas) or "none"
        raise SwitchoverFailed(
            f"broker {to} is not a replica of broker set {name} (the controller knows {ids})"
        )
    if not replica.alive:
        raise SwitchoverFailed(
            f"broker {to} of broker set {name} is not alive (the controller last heard from "
            f"it {replica.silent_s:g} s ago)"
        )


def _result(
    controller: str,
    before: BrokerSetState,
    master_id: int,
    epoch: int,
    state: BrokerSetState | None = None,
    answer: ControllerAnswer | None = None,
) -> SwitchoverResult:
    address = answer.master_address if answer is not None else ""
    if state is not None:
        address = next((r.address for r in state.replicas if r.broker_id == master_id), "")
    return SwitchoverResult(
        controller=controller,
        broker_name=before.broker_name,
        old_master=before.master_id,
        old_epoch=before.epoch,
        master_id=master_id,
        epoch=epoch,
        master_address=address,
    )
