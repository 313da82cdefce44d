"""The shipped Grafana dashboard and Prometheus alert rules (deploy/): both parse, and every
metric they use is one the broker exposes (the outbox's come from the client side)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from txmq.broker.metrics import registry_for
from txmq.broker.server import Broker
from txmq.broker.state.config import BrokerConfig
from txmq.broker.state.stats import Dist

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "txmq-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "txmq-alerts.yml"
#: exported by the applications' outbox relays (the client's registry), not the broker
CLIENT_SIDE = {"txmq_outbox_backlog_rows", "txmq_outbox_lag_seconds", "txmq_outbox_parked_rows"}
METRIC = re.compile(r"\b(?:rocketmq|txmq)_[a-z0-9_]*[a-z0-9]")


# -- a reader for the block-style YAML subset the rules file is written in -------------------


def _lines(text: str) -> list[tuple[int, str]]:
    out = []
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped and not stripped.startswith("#"):
            out.append((len(raw) - len(raw.lstrip(" ")), stripped))
    return out


def _scalar(text: str) -> Any:
    if text.startswith('"'):
        return json.loads(text)
    if text.startswith("'") and text.endswith("'"):
        return text[1:-1].replace("''", "'")
    return int(text) if text.isdigit() else text


def _block(lines: list[tuple[int, str]], i: int, indent: int) -> tuple[Any, int]:
    if lines[i][1].startswith("- "):
        items = []
        while i < len(lines) and lines[i][0] == indent and lines[i][1].startswith("- "):
            lines[i] = (indent + 2, lines[i][1][2:])  # the item's first key, indented
            item, i = _block(lines, i, indent + 2)
            items.append(item)
        return items, i
    mapping: dict[str, Any] = {}
    while i < len(lines) and lines[i][0] == indent and not lines[i][1].startswith("- "):
        key, colon, rest = lines[i][1].partition(":")
        assert colon and key and " " not in key, f"not a 'key: value' line: {lines[i][1]!r}"
        assert key not in mapping, f"{key!r} twice"
        rest = rest.strip()
        i += 1
        if rest in (">-", ">", "|", "|-"):
            folded = []
            while i < len(lines) and lines[i][0] > indent:
                folded.append(lines[i][1])
                i += 1
            mapping[key] = (" " if rest.startswith(">") else "\n").join(folded)
        elif rest:
            mapping[key] = _scalar(rest)
        else:
            assert i < len(lines) and lines[i][0] > indent, f"{key!r} has no value"
            mapping[key], i = _block(lines, i, lines[i][0])
    return mapping, i


def read_yaml(text: str) -> Any:
    lines = _lines(text)
    value, end = _block(lines, 0, lines[0][0])
    assert end == len(lines), f"unparsed from line {lines[end][1]!r}"
    return value


# -- what the broker exposes -------------------------------------------------------------


@pytest.fixture(scope="module")
def exposed(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """The sample names of every family a broker's /metrics has (with metrics on)."""
    store = tmp_path_factory.mktemp("metrics") / "store"
    broker = Broker(BrokerConfig(store=store, port=0, grpc_port=0, metrics_port=-1))
    broker.store.start()
    try:
        sources = broker.metrics_sources()
        assert sources is not None
        names: set[str] = set()
        for family in registry_for(sources).collect():
            if family.type == "counter":
                names.add(family.name + "_total")
            elif family.type == "histogram":
                names.update(family.name + s for s in ("_bucket", "_count", "_sum"))
            else:
                names.add(family.name)
        return names
    finally:
        broker.store.shutdown()


def test_the_issue_names_are_exposed(exposed: set[str]) -> None:
    for name in (
        "rocketmq_messages_in_total",
        "rocketmq_messages_out_total",
        "rocketmq_throughput_in_total",
        "rocketmq_message_size_bucket",
        "rocketmq_rpc_latency_bucket",
        "rocketmq_consumer_lag_messages",
        "rocketmq_consumer_inflight_messages",
        "rocketmq_send_to_consumer_latency_bucket",
        "txmq_half_messages_pending",
        "txmq_half_messages_committed_total",
        "txmq_half_messages_rolled_back_total",
        "txmq_half_messages_checked_total",
        "txmq_half_messages_parked_total",
        "txmq_transaction_check_answers_total",
        "txmq_retry_messages_total",
        "txmq_dlq_messages_total",
        "txmq_commitlog_size_bytes",
        "txmq_commitlog_flush_latency_seconds_bucket",
        "txmq_replication_lag_bytes",
        "txmq_store_damage_total",
        "txmq_store_lost_messages_total",
    ):
        assert name in exposed, name


def _known(names: set[str], exposed: set[str]) -> None:
    assert names, "no metric names found"
    unknown = names - exposed - CLIENT_SIDE
    assert not unknown, f"not exposed by the broker: {sorted(unknown)}"


def test_alert_rules_parse_and_use_exposed_metrics(exposed: set[str]) -> None:
    rules = read_yaml(ALERTS.read_text())
    alerts: dict[str, dict[str, Any]] = {}
    for group in rules["groups"]:
        assert group["name"] and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            assert rule["labels"]["severity"] in ("info", "warning", "critical")
            assert rule["annotations"]["summary"]
            assert rule.get("for", "1m")[-1] in "smh"
            assert rule["alert"] not in alerts
            alerts[rule["alert"]] = rule
    used = {n for rule in alerts.values() for n in METRIC.findall(rule["expr"])}
    _known(used, exposed)
    # what the issue asks to alert on
    for subject in (
        "txmq_half_messages_oldest_age_seconds",  # stuck halves
        "txmq_half_messages_max_check_times",
        "txmq_half_messages_parked_total",  # parked transactions
        "txmq_dlq_messages_total",  # DLQ growth
        "rocketmq_consumer_lag_messages",  # consumer lag
        "txmq_outbox_lag_seconds",  # outbox lag
    ):
        assert subject in used, subject


def _exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            else:
                yield from _exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _exprs(item)


def test_dashboard_parses_and_uses_exposed_metrics(exposed: set[str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    graphs = [p for p in dashboard["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in graphs:
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
    used = {n for e in _exprs(dashboard) for n in METRIC.findall(e)}
    _known(used, exposed)
    for subject in (
        "rocketmq_messages_in_total",
        "rocketmq_messages_out_total",
        "rocketmq_consumer_lag_messages",
        "txmq_half_messages_pending",
        "txmq_parked_transactions",
        "txmq_dlq_depth_messages",
        "txmq_commitlog_size_bytes",
        "txmq_commitlog_flush_latency_seconds_bucket",
        "txmq_replication_lag_bytes",
    ):
        assert subject in used, subject


def test_histogram_buckets_count_at_or_under_their_bound() -> None:
    dist = Dist((1, 10))
    for v in (0.5, 1, 2, 10, 11):
        dist.observe(v)
    assert dist.counts == [2, 2, 1] and dist.total == 24.5


def test_the_yaml_reader_reads_what_it_is_given() -> None:
    text = 'a:\n  - b: 1\n    c: "x: y"\n  - d: >-\n      one\n      two\ne: plain: text\n'
    assert read_yaml(text) == {"a": [{"b": 1, "c": "x: y"}, {"d": "one two"}], "e": "plain: text"}
