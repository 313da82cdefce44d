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
(:meth:`Coordinator.retry`, :meth:`Coordinator.resolve`).
"""

from txmq.saga.barrier import Entry
from txmq.saga.coordinator import Coordinator, SagaStart
from txmq.saga.model import Refuse, Saga, State, Step, command_topic, reply_topic, tcc
from txmq.saga.participant import NoHandler, Participant
from txmq.saga.views import SagaInfo, StepEntry, list_sagas, saga_info

__all__ = [
    "Coordinator",
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
    "reply_topic",
    "saga_info",
    "tcc",
]
