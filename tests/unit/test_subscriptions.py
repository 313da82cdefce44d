"""Consumer-group configs (broker/state/subscriptions.py): defaults, changes,
groups.json across a reopen, a damaged file salvaged, bad names and values refused, a
slave's copy."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import msgspec
import pytest

from txmq.broker.state.subscriptions import (
    GroupConfig,
    GroupsFile,
    SubscriptionGroupManager,
)
from txmq.protocol.wire.errors import BadRequest, DiskFull


def path_in(tmp_path: Path) -> Path:
    return tmp_path / "config" / "groups.json"


def test_an_unknown_group_has_the_defaults(tmp_path: Path) -> None:
    groups = SubscriptionGroupManager(path_in(tmp_path))
    assert groups.get("billing") is None
    assert groups.policy("billing") == (False, 16)
    assert groups.all() == []
    assert not path_in(tmp_path).exists()  # nothing is stored for a mere look


def test_update_creates_then_changes_only_what_is_given(tmp_path: Path) -> None:
    groups = SubscriptionGroupManager(path_in(tmp_path))
    assert groups.update("billing", fifo=True) == GroupConfig(fifo=True, retry_max_times=16)
    assert groups.policy("billing") == (True, 16)
    assert groups.update("billing", retry_max_times=3) == GroupConfig(fifo=True, retry_max_times=3)
    assert groups.update("billing") == GroupConfig(fifo=True, retry_max_times=3)
    assert groups.update("billing", fifo=False, retry_max_times=0) == GroupConfig(
        fifo=False, retry_max_times=0
    )
    assert groups.update("audit") == GroupConfig()  # created with the defaults
    assert [name for name, _ in groups.all()] == ["audit", "billing"]
    assert groups.policy("billing") == (False, 0)


def test_configs_survive_a_reopen_and_delete_is_saved_too(tmp_path: Path) -> None:
    groups = SubscriptionGroupManager(path_in(tmp_path))
    groups.update("billing", fifo=True, retry_max_times=5)
    groups.update("audit", retry_max_times=64)
    on_disk = json.loads(path_in(tmp_path).read_text())
    assert on_disk == {
        "groups": {
            "audit": {"fifo": False, "retry_max_times": 64},
            "billing": {"fifo": True, "retry_max_times": 5},
        }
    }
    again = SubscriptionGroupManager(path_in(tmp_path))
    assert again.all() == groups.all()
    assert again.policy("billing") == (True, 5)

    assert again.delete("billing") is True
    assert again.delete("billing") is False
    assert again.delete("never-there") is False
    third = SubscriptionGroupManager(path_in(tmp_path))
    assert third.get("billing") is None and third.policy("billing") == (False, 16)
    assert third.get("audit") == GroupConfig(retry_max_times=64)


def test_a_damaged_file_is_set_aside_and_what_fits_is_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = path_in(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(
        json.dumps(
            {
                "groups": {
                    "good": {"fifo": True, "retry_max_times": 7},
                    "too-many": {"fifo": True, "retry_max_times": 65},
                    "": {"fifo": True},
                    "x" * 256: {"fifo": True},
                    "not-a-map": 3,
                }
            }
        )
    )
    with caplog.at_level(logging.WARNING, logger="txmq.broker"):
        groups = SubscriptionGroupManager(path)
    assert groups.get("good") == GroupConfig(fifo=True, retry_max_times=7)
    # a field that does not fit falls back to its default; a bad name or entry is dropped
    assert groups.get("too-many") == GroupConfig(fifo=True, retry_max_times=16)
    assert {name for name, _ in groups.all()} == {"good", "too-many"}
    assert "is damaged" in caplog.text
    assert len(list(path.parent.glob("groups.json.bad-*"))) == 1
    # what was kept was saved at once: it opens cleanly now
    assert msgspec.json.decode(path.read_bytes(), type=GroupsFile).groups.keys() == {
        "good",
        "too-many",
    }

    path.write_text("{not json")
    assert SubscriptionGroupManager(path).all() == []
    assert len(list(path.parent.glob("groups.json.bad-*"))) == 2


@pytest.mark.parametrize(
    ("group", "fifo", "retry", "says"),
    [
        ("", None, None, "name is empty"),
        ("g" * 256, None, None, "at most 255"),
        (None, None, None, "missing or not a string"),
        ("billing", None, 65, "retry_max_times must be 0 to 64 (got 65)"),
        ("billing", None, -1, "retry_max_times must be 0 to 64 (got -1)"),
        ("billing", None, True, "whole number"),
        ("billing", None, "3", "whole number"),
        ("billing", "yes", None, "fifo must be true or false"),
    ],
)
def test_bad_names_and_values_are_refused_and_nothing_changes(
    tmp_path: Path, group: object, fifo: object, retry: object, says: str
) -> None:
    groups = SubscriptionGroupManager(path_in(tmp_path))
    groups.update("billing", retry_max_times=2)
    with pytest.raises(BadRequest, match=says.replace("(", r"\(").replace(")", r"\)")):
        groups.update(group, fifo=fifo, retry_max_times=retry)  # type: ignore[arg-type]
    assert groups.all() == [("billing", GroupConfig(retry_max_times=2))]
    assert SubscriptionGroupManager(path_in(tmp_path)).all() == groups.all()


def test_longest_name_and_extreme_values_are_taken(tmp_path: Path) -> None:
    groups = SubscriptionGroupManager(path_in(tmp_path))
    name = "g" * 255
    groups.update(name, retry_max_times=64)
    groups.update("%odd name/é", retry_max_times=0)
    again = SubscriptionGroupManager(path_in(tmp_path))
    assert again.policy(name) == (False, 64)
    assert again.policy("%odd name/é") == (False, 0)


def test_a_failed_save_leaves_the_table_as_the_file_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    groups = SubscriptionGroupManager(path_in(tmp_path))
    groups.update("billing", fifo=True)

    def full_disk(path: Path, data: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("txmq.broker.state.subscriptions.write_json_atomic", full_disk)
    with pytest.raises(DiskFull, match="disk is full"):
        groups.update("billing", fifo=False)
    with pytest.raises(DiskFull, match="disk is full"):
        groups.update("new-one")
    with pytest.raises(DiskFull, match="disk is full"):
        groups.delete("billing")
    assert groups.all() == [("billing", GroupConfig(fifo=True))]


def test_in_memory_and_a_slave_adopting_its_masters_table(tmp_path: Path) -> None:
    master = SubscriptionGroupManager.in_memory()
    master.update("billing", fifo=True, retry_max_times=4)
    master.update("audit")
    assert master.path is None and not list(tmp_path.iterdir())

    slave = SubscriptionGroupManager(path_in(tmp_path))
    slave.update("stale", fifo=True)  # the slave's own, gone once it copies its master
    wire = msgspec.json.encode(GroupsFile(master.snapshot()))
    slave.adopt(msgspec.json.decode(wire, type=GroupsFile).groups)
    assert slave.all() == master.all()
    assert SubscriptionGroupManager(path_in(tmp_path)).all() == master.all()

    master.delete("audit")
    slave.adopt(master.snapshot())
    assert [name for name, _ in SubscriptionGroupManager(path_in(tmp_path)).all()] == ["billing"]
    snap = master.snapshot()
    snap.clear()  # a snapshot is a copy
    assert master.get("billing") is not None
