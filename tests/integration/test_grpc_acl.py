"""Access control on the broker's gRPC endpoint (RocketMQ 5's protocol), against a real
broker process: the official client signs with its credentials, txmq's grpc transport
too; unsigned, forged and stale calls are UNAUTHORIZED saying why; what a user may do is
decided by the same rules as on txmq's protocol (FORBIDDEN naming the right); a half's
check-backs reach only its sender's producers, and only its sender ends it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from rocketmq.grpc_protocol import TransactionResolution
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb
from rocketmq.grpc_protocol import service_pb2_grpc as spb_grpc
from rocketmq.v5.exception import ClientException

from tests.acl_support import SECRETS, as_user, policy
from tests.conftest import wait_for
from tests.grpc_support import (
    ClientConfiguration,
    Credentials,
    FilterExpression,
    GrpcBroker,
    Producer,
    SimpleConsumer,
    TransactionChecker,
    grpc_broker,
    make_message,
    receive_all,
    started,
)
from txmq import AuthenticationFailed, LocalTransactionState, Message, MessageExt, NoPermission
from txmq.security.credentials import Credentials as TxmqCredentials
from txmq.security.signing import authorization, signed_metadata
from txmq.sync import Producer as TxmqProducer
from txmq.sync import PushConsumer as TxmqPushConsumer
from txmq.sync import TransactionProducer as TxmqTransactionProducer

__all__ = ["grpc_broker"]  # the fixture

pytestmark = pytest.mark.timeout(120)

POLICY = policy(
    {
        "alice": [("topic:orders", "pub")],
        "bob": [("topic:orders", "sub"), ("group:billing", "sub")],
        "carol": [("topic:payments", "pub")],
        "mallory": [("topic:payments", "pub")],
    }
)


@pytest.fixture
def secured(tmp_path: Path, grpc_broker: Callable[..., GrpcBroker]) -> GrpcBroker:
    acl = tmp_path / "acl.toml"
    acl.write_text(POLICY)
    return grpc_broker(env={"TXMQ_BROKER_ACL_FILE": str(acl)})


def config(gb: GrpcBroker, user: str | None, secret: str | None = None) -> Any:
    """The official client's configuration as ``user`` (None: no credentials)."""
    if user is None:
        return ClientConfiguration(gb.endpoint, Credentials(), request_timeout=5)
    return ClientConfiguration(
        gb.endpoint, Credentials(user, secret or SECRETS[user]), request_timeout=5
    )


def client_log(caplog: pytest.LogCaptureFixture) -> str:
    """What the official client logged (where it reports a refused route query)."""
    return "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("rocketmq"))


def refused(call: Callable[[], Any]) -> ClientException:
    """The official client's error of ``call`` (it must fail)."""
    with pytest.raises(ClientException) as info:
        call()
    return info.value


@pytest.fixture
def stub(secured: GrpcBroker) -> Iterator[Any]:
    channel = grpc.insecure_channel(secured.endpoint)
    yield spb_grpc.MessagingServiceStub(channel)
    channel.close()


def signed(user: str, *, at: datetime | None = None, client: str = "raw") -> Any:
    """Metadata of a call signed by ``user`` at ``at`` (default: now)."""
    creds = TxmqCredentials(user, SECRETS[user])
    return (("x-mq-client-id", client), *signed_metadata(creds, at))


def route(topic: str) -> Any:
    return spb.QueryRouteRequest(topic=pb.Resource(name=topic))


def test_official_clients_with_credentials_send_and_receive(secured: GrpcBroker) -> None:
    with started(Producer(config(secured, "alice"), ("orders",))) as producer:
        receipts = [producer.send(make_message("orders", b"order %d" % i)) for i in range(3)]
    sub = {"orders": FilterExpression("*")}
    with started(SimpleConsumer(config(secured, "bob"), "billing", sub, await_duration=2)) as c:
        got = receive_all(c, 3)
        assert c.receive(32, 15) == []  # all acked
    assert sorted(m.message_id for m in got) == sorted(r.message_id for r in receipts)
    assert sorted(m.body for m in got) == [b"order 0", b"order 1", b"order 2"]


def test_unsigned_forged_and_unknown_callers_are_unauthorized(
    secured: GrpcBroker, caplog: pytest.LogCaptureFixture
) -> None:
    for cfg, cause in (
        (
            config(secured, None),
            "QueryRoute (gRPC) is not signed: this server requires credentials",
        ),
        (
            config(secured, "alice", "wrong-secret"),
            "QueryRoute (gRPC): the signature of 'alice' does not match",
        ),
        (
            ClientConfiguration(secured.endpoint, Credentials("eve", "eve-secret")),
            "QueryRoute (gRPC): unknown access key 'eve'",
        ),
    ):
        caplog.clear()
        with started(Producer(cfg, ("orders",))) as producer:
            # the official client logs the route's refusal and fails the send
            with pytest.raises(Exception, match="failed to fetch topic:orders route"):
                producer.send(make_message("orders", b"not allowed"))
        assert f"{pb.UNAUTHORIZED}, {cause}" in client_log(caplog)
    # nothing was stored, and the broker kept serving
    with started(Producer(config(secured, "alice"), ("orders",))) as producer:
        assert producer.send(make_message("orders", b"signed")).message_id
    sub = {"orders": FilterExpression("*")}
    with started(SimpleConsumer(config(secured, "ops"), "audit", sub, await_duration=2)) as c:
        assert [m.body for m in receive_all(c, 1)] == [b"signed"]
        assert c.receive(32, 15) == []
    log = secured.process.output()
    assert "refused a request from 127.0.0.1:" in log and "unknown access key 'eve'" in log


ALICE = TxmqCredentials("alice", SECRETS["alice"])


def test_stale_and_malformed_signatures_say_why(stub: Any) -> None:
    answer = stub.QueryRoute(route("orders"), metadata=signed("alice"))
    assert answer.status.code == pb.OK and answer.message_queues
    for at, word in (
        (datetime.now(UTC) - timedelta(minutes=5), "before"),
        (datetime.now(UTC) + timedelta(minutes=5), "after"),
    ):
        answer = stub.QueryRoute(route("orders"), metadata=signed("alice", at=at))
        assert answer.status.code == pb.UNAUTHORIZED
        assert f"s {word} this server's clock" in answer.status.message
        assert "QueryRoute (gRPC): signed at" in answer.status.message
    for metadata, cause in (
        ((), "QueryRoute (gRPC) is not signed"),
        ((("authorization", "Bearer abc"),), "unknown signature algorithm 'Bearer'"),
        ((("authorization", "MQv2-HMAC-SHA1 Credential=alice"),), "is malformed"),
        (
            (
                ("authorization", authorization(ALICE, "yesterday")),
                ("x-mq-date-time", "yesterday"),
            ),
            "'yesterday' is not a date-time",
        ),
    ):
        answer = stub.QueryRoute(route("orders"), metadata=metadata)
        assert answer.status.code == pb.UNAUTHORIZED, cause
        assert cause in answer.status.message
    # a stream is refused when it opens, with the same answer
    [command] = list(stub.Telemetry(iter(()), metadata=(("x-mq-client-id", "anonymous"),)))
    assert command.status.code == pb.UNAUTHORIZED
    assert "Telemetry (gRPC) is not signed" in command.status.message


def test_rights_are_the_same_as_on_txmqs_protocol(
    secured: GrpcBroker, stub: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with started(Producer(config(secured, "alice"), ("orders",))) as producer:
        producer.send(make_message("orders", b"for billing"))
        # no right at all on payments: not even its route
        with pytest.raises(Exception, match="failed to fetch topic:payments route"):
            producer.send(make_message("payments", b"not hers"))
    assert (
        f"{pb.FORBIDDEN}, QueryRoute (gRPC): user 'alice' has no 'pub' right on topic:payments"
        in client_log(caplog)
    )
    # bob consumes orders (so he has its route), but may not publish there
    with started(Producer(config(secured, "bob"), ("orders",))) as producer:
        error = refused(lambda: producer.send(make_message("orders", b"not his")))
    assert error.code == pb.FORBIDDEN
    assert "SendMessage (gRPC): user 'bob' has no 'pub' right on topic:orders" in str(error)
    # alice may publish orders, not consume them
    sub = {"orders": FilterExpression("*")}
    with started(SimpleConsumer(config(secured, "alice"), "billing", sub, await_duration=1)) as c:
        error = refused(lambda: c.receive(32, 15))
    assert error.code == pb.FORBIDDEN
    assert "'alice' has no 'sub' right on group:billing" in str(error)
    # bob consumes as billing only
    with started(SimpleConsumer(config(secured, "bob"), "audit", sub, await_duration=1)) as c:
        error = refused(lambda: c.receive(32, 15))
    assert "'bob' has no 'sub' right on group:audit" in str(error)
    with started(SimpleConsumer(config(secured, "bob"), "billing", sub, await_duration=2)) as c:
        [m] = receive_all(c, 1, ack=False)
        assert m.body == b"for billing"
        # acknowledging another group's message is not alice's to do either
        ack = spb.AckMessageRequest(
            group=pb.Resource(name="billing"),
            topic=pb.Resource(name="orders"),
            entries=[spb.AckMessageEntry(message_id=m.message_id, receipt_handle=m.receipt_handle)],
        )
        answer = stub.AckMessage(ack, metadata=signed("alice"))
        assert answer.status.code == pb.FORBIDDEN
        assert "AckMessage (gRPC): user 'alice' has no 'sub' right on group:billing" in (
            answer.status.message
        )
        answer = stub.AckMessage(ack, metadata=signed("bob"))
        assert answer.status.code == pb.OK
    # routes: any right on the topic; a batch: each message on its own
    assert stub.QueryRoute(route("orders"), metadata=signed("bob")).status.code == pb.OK
    answer = stub.QueryRoute(route("payments"), metadata=signed("bob"))
    assert answer.status.code == pb.FORBIDDEN and "topic:payments" in answer.status.message
    batch = spb.SendMessageRequest(
        messages=[_message("orders", b"allowed"), _message("payments", b"refused")]
    )
    answer = stub.SendMessage(batch, metadata=signed("alice"))
    codes = [e.status.code for e in answer.entries]
    assert codes == [pb.OK, pb.FORBIDDEN] and answer.status.code == pb.FORBIDDEN
    assert "SendMessage (gRPC): user 'alice' has no 'pub' right on topic:payments" in (
        answer.entries[1].status.message
    )


def _message(topic: str, body: bytes, **system: Any) -> Any:
    from txmq.protocol.message import new_message_id

    return pb.Message(
        topic=pb.Resource(name=topic),
        body=body,
        system_properties=pb.SystemProperties(
            message_id=new_message_id(), message_type=system.pop("message_type", pb.NORMAL)
        ),
    )


class Checker(TransactionChecker):  # type: ignore[misc]
    """Undecided for ``undecided`` checks, then COMMIT."""

    def __init__(self, undecided: int = 0) -> None:
        self.undecided = undecided
        self.checked: list[bytes] = []

    def check(self, message: Any) -> Any:
        self.checked.append(message.body)
        if len(self.checked) <= self.undecided:
            return TransactionResolution.TRANSACTION_RESOLUTION_UNSPECIFIED
        return TransactionResolution.COMMIT


def test_check_backs_reach_only_the_senders_producers(secured: GrpcBroker, stub: Any) -> None:
    carols, mallorys = Checker(undecided=3), Checker()
    with (
        started(Producer(config(secured, "carol"), ("payments",), carols)) as carol,
        started(Producer(config(secured, "mallory"), ("payments",), mallorys)) as mallory,
    ):
        tx = carol.begin_transaction()
        receipt = carol.send(make_message("payments", b"pending"), tx)
        # mallory publishes payments too, but may not end carol's half
        end = spb.EndTransactionRequest(
            topic=pb.Resource(name="payments"),
            message_id=receipt.message_id,
            transaction_id=receipt.transaction_id,
            resolution=pb.ROLLBACK,
            source=pb.SOURCE_CLIENT,
        )
        answer = stub.EndTransaction(end, metadata=signed("mallory"))
        assert answer.status.code == pb.FORBIDDEN
        assert "was sent by user 'carol'; 'mallory' may not end it" in answer.status.message
        # nor end carol's client, nor take its Telemetry stream over
        bye = spb.NotifyClientTerminationRequest()
        answer = stub.NotifyClientTermination(
            bye, metadata=signed("mallory", client=carol.client_id)
        )
        assert answer.status.code == pb.FORBIDDEN
        assert "is a client of user 'carol', not 'mallory'" in answer.status.message
        # the broker asks carol (undecided three times, then COMMIT), never mallory
        wait_for(lambda: len(carols.checked) >= 4, 40)
        sub = {"payments": FilterExpression("*")}
        with started(SimpleConsumer(config(secured, "ops"), "ledger", sub, await_duration=2)) as c:
            assert [m.body for m in receive_all(c, 1)] == [b"pending"]
        assert set(carols.checked) == {b"pending"}
        assert mallorys.checked == []
        assert mallory.is_running


class Got:
    """A listener (called in worker threads) keeping what it got."""

    def __init__(self) -> None:
        self.msgs: list[MessageExt] = []
        self.lock = threading.Lock()

    def __call__(self, msg: MessageExt) -> None:
        with self.lock:
            self.msgs.append(msg)

    def wait(self, count: int, timeout: float = 30.0) -> list[MessageExt]:
        wait_for(lambda: len(self.msgs) >= count, timeout)
        with self.lock:
            return list(self.msgs)


class Commit:
    def execute_local_transaction(self, msg: Message, arg: Any) -> LocalTransactionState:
        return LocalTransactionState.COMMIT

    def check_local_transaction(self, msg: MessageExt) -> LocalTransactionState:
        return LocalTransactionState.COMMIT


def test_txmqs_grpc_transport_signs_with_its_credentials(secured: GrpcBroker) -> None:
    # the blocking facade: its event loop runs in a thread of its own (an async test
    # would leave the main thread without one, which the official client's later tests
    # in this process may need)
    endpoint = secured.endpoint
    with pytest.raises(AuthenticationFailed, match=r"is not signed: this server requires"):
        with TxmqProducer(endpoint, transport="grpc") as p:
            p.send(Message("orders", b"anonymous"))
    with pytest.raises(AuthenticationFailed, match="the signature of 'alice' does not match"):
        with TxmqProducer(
            endpoint, transport="grpc", access_key="alice", secret_key="wrong-secret"
        ) as p:
            p.send(Message("orders", b"forged"))
    got = Got()
    consumer = TxmqPushConsumer(
        endpoint, "billing", listener=got, transport="grpc", **as_user("bob")
    )
    consumer.subscribe("orders")
    with TxmqProducer(endpoint, transport="grpc", **as_user("alice")) as p:
        sent = p.send(Message("orders", b"signed by alice"))
        with pytest.raises(NoPermission, match="'alice' has no 'pub' right on topic:payments"):
            p.send(Message("payments", b"not hers"))
        with consumer:
            [msg] = got.wait(1)
    assert msg.msg_id == sent.msg_id and msg.body == b"signed by alice"
    # a transaction: the half carries carol, and carol ends it
    with TxmqTransactionProducer(
        endpoint, "pay-tx", listener=Commit(), transport="grpc", **as_user("carol")
    ) as tp:
        tp.send_message_in_transaction(Message("payments", b"paid"), None)
    sub = {"payments": FilterExpression("*")}
    with started(SimpleConsumer(config(secured, "ops"), "ledger", sub, await_duration=2)) as c:
        [m] = receive_all(c, 1)
    assert m.body == b"paid" and "TXMQ_ACL_USER" not in m.properties
