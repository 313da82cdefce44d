"""The seam between the client core and its transports: what the core needs of a transport
(reach a broker with typed requests, hear the requests a broker sends back, consume without
pulls where a protocol has none) and how it finds one by name.

Transports are found through the ``txmq.transports`` entry points of the installed
distributions (txmq declares ``txmq``, ``grpc`` and ``loopback``); the core names none of
their modules.  A transport is an object with the attributes of :class:`Transport`; its
:meth:`~Transport.remote` makes a :class:`Remote` per broker (or name server) address.

A client's push consumer consumes by pulling wherever the transport carries txmq's whole
protocol; over a transport that has no pulls (RocketMQ 5's gRPC protocol) the broker's
remote is a :class:`Receives` and the consumer hands the work to its :class:`Receiver`,
seen by the transport as a :class:`Consuming`.
"""

from __future__ import annotations

import enum
import functools
import importlib.util
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import anyio.abc

from txmq.protocol.message import MessageExt
from txmq.protocol.wire import Heartbeat, Request, Response, WithBody
from txmq.protocol.wire.base import R

if TYPE_CHECKING:
    from txmq.security.client import ClientSecurity

__all__ = [
    "ENTRY_POINTS",
    "Calls",
    "ClientSide",
    "ConsumeResult",
    "Consuming",
    "Receiver",
    "Receives",
    "Remote",
    "Serve",
    "Transport",
    "known",
    "names",
    "require",
    "transport",
]

#: the entry-point group transports are registered under
ENTRY_POINTS = "txmq.transports"


class Calls(Protocol):
    """Whatever answers txmq's typed requests: a connection, a broker (:class:`Remote`)."""

    async def call(
        self, request: Request[R], body: bytes = b"", *, timeout: float = 3.0
    ) -> WithBody[R]: ...


class Remote(Calls, Protocol):
    """One broker (or name server) as the client core sees it."""

    @property
    def address(self) -> str: ...

    def attach(self, tg: anyio.abc.TaskGroup) -> None:
        """Run background work (connections, streams) in the client's task group."""
        ...

    def detach(self) -> None:
        """Close (after what is queued is written) and forget the task group."""
        ...

    async def connection(self) -> object:
        """Connect now (if not connected) or raise :class:`BrokerUnavailable`."""
        ...

    async def send_oneway(self, request: Request[Any], body: bytes = b"") -> None: ...


#: a request a broker sent the client (a check-back, a rebalance notice), its body, and
#: what answers it; returns the answer (None: none, or a oneway request)
Serve = Callable[[Request[Any], bytes, Calls], Response | None]


@dataclass(frozen=True)
class ClientSide:
    """What a transport's remotes need of the client that owns them."""

    #: the client's id
    client_id: Callable[[], str]
    #: the heartbeat the client sends (None: it sends none, a plain producer): its consumer
    #: group and subscriptions, or its producer group; sent first on every new connection
    heartbeat: Callable[[], Heartbeat | None]
    #: topics the client declared it publishes (besides those it sends to)
    topics: Callable[[], Sequence[str]]
    #: requests the broker sends the client (UnsupportedRequest: not one it serves)
    serve: Serve
    connect_timeout: float
    max_frame_size: int
    #: TLS and credentials (None: plaintext, unsigned)
    security: ClientSecurity | None


@runtime_checkable
class Transport(Protocol):
    """A way to reach brokers.  Its remotes take txmq's typed requests whatever they turn
    them into on their way."""

    #: the name clients and ``$TXMQ_TRANSPORT`` give it
    name: str
    #: carries every txmq request (pulls, queue locks, admin requests); a transport that
    #: does not (RocketMQ 5's gRPC protocol) serves producers and push consumers only
    full_protocol: bool
    #: one endpoint that routes itself: clients give its address, never name servers
    routes_itself: bool
    #: where its clients go when no address is given (None: as txmq's own protocol)
    default_address: str | None

    def check(self) -> None:
        """Raise ImportError naming what to install if this transport cannot run here."""
        ...

    def remote(self, address: str, side: ClientSide) -> Remote:
        """The remote of one broker (or name server) address."""
        ...


# -- consuming where a protocol has no pulls ------------------------------------------------


class ConsumeResult(enum.Enum):
    """What became of a message given to a listener."""

    SUCCESS = "CONSUME_SUCCESS"
    RECONSUME_LATER = "RECONSUME_LATER"
    #: straight to ``%DLQ%<group>``, no retries (txmq's own)
    DEAD_LETTER = "DEAD_LETTER"


class Consuming(Protocol):
    """What a receiving transport needs of the push consumer it receives for."""

    @property
    def group(self) -> str: ...

    @property
    def client_id(self) -> str: ...

    @property
    def subscriptions(self) -> Mapping[str, str]: ...

    @property
    def request_timeout(self) -> float: ...

    @property
    def invisible_time(self) -> float: ...

    @property
    def pull_batch_size(self) -> int: ...

    @property
    def consume_concurrency(self) -> int: ...

    @property
    def long_poll(self) -> float: ...

    @property
    def pull_delay_on_error(self) -> float: ...

    @property
    def rebalance_interval(self) -> float: ...

    def routed(self, topic: str, found: bool) -> None:
        """Whether a subscribed topic has a route (said once when it has none)."""
        ...

    def backlog(self) -> int:
        """How many messages wait for a consume worker."""
        ...

    def submit(self, job: Callable[[], Awaitable[None]]) -> None:
        """Run ``job`` on one of the consumer's workers (its concurrency)."""
        ...

    async def invoke(self, msg: MessageExt) -> tuple[ConsumeResult, str]:
        """Run the listener on ``msg``: its result, and why when not SUCCESS."""
        ...


class Receiver(Protocol):
    """A push consumer's consumption over a transport without pulls."""

    def start(self, tg: anyio.abc.TaskGroup) -> None: ...

    def stop(self) -> None: ...


@runtime_checkable
class Receives(Protocol):
    """A remote whose transport consumes by receiving."""

    def receiver(self, consumer: Consuming) -> Receiver: ...


# -- finding transports ---------------------------------------------------------------------


@functools.cache
def _registered() -> Mapping[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINTS)}


def names() -> list[str]:
    """The names of the transports installed."""
    return sorted(_registered())


def known() -> str:
    """The names of the transports installed, as an error message lists them."""
    return ", ".join(repr(n) for n in names()) or "none (is txmq installed?)"


@functools.cache
def transport(name: str) -> Transport:
    """The transport registered as ``name``.  ValueError for a name no distribution
    registers; ImportError (naming what to install) for one that cannot run here."""
    entry = _registered().get(name)
    if entry is None:
        raise ValueError(f"no transport is called {name!r}: the transports are {known()}")
    found = entry.load()
    if not isinstance(found, Transport):
        raise TypeError(f"the {ENTRY_POINTS} entry point {name!r} is not a transport: {found!r}")
    found.check()
    return found


def require(name: str, *modules: str) -> None:
    """ImportError unless every module in ``modules`` can be imported (for
    :meth:`Transport.check`: the extra ``name`` installs them)."""
    for module in modules:
        if importlib.util.find_spec(module.partition(".")[0]) is None:
            raise ImportError(
                f"transport={name!r} needs the txmq[{name}] extra ({module} is not "
                f"installed): pip install 'txmq[{name}]'"
            )
