"""Access control on a real broker process: who may connect, send, consume, resend and end
transactions; check-backs only to the sender's producers; the file read again on change."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.acl_support import SECRETS, as_user, policy, secured_broker
from tests.conftest import BrokerProcess, wait_for
from txmq import (
    AdminClient,
    AuthenticationFailed,
    LocalTransactionState,
    Message,
    NoPermission,
    Producer,
    PullConsumer,
    TransactionProducer,
)
from txmq.protocol.message import MessageExt, Prop
from txmq.protocol.wire import ErrorAnswer, FrameDecoder, FrameKind, GetMaxOffset, decode, encode
from txmq.protocol.wire.errors import ResponseCode
from txmq.security.acl import Acl, Rule
from txmq.security.credentials import Credentials
from txmq.security.signing import Signer

pytestmark = pytest.mark.anyio

S = LocalTransactionState
POLICY = policy(
    {
        "alice": [("topic:orders*", "pub")],
        "bob": [("topic:orders", "sub"), ("group:billing", "sub")],
        "carol": [("topic:orders*", "pub")],
        "mallory": [("topic:orders*", "pub")],
    }
)


@pytest.fixture
def secured(tmp_path: Path, broker_process: Callable[..., BrokerProcess]) -> BrokerProcess:
    fast_checks = {
        "TXMQ_BROKER_TRANSACTION_CHECK_INTERVAL_S": "0.2",
        "TXMQ_BROKER_TRANSACTION_TIMEOUT_S": "0.3",
    }
    return secured_broker(broker_process, tmp_path, POLICY, fast_checks)


async def test_who_is_asking_is_checked_and_the_broker_keeps_serving(
    secured: BrokerProcess,
) -> None:
    address = secured.address
    with pytest.raises(
        AuthenticationFailed, match=r"\(code \d+\) is not signed: this server requires credentials"
    ):
        async with Producer(address) as p:
            await p.send(Message("orders", b"anonymous"))
    with pytest.raises(AuthenticationFailed, match="'alice' does not match"):
        async with Producer(address, access_key="alice", secret_key="wrong-secret") as p:
            await p.send(Message("orders", b"forged"))
    with pytest.raises(AuthenticationFailed, match="unknown access key 'eve'"):
        async with Producer(address, access_key="eve", secret_key="eve-secret") as p:
            await p.send(Message("orders", b"stranger"))
    async with Producer(address, **as_user("alice")) as p:
        sent = await p.send(Message("orders", b"order 1", keys=["o-1"]))
        with pytest.raises(NoPermission, match=r"'alice' has no 'pub' right on topic:payments"):
            await p.send(Message("payments", b"not hers"))
        # refused requests did not break the connection or the broker
        again = await p.send(Message("orders", b"order 2"))
    assert again.queue_offset >= 0 and sent.msg_id != again.msg_id
    assert "refused a request" in secured.output()


async def raw_exchange(address: str, frames: list[bytes]) -> list[tuple[int, str]]:
    """Write ``frames`` on one connection; each answer's (code, error message)."""
    host, _, port = address.rpartition(":")
    out: list[tuple[int, str]] = []
    async with await anyio.connect_tcp(host, int(port)) as stream:
        for data in frames:
            await stream.send(data)
            decoder = FrameDecoder()
            with anyio.fail_after(10):
                while not (got := decoder.feed(await stream.receive())):
                    pass
            (answer,) = got
            error = decode(ErrorAnswer, answer.header).error if answer.code else ""
            out.append((answer.code, error))
    return out


async def test_expired_and_replayed_requests_are_refused(secured: BrokerProcess) -> None:
    creds = Credentials("bob", SECRETS["bob"])
    header = encode(GetMaxOffset(topic="orders", queue_id=0))

    def frame(signer: Signer, request_id: int) -> bytes:
        return signer.frame(FrameKind.REQUEST, GetMaxOffset.CODE, request_id, header, b"", 1)

    fresh = Signer(creds)
    first = frame(fresh, 1)
    stale = frame(Signer(creds, clock=lambda: time.time() - 120), 2)
    answers = await raw_exchange(secured.address, [first, first, stale, frame(fresh, 3)])
    assert answers[0] == (ResponseCode.SUCCESS, "")
    assert answers[1][0] == ResponseCode.AUTHENTICATION_FAILED
    assert "replayed" in answers[1][1]
    assert answers[2][0] == ResponseCode.AUTHENTICATION_FAILED
    assert "before this server's clock" in answers[2][1]
    assert answers[3] == (ResponseCode.SUCCESS, "")
    # the replay on a connection of its own is refused too
    [(code, error)] = await raw_exchange(secured.address, [first])
    assert code == ResponseCode.AUTHENTICATION_FAILED and "replayed" in error


async def test_pub_only_cannot_consume_or_resend(secured: BrokerProcess) -> None:
    address = secured.address
    async with Producer(address, **as_user("alice")) as p:
        sent = await p.send(Message("orders", b"for billing", keys=["k-1"]), queue_id=0)
        await p.send(Message("orders-audit", b"not for bob", keys=["k-1"]))
    async with PullConsumer(address, "billing", **as_user("alice")) as c:
        with pytest.raises(NoPermission, match=r"'alice' has no 'sub' right on group:billing"):
            await c.pull("orders", 0, 0, long_poll=0)
    async with AdminClient(address, **as_user("alice")) as admin:
        with pytest.raises(NoPermission, match=r"'alice' has no 'admin' right on group:billing"):
            await admin.dlq_resend("billing")
    async with PullConsumer(address, "billing", **as_user("bob")) as c:
        res = await c.pull("orders", 0, 0, long_poll=0)
        assert [m.body for m in res.messages] == [b"for billing"]
    async with PullConsumer(address, "audit", **as_user("bob")) as c:
        with pytest.raises(NoPermission, match=r"'bob' has no 'sub' right on group:audit"):
            await c.pull("orders", 0, 0, long_poll=0)
    async with AdminClient(address, **as_user("ops")) as admin:
        assert await admin.dlq_resend("billing") == 0
    # a message looked up by id or key: only by who may consume (or administer) its topic
    async with AdminClient(address, **as_user("alice")) as admin:
        with pytest.raises(NoPermission, match=r"ViewMessageById: user 'alice' has no 'sub'"):
            await admin.message_by_id(sent.msg_id)
    async with AdminClient(address, **as_user("bob")) as admin:
        assert (await admin.message_by_id(sent.msg_id)).body == b"for billing"
        # the key's other message is on a topic bob may not read: left out
        assert [m.body for m in await admin.messages_by_key("k-1")] == [b"for billing"]


class Checks:
    def __init__(self) -> None:
        self.seen: list[MessageExt] = []

    async def execute_local_transaction(self, msg: Message, arg: Any) -> S:
        return S.UNKNOWN

    def check_local_transaction(self, msg: MessageExt) -> S:
        self.seen.append(msg)
        return S.UNKNOWN


async def test_check_backs_go_only_to_the_senders_producers(secured: BrokerProcess) -> None:
    address = secured.address
    carols, mallorys, others = Checks(), Checks(), Checks()
    async with (
        TransactionProducer(address, "tx-orders", listener=carols, **as_user("carol")) as carol,
        TransactionProducer(address, "tx-orders", listener=mallorys, **as_user("mallory")) as mal,
        TransactionProducer(address, "tx-other", listener=others, **as_user("mallory")),
    ):
        half = await carol.send_half(Message("orders", b"pending"), transaction_id="T-1")
        await anyio.to_thread.run_sync(lambda: wait_for(lambda: len(carols.seen) >= 3, 30))
        assert {m.get_property(Prop.TRANSACTION_ID) for m in carols.seen} == {"T-1"}
        # the half keeps who sent it, but consumers never see it (nor the producer group)
        assert carols.seen[0].get_property(Prop.ACL_USER) == "carol"
        assert mallorys.seen == [] and others.seen == []
        with pytest.raises(NoPermission, match="was sent by user 'carol'; 'mallory' may not"):
            await mal.end_transaction(half, S.ROLLBACK)
        assert await carol.end_transaction(half, S.COMMIT) == "COMMITTED"
    async with PullConsumer(address, "billing", **as_user("bob")) as c:
        found = []
        for qid in await c.queues("orders"):
            found += (await c.pull("orders", qid, 0, long_poll=0)).messages
        [committed] = [m for m in found if m.body == b"pending"]
        assert committed.get_property(Prop.ACL_USER) is None


async def test_rules_change_when_the_file_changes(secured: BrokerProcess, tmp_path: Path) -> None:
    path = tmp_path / "acl.toml"
    async with Producer(secured.address, **as_user("alice")) as p:
        with pytest.raises(NoPermission):
            await p.send(Message("payments", b"not yet"))
        acl = Acl.load(path).with_rule(
            "alice", Rule.parse({"resource": "topic:payments", "actions": "pub"}, "t")
        )
        acl.save(path)
        deadline = time.monotonic() + 20
        while True:
            try:
                await p.send(Message("payments", b"now allowed"))
                break
            except NoPermission:
                if time.monotonic() > deadline:
                    raise
                await anyio.sleep(0.1)
        path.write_text("not [ toml")  # a broken file: the rules in force stay
        await anyio.to_thread.run_sync(
            lambda: wait_for(lambda: "keeps its access rules" in secured.output(), 20)
        )
        await p.send(Message("payments", b"still allowed"))


def test_a_missing_or_bad_acl_file_stops_the_start_with_a_clear_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    bad = tmp_path / "bad.toml"
    bad.write_text('[users.a]\nsecret_key = "long-enough"\nrules = [{ resource = "queue:x" }]\n')
    for what, path in (("cannot read the ACL file", tmp_path / "none.toml"), ("queue:x", bad)):
        for command in (
            ["broker", "start", "--store", str(tmp_path / "s"), "--port", "0", "--grpc-port", "0"],
            ["namesrv", "start", "--port", "0"],
        ):
            out = subprocess.run(
                [sys.executable, "-m", "txmq.cli", *command, "--acl", str(path)],
                capture_output=True,
                text=True,
                cwd=ROOT,
                timeout=60,
            )
            assert out.returncode != 0, (command, out.stdout)
            assert what in out.stderr and "Traceback" not in out.stderr, out.stderr
