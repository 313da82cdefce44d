"""What a new user meets first with the ``txmq`` command (issue 31, "first contact"): a
closed pipe (``| head``) ends a command quietly; one broker of a cluster asked alone says
that ``--namesrv`` shows the whole cluster; Ctrl-C stops a command with one line, and the
servers as they say; ``admin dlq list`` means one thing by one column name, in its table
and in its JSON."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest

from tests.conftest import ROOT, BrokerProcess, NamesrvProcess, read_line, wait_for
from tests.integration.test_cli import txmq
from txmq import Message, Producer, PullConsumer
from txmq.client.core import BrokerClient
from txmq.protocol.wire import ConsumerSendMsgBack

#: ``python -m txmq.cli`` with Ctrl-C raising KeyboardInterrupt as in a terminal (a process
#: started in the background, as the test may be, inherits SIGINT ignored)
AS_IN_A_TERMINAL = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from txmq.cli import main; sys.exit(main())"
)


# -- 6: a closed pipe -------------------------------------------------------------------------


def to_closed_pipe(*args: str, unbuffered: bool) -> subprocess.CompletedProcess[str]:
    """``txmq ARGS`` writing into a pipe whose reader has already gone (``| head`` that has
    read its lines); ``unbuffered``: every line is written as it is printed, so the write
    fails inside the command, not when the output is flushed at its end."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "txmq.cli", *args],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1" if unbuffered else ""},
            timeout=60,
        )
    finally:
        os.close(write)


def test_a_closed_pipe_ends_a_command_quietly(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    bp = broker_process().start()
    # the write fails as the output is flushed at the end / inside the command
    for args, unbuffered in ((("admin", "topics", "--json"), False), (("admin", "cluster"), True)):
        done = to_closed_pipe(*args, "--broker", bp.address, unbuffered=unbuffered)
        # what a shell shows for `cat`, `grep`, `yes` ended by SIGPIPE: 128 + 13
        assert (done.returncode, done.stderr) == (141, ""), args


# -- 7: one broker of a cluster ---------------------------------------------------------------


def test_one_broker_of_a_cluster_says_namesrv_shows_the_whole_cluster(
    namesrv_process: Callable[..., NamesrvProcess],
    cluster_broker: Callable[..., BrokerProcess],
    broker_process: Callable[..., BrokerProcess],
) -> None:
    ns = namesrv_process().start()
    a = cluster_broker("broker-a", [ns.address]).start()
    note = (
        f"txmq: note: {a.address} is one broker (broker set broker-a) of cluster C: these "
        f"are its rows alone; --namesrv {ns.address} shows the whole cluster\n"
    )
    done = txmq("admin", "topics", "--json", "--broker", a.address)
    assert done.stderr == note
    json.loads(done.stdout)  # the JSON alone
    assert txmq("admin", "offsets", "--broker", a.address).stderr == note

    def through_namesrv() -> subprocess.CompletedProcess[str] | None:
        done = txmq("admin", "topics", "--namesrv", ns.address, check=False)
        return done if done.returncode == 0 else None  # once the broker has registered

    assert wait_for(through_namesrv).stderr == ""
    alone = broker_process().start()  # no name servers: all there is, nothing to say
    assert txmq("admin", "topics", "--broker", alone.address).stderr == ""


# -- 10: Ctrl-C -------------------------------------------------------------------------------


Start = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def in_a_terminal(tmp_path: Path) -> Iterator[Start]:
    """``in_a_terminal(*args)`` starts ``txmq ARGS`` as a person runs it, its stderr in
    ``<tmp_path>/<ARGS[0]>.stderr``; what still runs at the end is killed."""
    started: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        with (tmp_path / f"{args[0]}.stderr").open("w") as errors:
            proc = subprocess.Popen(
                [sys.executable, "-c", AS_IN_A_TERMINAL, *args],
                stdout=subprocess.PIPE,
                stderr=errors,
                text=True,
                cwd=ROOT,
            )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def stop_with_ctrl_c(proc: subprocess.Popen[str]) -> str:
    """Ctrl-C, then what ``proc`` printed on stdout till it ended."""
    proc.send_signal(signal.SIGINT)
    return proc.communicate(timeout=30)[0]


def test_ctrl_c_stops_a_waiting_command_with_one_line(in_a_terminal: Start, tmp_path: Path) -> None:
    # a "broker" that accepts connections and never answers: the command waits
    with socket.create_server(("127.0.0.1", 0)) as silent:
        silent.settimeout(30)
        where = f"127.0.0.1:{silent.getsockname()[1]}"
        proc = in_a_terminal("admin", "topics", "--broker", where)
        conn, _ = silent.accept()  # the command is connected, waiting for its answer
        with conn:
            out = stop_with_ctrl_c(proc)
    said = (tmp_path / "admin.stderr").read_text()
    assert (proc.returncode, out, said) == (130, "", "txmq: interrupted\n")  # 128 + SIGINT


def test_ctrl_c_stops_each_server_as_it_says(
    broker_process: Callable[..., BrokerProcess],
    namesrv_process: Callable[..., NamesrvProcess],
    in_a_terminal: Start,
    tmp_path: Path,
) -> None:
    """The broker, the name server, the outbox relay and the console stop themselves on
    SIGINT: status 0, their own last line, no traceback."""
    broker = broker_process().start()
    url = f"sqlite:///{tmp_path}/app.db"
    txmq("db", "upgrade", "--url", url)
    relay = in_a_terminal("outbox", "relay", "--db", url, "--broker", broker.address)
    read_line(relay, "txmq outbox relay: ")
    stop_with_ctrl_c(relay)
    said = (tmp_path / "outbox.stderr").read_text()
    assert relay.returncode == 0 and "Traceback" not in said, said

    pytest.importorskip("uvicorn")
    console = in_a_terminal("console", "--broker", broker.address, "--port", "0")
    log = tmp_path / "console.stderr"
    wait_for(lambda: "Uvicorn running on" in log.read_text() or console.poll() is not None)
    stop_with_ctrl_c(console)
    said = log.read_text()
    assert console.returncode == 0 and "Traceback" not in said, said

    servers: list[BrokerProcess | NamesrvProcess] = [broker, namesrv_process().start()]
    for server in servers:
        assert server.proc is not None
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(30) == 0
        said = server.log_path.read_text()
        assert "received SIGINT" in said and "Traceback" not in said, said


# -- 12: one meaning for one word ------------------------------------------------------------


async def dead_letter(address: str, group: str) -> str:
    """A message of topic ``orders`` sent straight to ``%DLQ%<group>``; its id."""
    async with Producer(address) as producer, PullConsumer(address, group) as consumer:
        await producer.send(Message("orders", b"poison", keys=["k-1"]), queue_id=0)
        [msg] = (await consumer.pull("orders", 0, 0, long_poll=0)).messages
        async with BrokerClient(address) as client:
            back = ConsumerSendMsgBack(
                group=group,
                commit_log_offset=msg.commit_log_offset,
                delay_level=-1,  # the DLQ at once
                origin_msg_id=msg.msg_id,
            )
            await client.call(back)
    return msg.msg_id


def test_dlq_list_means_the_same_by_each_name_in_its_table_and_json(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    bp = broker_process().start()
    msg_id = anyio.run(dead_letter, bp.address, "G")
    [row] = json.loads(txmq("admin", "dlq", "list", "--group", "G", "--json", "--broker",
                            bp.address).stdout)  # fmt: skip
    assert (row["topic"], row["origin_topic"]) == ("%DLQ%G", "orders")
    header, _, line = txmq("admin", "dlq", "list", "--group", "G", "--broker",
                           bp.address).stdout.splitlines()  # fmt: skip
    names = header.split()
    assert "TOPIC" not in names and names[:3] == ["MSG_ID", "ORIGIN_TOPIC", "RECONSUME_TIMES"]
    # a column holds what the JSON key of its name holds
    cells = line.split()[:3]
    assert cells == [str(row[name.lower()]) for name in names[:3]] == [msg_id, "orders", "1"]
