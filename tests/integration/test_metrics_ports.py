"""Several brokers on one machine, each with its metrics: the default port (5557) taken by
another broker moves the next one to a free port it says (a warning and its start-up
line); a port the user named that is taken stops the start in one line with a hint."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, BrokerProcess, NamesrvProcess
from txmq.broker.metrics_endpoint import DEFAULT_METRICS_PORT, DEFAULT_METRICS_TRIES

#: the broker's start-up line, with where its metrics are served
STARTED = re.compile(
    r"broker listening on (\S+) \(flush \w+; metrics on (http://127\.0\.0\.1:(\d+)/metrics)\)"
)
#: ``--metrics-port -1``: the default (what a broker started without the option gets; the
#: fixtures turn metrics off unless a test names the option)
DEFAULT = ("--metrics-port", "-1")


def served(bp: BrokerProcess) -> tuple[str, int]:
    """The metrics URL and port the broker's start-up line says."""
    found = STARTED.search(bp.output())
    assert found, bp.output()
    assert found.group(1) == bp.address
    return found.group(2), int(found.group(3))


def broker_names(url: str) -> set[str]:
    """The broker_name labels of ``txmq_broker_info`` at ``url``."""
    with urllib.request.urlopen(url, timeout=10) as answer:
        assert answer.status == 200
        text = answer.read().decode()
    return {
        s.labels["broker_name"]
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "txmq_broker_info"
    }


def test_two_brokers_of_a_cluster_on_one_machine_both_serve_metrics(
    namesrv_process: Callable[..., NamesrvProcess],
    cluster_broker: Callable[..., BrokerProcess],
) -> None:
    ns = namesrv_process().start()
    first = cluster_broker("broker-a", [ns.address], *DEFAULT).start()
    second = cluster_broker("broker-b", [ns.address], *DEFAULT).start()
    first_url, first_port = served(first)
    second_url, second_port = served(second)
    assert first_port != second_port
    # each port answers with its own broker's metrics
    assert broker_names(first_url) == {"broker-a"}
    assert broker_names(second_url) == {"broker-b"}
    moved = f"metrics on {second_url}: the default port {DEFAULT_METRICS_PORT} is in use"
    if f"metrics on {first_url}: the default port" not in first.output():
        # the first had 5557 and still holds it: the second says where, and why not 5557,
        # and the next free port is near it
        assert first_port == DEFAULT_METRICS_PORT
        assert moved in second.output(), second.output()
        assert DEFAULT_METRICS_PORT < second_port < DEFAULT_METRICS_PORT + DEFAULT_METRICS_TRIES
    elif second_port != DEFAULT_METRICS_PORT:
        # something else on this machine (another test's broker) held 5557 when the first
        # started; it may have let go of it before the second did (then the second has it)
        assert moved in second.output(), second.output()
    if second_port != DEFAULT_METRICS_PORT:
        assert "WARNING" in next(line for line in second.output().splitlines() if moved in line)
    assert "metrics off" not in first.output() + second.output()


def test_a_named_metrics_port_that_is_taken_stops_the_start(
    broker_process: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    first = broker_process(*DEFAULT).start()
    _, taken = served(first)
    out = subprocess.run(
        [
            *(sys.executable, "-m", "txmq.cli", "broker", "start"),
            *("--store", str(tmp_path / "second"), "--port", "0", "--grpc-port", "0"),
            *("--metrics-port", str(taken)),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode != 0, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, out.stderr
    [error] = errors
    assert f"the metrics port 127.0.0.1:{taken} is in use" in error
    assert "--metrics-port N" in error and "--metrics-port 0" in error  # the hint
    assert "Traceback" not in out.stderr and "broker listening" not in out.stderr
    assert broker_names(f"http://127.0.0.1:{taken}/metrics")  # the first one still serves
