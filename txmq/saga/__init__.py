"""Sagas across services, on transactional messages and SQLAlchemy.

A saga (:class:`Saga`) is a named, ordered list of steps (:class:`Step`), each an action in
one participant service and optionally its compensation.  The service that starts a saga
runs its :class:`Coordinator`: the saga's state lives in that service's database
(``txmq_sagas``, ``txmq_saga_steps``), and each change of it commits together with the
command it causes, as a transactional message.  Each participant service runs a
:class:`Participant`: an action or compensation runs behind the barrier
(``txmq_saga_barrier``) in the participant's local transaction, and its reply commits with
it.  A refusal (:class:`Refuse`) or a step out of retries compensates the steps that took
effect, in reverse order; a compensation out of retries parks the saga for an operator
(:meth:`Coordinator.retry`, :meth:`Coordinator.resolve`).  :func:`tcc` makes a TCC
transaction of the same parts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from txmq.saga.barrier import Entry
    from txmq.saga.coordinator import Coordinator, Ended, SagaStart
    from txmq.saga.model import Refuse, Saga, State, Step, command_topic, reply_topic, tcc
    from txmq.saga.operate import operate
    from txmq.saga.participant import NoHandler, Participant
    from txmq.saga.views import SagaInfo, StepEntry, list_sagas, saga_info

__all__ = [
    "Coordinator",
    "Ended",
    "Entry",
    "NoHandler",
    "Participant",
    "Refuse",
    "Saga",
    "SagaInfo",
    "SagaStart",
    "State",
    "Step",
    "StepEntry",
    "command_topic",
    "list_sagas",
    "operate",
    "reply_topic",
    "saga_info",
    "tcc",
]

#: where each name lives: imported when first used (SQLAlchemy is heavy, and the CLI needs
#: only the model to build its parser)
_HOMES = {
    "Entry": "barrier",
    "Coordinator": "coordinator",
    "Ended": "coordinator",
    "SagaStart": "coordinator",
    "Refuse": "model",
    "Saga": "model",
    "State": "model",
    "Step": "model",
    "command_topic": "model",
    "reply_topic": "model",
    "tcc": "model",
    "operate": "operate",
    "NoHandler": "participant",
    "Participant": "participant",
    "SagaInfo": "views",
    "StepEntry": "views",
    "list_sagas": "views",
    "saga_info": "views",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'txmq.saga' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"txmq.saga.{home}"), name)
    globals()[name] = value
    return value
