"""Managing users and rules on real processes: through the AdminClient on a secured broker
(each change in force at once and written to the broker's file), on every broker (master
and slave) and name server of a secured cluster, and through ``txmq admin user`` /
``txmq admin acl``."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

import pytest

from tests.conftest import ROOT, BrokerProcess, NamesrvProcess, free_port, wait_for
from txmq import AdminClient, AuthenticationFailed, Message, NoPermission, Producer
from txmq.cli.main import build_parser
from txmq.protocol.wire import AclRule, AclUser
from txmq.protocol.wire.errors import BadRequest, BrokerUnavailable
from txmq.security.acl import Acl
from txmq.sync import AdminClient as SyncAdmin
from txmq.sync import Producer as SyncProducer


class Creds(TypedDict):
    access_key: str
    secret_key: str


OPS = Creds(access_key="ops", secret_key="ops-secret-1")
ALICE = Creds(access_key="alice", secret_key="alice-secret")
POLICY = """
[users.ops]
secret_key = "ops-secret-1"
super = true

[users.alice]
secret_key = "alice-secret"
rules = [{ resource = "topic:orders", actions = ["pub"] }]
"""


@pytest.fixture
def acl_path(tmp_path: Path) -> Path:
    path = tmp_path / "acl.toml"
    path.write_text(POLICY)
    return path


@pytest.fixture
def secured(acl_path: Path, broker_process: Callable[..., BrokerProcess]) -> BrokerProcess:
    bp = broker_process()
    bp.env["TXMQ_BROKER_ACL_FILE"] = str(acl_path)
    return bp.start()


def rules_on_disk(path: Path, user: str) -> list[dict[str, object]] | None:
    """``user``'s rules as the file says them (None: no such user)."""
    found = Acl.load(path).users.get(user)
    return None if found is None else [r.as_dict() for r in found.rules]


def file_text(path: Path) -> str:
    return path.read_text()


# -- the AdminClient on one broker --------------------------------------------------------


@pytest.mark.anyio
async def test_a_super_user_manages_users_and_rules_in_force_at_once(
    secured: BrokerProcess, acl_path: Path
) -> None:
    address = secured.address
    dave = Creds(access_key="dave", secret_key="dave-secret-1")
    async with AdminClient(address, **OPS) as admin:
        created = await admin.create_user("dave", "dave-secret-1")
        assert created == AclUser(name="dave", super=False, rules=[])
        assert Acl.load(acl_path).users["dave"].secret_key == "dave-secret-1"
        async with Producer(address, **dave) as p:
            with pytest.raises(NoPermission, match="'dave' has no 'pub' right on topic:orders"):
                await p.send(Message("orders", b"no rule yet"))

            given = await admin.add_rule("dave", "topic:orders", ["pub"], sources=["127.0.0.1"])
            assert given.rules == [
                AclRule(resource="topic:orders", actions=["pub"], sources=["127.0.0.1/32"])
            ]
            assert rules_on_disk(acl_path, "dave") == [
                {"resource": "topic:orders", "actions": ["pub"], "sources": ["127.0.0.1/32"]}
            ]
            sent = await p.send(Message("orders", b"allowed now"))
            assert sent.queue_offset >= 0

            left = await admin.delete_rule("dave", "topic:orders")
            assert left == AclUser(name="dave", rules=[])
            assert rules_on_disk(acl_path, "dave") == []
            with pytest.raises(NoPermission, match="'dave' has no 'pub' right on topic:orders"):
                await p.send(Message("orders", b"refused again"))

            await admin.update_user("dave", super_user=True)
            assert Acl.load(acl_path).users["dave"].super_user
            await p.send(Message("payments", b"a super user sends anywhere"))

            assert await admin.delete_user("dave") == AclUser(name="dave")
            assert rules_on_disk(acl_path, "dave") is None
            with pytest.raises(AuthenticationFailed, match="unknown access key 'dave'"):
                await p.send(Message("orders", b"deleted"))

        users = await admin.users()
        assert [(u.name, u.super) for u in users] == [("alice", False), ("ops", True)]
        assert await admin.users("alice") == [
            AclUser(name="alice", rules=[AclRule(resource="topic:orders", actions=["pub"])])
        ]
        # mistakes are refused with what is wrong, and the file stays as it was
        before = file_text(acl_path)
        with pytest.raises(BadRequest, match=r"unknown action\(s\) \['pib'\]"):
            await admin.add_rule("alice", "topic:orders", ["pib"])
        with pytest.raises(BadRequest, match="resource 'orders' is not topic:NAME"):
            await admin.add_rule("alice", "orders", ["pub"])
        with pytest.raises(BadRequest, match="user 'alice' exists already"):
            await admin.create_user("alice", "another-secret")
        with pytest.raises(BadRequest, match="'ops' may not delete itself"):
            await admin.delete_user("ops")
        with pytest.raises(BadRequest, match="no user 'nobody'"):
            await admin.users("nobody")
        with pytest.raises(ValueError, match="at least 8 characters"):
            await admin.create_user("erin", "short")
        assert file_text(acl_path) == before


@pytest.mark.anyio
async def test_only_a_super_user_may_manage_users(secured: BrokerProcess, acl_path: Path) -> None:
    before = file_text(acl_path)
    async with AdminClient(secured.address, **ALICE) as admin:
        with pytest.raises(NoPermission, match="user 'alice' has no 'admin' right on cluster"):
            await admin.create_user("eve", "eve-secret-1")
        with pytest.raises(NoPermission, match="no 'admin' right on cluster"):
            await admin.users()
    async with AdminClient(secured.address) as anonymous:
        with pytest.raises(AuthenticationFailed, match="requires credentials"):
            await anonymous.add_rule("alice", "topic:*", ["all"])
    assert file_text(acl_path) == before


@pytest.mark.anyio
async def test_a_broker_without_acl_says_access_control_is_off(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    bp = broker_process().start()
    async with AdminClient(bp.address) as admin:
        with pytest.raises(BadRequest, match="access control is off on broker"):
            await admin.create_user("dave", "dave-secret-1")


# -- a cluster: every broker (master and slave) and the name server ----------------------


def test_a_change_through_name_servers_reaches_every_broker_and_name_server(
    tmp_path: Path,
    namesrv_process: Callable[..., NamesrvProcess],
    cluster_broker: Callable[..., BrokerProcess],
    caplog: pytest.LogCaptureFixture,
) -> None:
    def own_copy(name: str) -> Path:
        path = tmp_path / f"acl-{name}.toml"
        path.write_text(POLICY)
        return path

    files = {name: own_copy(name) for name in ("ns", "a0", "a1", "b0")}
    ns = namesrv_process("ns", env={"TXMQ_NAMESRV_ACL_FILE": str(files["ns"])}).start()
    creds = {"TXMQ_BROKER_ACCESS_KEY": "ops", "TXMQ_BROKER_SECRET_KEY": "ops-secret-1"}

    def broker(name: str, file: str, *args: str) -> BrokerProcess:
        env = {**creds, "TXMQ_BROKER_ACL_FILE": str(files[file])}
        bp = cluster_broker(name, [ns.address], *args, env=env)
        bp.store = tmp_path / f"store-{file}"
        bp.log_path = tmp_path / f"{file}.log"
        return bp.start()

    ha = free_port()
    a0 = broker("broker-a", "a0", "--ha-port", str(ha))
    a1 = broker("broker-a", "a1", "--broker-id", "1", "--ha-master", f"127.0.0.1:{ha}")
    b0 = broker("broker-b", "b0")
    addresses = {"a0": a0.address, "a1": a1.address, "b0": b0.address}

    with SyncAdmin(namesrv=ns.address, **OPS) as admin:

        def registered() -> bool:
            return {t.address for t in admin.acl_targets()} >= set(addresses.values())

        wait_for(registered, timeout=30, interval=0.1)
        targets = [str(t) for t in admin.acl_targets()]
        assert targets == [
            f"broker-a ({a0.address})",
            f"broker-a slave 1 ({a1.address})",
            f"broker-b ({b0.address})",
            f"name server {ns.address}",
        ]

        admin.create_user("dave", "dave-secret-1")
        admin.add_rule("dave", "topic:orders", ["pub", "sub"])
        for name, path in files.items():
            assert Acl.load(path).users["dave"].secret_key == "dave-secret-1", name
            assert rules_on_disk(path, "dave") == [
                {"resource": "topic:orders", "actions": ["pub", "sub"]}
            ], name
        # the new user is known on each broker at once
        for address in addresses.values():
            with SyncProducer(address, access_key="dave", secret_key="dave-secret-1") as p:
                with pytest.raises(NoPermission, match="'dave' has no 'pub' right on topic:x"):
                    p.send(Message("x", b"not this topic"))

        # files that differ: the listing says which server differs
        Acl.load(files["b0"]).without_user("dave").save(files["b0"])
        with caplog.at_level(logging.WARNING, logger="txmq.admin"):
            users = admin.users()
        assert "dave" in [u.name for u in users]  # the first server's answer
        [warning] = [r.getMessage() for r in caplog.records if "differ" in r.getMessage()]
        assert f"broker-b ({b0.address})" in warning and "broker-a slave 1" not in warning

        # a change that fails on one server (it has no such user) is made on the others,
        # and the error says where it was done and where not
        with pytest.raises(BrokerUnavailable) as failed:
            admin.delete_user("dave")
        said = str(failed.value)
        assert said == (
            f"user 'dave' deleted on broker-a, broker-a slave 1, name server {ns.address}; "
            f"failed on broker-b ({b0.address}): DeleteUser: no user 'dave'"
        )
        for name in ("ns", "a0", "a1"):
            assert rules_on_disk(files[name], "dave") is None, name


# -- the command line ---------------------------------------------------------------------


def txmq(
    *args: str, creds: Creds | None = OPS, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``txmq ARGS`` signing as ``creds`` (None: no credentials)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TXMQ_ACCESS_KEY", "TXMQ_SECRET_KEY")}
    env.pop("TXMQ_CONFIG", None)
    if creds is not None:
        env |= {"TXMQ_ACCESS_KEY": creds["access_key"], "TXMQ_SECRET_KEY": creds["secret_key"]}
    return subprocess.run(
        [sys.executable, "-m", "txmq.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        input=stdin,
        timeout=60,
        check=False,
    )


def ok(*args: str, stdin: str | None = None) -> str:
    out = txmq(*args, stdin=stdin)
    assert out.returncode == 0, out.stderr
    return out.stdout


def error(*args: str, creds: Creds | None = OPS) -> str:
    """The one line a failing command writes."""
    out = txmq(*args, creds=creds)
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
    return out.stderr


def sends(address: str, access_key: str, secret_key: str, topic: str = "orders") -> str:
    """``ok``, or the class of the error a send as that user gets."""
    try:
        with SyncProducer(address, access_key=access_key, secret_key=secret_key) as p:
            p.send(Message(topic, b"from the cli test"))
    except (NoPermission, AuthenticationFailed) as exc:
        return type(exc).__name__
    return "ok"


def test_the_cli_manages_users_and_rules(secured: BrokerProcess, acl_path: Path) -> None:
    at = ("--broker", secured.address)
    # a generated secret, shown once, that works
    created = ok("admin", "user", "create", "frank", *at)
    [secret] = [line.split(": ", 1)[1] for line in created.splitlines() if "secret key:" in line]
    assert "not shown again" in created and len(secret) >= 24
    assert Acl.load(acl_path).users["frank"].secret_key == secret
    assert sends(secured.address, "frank", secret) == "NoPermission"
    added = ok("admin", "acl", "add", "frank", "topic:orders", "pub", *at)
    assert "allow pub topic:orders" in added
    assert sends(secured.address, "frank", secret) == "ok"

    # a secret from stdin (not echoed), and a super user
    out = ok("admin", "user", "create", "gina", "--super", "--secret-stdin", *at,
             stdin="gina-secret-9\n")  # fmt: skip
    assert "gina-secret-9" not in out and "created (a super user)" in out
    assert sends(secured.address, "gina", "gina-secret-9", topic="anything") == "ok"

    # rules: a deny from a network, listed as a table and as JSON
    ok("admin", "acl", "add", "frank", "topic:orders-*", "sub", "pub", "--deny",
       "--source", "10.0.0.0/8", "--source", "192.168.1.7", *at)  # fmt: skip
    table = ok("admin", "acl", "list", "frank", *at)
    assert "deny pub,sub topic:orders-* (from 10.0.0.0/8, 192.168.1.7/32)" in table
    rules = json.loads(ok("admin", "acl", "list", "frank", "--json", *at))
    assert rules == [
        {"user": "frank", "resource": "topic:orders", "actions": ["pub"],
         "decision": "allow", "sources": []},
        {"user": "frank", "resource": "topic:orders-*", "actions": ["pub", "sub"],
         "decision": "deny", "sources": ["10.0.0.0/8", "192.168.1.7/32"]},
    ]  # fmt: skip
    ok("admin", "acl", "delete", "frank", "topic:orders", *at)
    assert sends(secured.address, "frank", secret) == "NoPermission"
    assert rules_on_disk(acl_path, "frank") == [
        {"resource": "topic:orders-*", "actions": ["pub", "sub"], "decision": "deny",
         "sources": ["10.0.0.0/8", "192.168.1.7/32"]}
    ]  # fmt: skip

    users = json.loads(ok("admin", "user", "list", "--json", *at))
    assert [(u["name"], u["super"], len(u["rules"])) for u in users] == [
        ("alice", False, 1),
        ("frank", False, 1),
        ("gina", True, 0),
        ("ops", True, 0),
    ]
    listing = ok("admin", "user", "list", *at)
    assert listing.splitlines()[0].split() == ["NAME", "SUPER", "RULES"]
    assert "allow pub topic:orders" in listing

    # a new secret: the old one no longer works
    updated = ok("admin", "user", "update", "frank", "--new-secret", *at)
    [new] = [line.split(": ", 1)[1] for line in updated.splitlines() if "secret key:" in line]
    assert new != secret
    assert sends(secured.address, "frank", secret) == "AuthenticationFailed"
    assert sends(secured.address, "frank", new) == "NoPermission"

    # mistakes: one line each, exit code 1, nothing changed
    before = acl_path.read_text()
    assert "unknown action(s) ['pib'] (pub, sub, admin, all)" in error(
        "admin", "acl", "add", "frank", "topic:orders", "pib", *at
    )
    assert "resource 'orders' is not topic:NAME" in error(
        "admin", "acl", "add", "frank", "orders", "pub", *at
    )
    said = error("admin", "user", "create", "hank", *at, creds=ALICE)
    assert "'alice' has no 'admin' right on cluster" in said and "super user" in said
    said = error("admin", "user", "list", *at, creds=None)
    assert "requires credentials" in said and "TXMQ_ACCESS_KEY" in said
    assert "nothing to change" in error("admin", "user", "update", "frank", *at)
    assert acl_path.read_text() == before

    assert "user frank deleted" in ok("admin", "user", "delete", "frank", *at)
    assert sends(secured.address, "frank", new) == "AuthenticationFailed"
    assert rules_on_disk(acl_path, "frank") is None


def test_the_cli_says_when_access_control_is_off(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    bp = broker_process().start()
    said = error("admin", "user", "list", "--broker", bp.address, creds=None)
    assert "access control is off on broker" in said


def test_help_shows_examples_and_where_credentials_come_from(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for args in (
        ("admin", "user"),
        ("admin", "user", "create"),
        ("admin", "user", "update"),
        ("admin", "user", "delete"),
        ("admin", "user", "list"),
        ("admin", "acl"),
        ("admin", "acl", "add"),
        ("admin", "acl", "delete"),
        ("admin", "acl", "list"),
    ):
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args([*args, "--help"])
        assert exited.value.code == 0
        out = capsys.readouterr().out
        assert "examples:" in out and f"txmq {' '.join(args)}" in out, args
        assert "TXMQ_ACCESS_KEY" in out and "[client] table of $TXMQ_CONFIG" in out, args
