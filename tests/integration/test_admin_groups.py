"""``txmq admin group`` against a real ``txmq broker start`` process: a consumer group made
FIFO with its own retry limit, listed, kept across a restart, deleted; mistakes get one
line each.  And a slave copies its master's group configs (and refuses to change them)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import BrokerProcess, ask, wait_for
from tests.integration.test_cli import txmq
from txmq.broker.server import Broker, EmbeddedBroker
from txmq.protocol.wire import (
    DeleteSubscriptionGroup,
    GetAllSubscriptionGroups,
    GroupConfigRow,
    UpdateSubscriptionGroup,
)
from txmq.protocol.wire.errors import BadRequest, NotMaster


def group(address: str, *args: str) -> Any:
    """``txmq admin group ARGS --broker ADDRESS --json`` (options after the subcommand)."""
    out = txmq("admin", "group", *args, "--broker", address, "--json", check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def configs(address: str) -> list[dict[str, Any]]:
    """The configured groups of ``admin group list`` (which lists every group the broker
    knows), as the config commands answer them."""
    rows = group(address, "list")
    return [
        {"group": r["group"], "fifo": r["fifo"], "retry_max_times": r["retry_max_times"]}
        for r in rows
        if r["config"]
    ]


def one_line_error(address: str, *args: str) -> str:
    out = txmq("admin", "--broker", address, "group", *args, check=False)
    assert out.returncode == 1, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("txmq: error: "), out.stderr
    assert "Traceback" not in out.stderr
    return lines[0]


def test_group_update_list_delete_and_a_restart(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    bp = broker_process().start()
    assert configs(bp.address) == []

    made = group(bp.address, "update", "--group", "billing", "--fifo")
    assert made == [{"group": "billing", "fifo": True, "retry_max_times": 16}]
    changed = group(bp.address, "update", "--group", "billing", "--retry-max", "3")
    assert changed == [{"group": "billing", "fifo": True, "retry_max_times": 3}]
    group(bp.address, "update", "--group", "audit", "--no-fifo", "--retry-max", "0")
    assert configs(bp.address) == [
        {"group": "audit", "fifo": False, "retry_max_times": 0},
        {"group": "billing", "fifo": True, "retry_max_times": 3},
    ]
    table = txmq("admin", "group", "list", "--broker", bp.address).stdout.splitlines()
    assert table[0].split() == ["GROUP", "MEMBERS", "LAG", "CONFIG", "FIFO", "RETRY_MAX", "TOPICS"]
    assert table[3].split() == ["billing", "0", "-", "yes", "yes", "3", "-"]

    # kept across a restart (groups.json in the store)
    assert bp.terminate() == 0
    assert json.loads((bp.store / "config" / "groups.json").read_text())["groups"]["billing"] == {
        "fifo": True,
        "retry_max_times": 3,
    }
    bp.start()
    assert configs(bp.address) == [
        {"group": "audit", "fifo": False, "retry_max_times": 0},
        {"group": "billing", "fifo": True, "retry_max_times": 3},
    ]

    deleted = group(bp.address, "delete", "--group", "billing")
    assert deleted == [{"group": "billing", "deleted": True}]
    assert configs(bp.address) == [{"group": "audit", "fifo": False, "retry_max_times": 0}]
    said = txmq("admin", "group", "delete", "--group", "audit", "--broker", bp.address).stdout
    assert said.strip() == "consumer group audit: config deleted (it has the defaults again)"
    assert txmq("admin", "group", "list", "--broker", bp.address).stdout.strip() == "(none)"

    # the deletions last too
    assert bp.terminate() == 0
    bp.start()
    assert configs(bp.address) == []
    assert "Traceback" not in bp.output()


def test_mistakes_get_one_line_each(broker_process: Callable[..., BrokerProcess]) -> None:
    bp = broker_process().start()
    group(bp.address, "update", "--group", "billing", "--retry-max", "2")

    said = one_line_error(bp.address, "update", "--group", "billing", "--retry-max", "65")
    assert "retry_max_times must be 0 to 64 (got 65)" in said
    said = one_line_error(bp.address, "update", "--group", "billing", "--retry-max", "-1")
    assert "retry_max_times must be 0 to 64 (got -1)" in said
    said = one_line_error(bp.address, "update", "--group", "g" * 256, "--fifo")
    assert "'group'" in said and "255" in said
    said = one_line_error(bp.address, "update", "--group", "", "--fifo")
    assert "'group'" in said
    said = one_line_error(bp.address, "delete", "--group", "nobody")
    assert said == "txmq: error: consumer group 'nobody' has no config: nothing deleted"
    # a name-server option on a broker alone
    said = one_line_error(bp.address, "list", "--broker-name", "broker-b")
    assert "needs name servers" in said

    # nothing changed, and the broker serves on
    assert configs(bp.address) == [{"group": "billing", "fifo": False, "retry_max_times": 2}]
    assert bp.alive() and "Traceback" not in bp.output()


def test_help_shows_examples() -> None:
    for args in (("admin", "group"), ("admin", "group", "update"), ("admin", "group", "list")):
        out = txmq(*args, "--help").stdout
        assert "examples:" in out and "txmq admin group" in out
    assert "--no-fifo" in txmq("admin", "group", "update", "--help").stdout


def _b(e: EmbeddedBroker) -> Broker:
    assert e.broker is not None
    return e.broker


def test_a_slave_copies_its_masters_group_configs_and_refuses_changes(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    master = embedded_broker(broker_id=0, ha_metadata_sync_interval_s=0.2)
    slave = embedded_broker(
        broker_id=1,
        ha_master_address=_b(master).replication.ha_address,
        ha_metadata_sync_interval_s=0.2,
    )
    wait_for(lambda: _b(slave).replication.client.connected)

    row = ask(master.address, UpdateSubscriptionGroup(group="billing", fifo=True))
    assert row == GroupConfigRow(group="billing", fifo=True, retry_max_times=16)
    ask(master.address, UpdateSubscriptionGroup(group="audit", retry_max_times=1))
    wait_for(lambda: _b(slave).context.groups.policy("billing") == (True, 16))
    assert _b(slave).context.groups.policy("audit") == (False, 1)
    on_slave = ask(slave.address, GetAllSubscriptionGroups()).groups
    assert [(r.group, r.fifo, r.retry_max_times) for r in on_slave] == [
        ("audit", False, 1),
        ("billing", True, 16),
    ]

    with pytest.raises(NotMaster, match="slave"):
        ask(slave.address, UpdateSubscriptionGroup(group="billing", fifo=False))
    with pytest.raises(NotMaster):
        ask(slave.address, DeleteSubscriptionGroup(group="billing"))
    with pytest.raises(BadRequest, match="retry_max_times"):
        ask(master.address, UpdateSubscriptionGroup(group="billing", retry_max_times=99))

    # a deletion reaches the slave too, and its groups.json
    assert ask(master.address, DeleteSubscriptionGroup(group="audit")).deleted
    wait_for(lambda: _b(slave).context.groups.get("audit") is None)
    # the file follows the table (written by the slave's sync, maybe a moment later)
    path = slave.config.store / "config" / "groups.json"
    want = {"groups": {"billing": {"fifo": True, "retry_max_times": 16}}}
    wait_for(lambda: json.loads(path.read_text()) == want)
