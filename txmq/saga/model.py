"""What a saga is (its definition) and what its coordinator and participants say to each
other (commands and replies, JSON in message bodies)."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

__all__ = [
    "ACTION",
    "COMMAND_TOPIC",
    "COMPENSATION",
    "CONFIRM",
    "OPERATOR_GROUP",
    "REPLY_TOPIC",
    "Command",
    "Op",
    "Outcome",
    "Refuse",
    "Reply",
    "Saga",
    "State",
    "Step",
    "check_name",
    "command_topic",
    "reply_topic",
    "tcc",
]

Op = Literal["action", "compensation", "confirm"]
ACTION: Literal["action"] = "action"
COMPENSATION: Literal["compensation"] = "compensation"
#: TCC's second phase (try is the action, cancel the compensation)
CONFIRM: Literal["confirm"] = "confirm"
#: a participant's answer: the operation took effect (done), said no (refused: a business
#: refusal, nothing changed) or ran out of retries (failed: nothing changed); or the
#: coordinator's own deadline message: no answer in the step's time (timeout)
Outcome = Literal["done", "refused", "failed", "timeout"]

#: the producer group of an operator's command from outside the service (``txmq admin
#: sagas``, the console); the coordinating service's own group lets that service answer the
#: check-back should the operator's process stop half way
OPERATOR_GROUP = "txmq-saga-operator"
#: RocketMQ's delay levels reach 16 retries (the last one two hours after the first try)
MAX_RETRIES = 16
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class State:
    """A saga's states (``txmq_sagas.state``)."""

    RUNNING = "RUNNING"
    #: TCC: every try took effect; the confirms run
    CONFIRMING = "CONFIRMING"
    COMPENSATING = "COMPENSATING"
    PARKED = "PARKED"
    COMPLETED = "COMPLETED"
    COMPENSATED = "COMPENSATED"
    ENDED = frozenset({COMPLETED, COMPENSATED})
    ALL = (RUNNING, CONFIRMING, COMPENSATING, PARKED, COMPLETED, COMPENSATED)


class Refuse(Exception):
    """A participant's business "no" (out of stock, card declined): raise it (or return it)
    from a step's action; its writes are rolled back, and the saga compensates the steps
    before it."""

    def __init__(self, reason: str = "refused") -> None:
        super().__init__(reason)
        self.reason = reason


def check_name(what: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"{what} {name!r} must be 1 to 64 letters, digits, '-' or '_' (it names topics "
            "and barrier rows)"
        )
    return name


def check_retries(what: str, retries: int) -> int:
    if not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES:
        raise ValueError(f"{what} must be 0 to {MAX_RETRIES} (RocketMQ's delay levels)")
    return retries


@dataclass(frozen=True)
class Step:
    """One step of a saga: ``action``, run by the participant ``service``, and optionally
    its ``compensation`` there.  A failing action is retried ``retries`` times on the
    delay levels (10 s, 30 s, 1 min, …) before the saga compensates; a failing
    compensation (or confirm) ``compensation_retries`` times before the saga is parked
    for an operator.

    With ``confirm`` it is a TCC branch (see :func:`tcc`): the action is its try, the
    compensation its cancel, and ``confirm`` runs once every branch's try took effect.

    ``timeout`` (seconds): an action not answered by then is given up — the saga
    compensates it (its compensation undoes it if it took effect; the barrier makes it a
    no-op if it never did, and the late action too) and the steps before it.  The deadline
    is a delayed transactional message sent with the command and recalled by the answer."""

    action: str
    service: str
    compensation: str | None = None
    retries: int = 3
    compensation_retries: int = 5
    confirm: str | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        check_name("a step's action", self.action)
        check_name("a step's service", self.service)
        if self.compensation is not None:
            check_name("a step's compensation", self.compensation)
        if self.confirm is not None:
            check_name("a step's confirm", self.confirm)
        if self.timeout is not None:
            if not (isinstance(self.timeout, int | float) and self.timeout > 0):
                raise ValueError(f"step {self.action!r}: timeout must be a positive number of s")
            if self.compensation is None:
                raise ValueError(
                    f"step {self.action!r} has a timeout but no compensation: an action given "
                    "up on may still take effect, and only its compensation can undo it"
                )
        check_retries("retries", self.retries)
        check_retries("compensation_retries", self.compensation_retries)


@dataclass(frozen=True)
class Saga:
    """A named, ordered list of steps."""

    name: str
    steps: Sequence[Step] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        check_name("a saga's name", self.name)
        object.__setattr__(self, "steps", tuple(self.steps))
        if not self.steps:
            raise ValueError(f"saga {self.name!r} has no steps")
        branches = [s.action for s in self.steps]
        if len(set(branches)) != len(branches):
            raise ValueError(f"saga {self.name!r} names a step twice: {branches}")

    def to_dict(self) -> dict[str, Any]:
        """The definition as stored with each saga (``txmq_sagas.definition``): a running
        saga finishes as it started, whatever its service's code says by then."""
        return {"name": self.name, "steps": [dict(s) for s in self._steps_stored]}

    @functools.cached_property
    def _steps_stored(self) -> tuple[dict[str, Any], ...]:
        """The steps as stored, made once (``dataclasses.asdict`` is slow, and every saga
        started stores them)."""
        return tuple(dataclasses.asdict(s) for s in self.steps)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Saga:
        return cls(d["name"], [Step(**s) for s in d["steps"]])


COMMAND_TOPIC = "saga-{}"
REPLY_TOPIC = "saga-{}-replies"


def tcc(
    name: str,
    branches: Sequence[tuple[str, str, str, str]],
    *,
    retries: int = 3,
    confirm_retries: int = 5,
) -> Saga:
    """A TCC transaction: ``branches`` are (service, try, confirm, cancel) names.  Every
    branch's try runs (in order); when all took effect every confirm runs, else every try
    that took effect is cancelled (in reverse order).  Tries are retried ``retries`` times,
    confirms and cancels ``confirm_retries`` times before the transaction is parked."""
    return Saga(
        name,
        [
            Step(
                try_,
                service,
                compensation=cancel,
                confirm=confirm,
                retries=retries,
                compensation_retries=confirm_retries,
            )
            for service, try_, confirm, cancel in branches
        ],
    )


def command_topic(service: str) -> str:
    """The topic a participant service takes its commands from."""
    return COMMAND_TOPIC.format(service)


def reply_topic(service: str) -> str:
    """The topic a coordinating service takes its participants' replies from."""
    return REPLY_TOPIC.format(service)


class Command(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """What a coordinator asks of a participant: run ``handler`` (an action or a
    compensation) for step ``step`` (branch ``branch``) of saga ``saga_id``."""

    saga_id: str
    saga: str
    step: int
    #: the participant service that runs it
    service: str
    branch: str
    op: Op
    handler: str
    command_id: str
    data: dict[str, Any]
    reply_to: str
    retries: int
    #: when the coordinator sent it (ms since the epoch; the answer carries it back)
    sent_ms: int = 0


class Reply(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """A participant's answer to one command."""

    saga_id: str
    command_id: str
    step: int
    op: Op
    outcome: Outcome
    result: dict[str, Any] | None = None
    detail: str = ""
    attempts: int = 1
    #: the command's ``sent_ms``
    sent_ms: int = 0


encode = msgspec.json.Encoder().encode
decode_command = msgspec.json.Decoder(Command).decode
decode_reply = msgspec.json.Decoder(Reply).decode
