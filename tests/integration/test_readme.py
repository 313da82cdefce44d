"""Every code block of README.md and of the documentation (docs/**/*.md) runs as a reader
would paste it (issue 16, item 17; issue 31, item 1).

Each block is matched by a text only it contains to a runner below, or to the reason it is
not run here. A block that matches nothing or more than one entry, or a plan entry that
matches no block, fails :func:`test_every_block_is_run_or_says_why_not`: a new snippet
cannot slip in untested. A snippet may stand on several pages (the README's example is the
start page's too): an entry may match several blocks, which must then be the same text, and
each copy runs.

The only changes made to a block before it runs (:func:`adapt`):

- ``127.0.0.1:10911`` (the default broker address) -> the test broker's address;
- in ``sh`` blocks, the example database ``postgresql+psycopg://app@db/orders`` and its
  elided form ``...`` -> ``sqlite:///app.db``, and ``(--id N | --all)`` -> ``--all``.

Every block runs in a folder of its own (``sqlite:///app.db`` is a file there), as a
script ``snippet.py`` beside the documentation's ``models.py``; blocks that consume until stopped
run as processes that the test stops (SIGINT, like Ctrl-C) once they printed what they
should.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, BrokerProcess, ask, free_port, read_line, wait_for
from txmq.broker.state.config import BrokerConfig
from txmq.protocol.message import Message
from txmq.protocol.wire import GetClusterInfo, GetReplicaInfo
from txmq.protocol.wire.errors import NoPermission
from txmq.sync import Producer, PullConsumer

#: the files whose code blocks run: the README and every page of the documentation
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
DEFAULT_BROKER = "127.0.0.1:10911"
SQL_SUBSTITUTIONS = {
    "postgresql+psycopg://app@db/orders": "sqlite:///app.db",
    "(--id N | --all)": "--all",
}


AS_IN_A_TERMINAL = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.path.insert(0, '.'); runpy.run_path(sys.argv[1], run_name='__main__')"
)


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int  # of the opening fence, 1-based
    path: str = "README.md"  # the document, relative to the repository

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def document_blocks(document: Path) -> list[Block]:
    path = document.relative_to(ROOT).as_posix()
    blocks: list[Block] = []
    lang, start, body = None, 0, []
    for number, line in enumerate(document.read_text().splitlines(), 1):
        fence = re.match(r"^```(\S*)\s*$", line)
        if fence and lang is None:
            lang, start, body = fence.group(1), number, []
        elif fence:
            blocks.append(Block(lang, "\n".join(body) + "\n", start, path))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"{path}:{start}: a code block is never closed"
    return blocks


def all_blocks() -> list[Block]:
    """The code blocks of the README and of every documentation page."""
    return [block for document in DOCUMENTS for block in document_blocks(document)]


def adapt(block: Block, broker: str) -> str:
    text = block.text.replace(DEFAULT_BROKER, broker)
    if block.lang == "sh":
        for old, new in SQL_SUBSTITUTIONS.items():
            text = text.replace(old, new)
        text = re.sub(r"(--(?:url|db)) \.\.\.", r"\1 sqlite:///app.db", text)
    return text


def commands(text: str) -> list[list[str]]:
    """The commands of an ``sh`` block: continuations joined, comments dropped."""
    joined = text.replace("\\\n", " ")
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


# -- running things ----------------------------------------------------------------------


@dataclass
class Folder:
    """A block's folder, its broker, and the documents' other blocks (some need another)."""

    path: Path
    broker: str
    blocks: list[Block]
    procs: list[subprocess.Popen[str]]

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONUNBUFFERED": "1"}

    def block(self, marker: str) -> Block:
        """The block ``marker`` names (on several pages, the same text on each)."""
        found = [b for b in self.blocks if marker in b.text]
        assert len({b.text for b in found}) == 1, [b.where for b in found]
        return found[0]

    def write_models(self) -> None:
        models = self.block("# models.py")
        (self.path / "models.py").write_text(models.text)

    def python(self, block: Block, timeout: float = 60) -> str:
        """Runs a python block to its end; its stdout."""
        self.write_models()
        script = self.path / "snippet.py"
        script.write_text(adapt(block, self.broker))
        done = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            cwd=self.path,
            env=self.env(),
            timeout=timeout,
        )
        assert done.returncode == 0, f"{block.where}:\n{done.stdout}{done.stderr}"
        return done.stdout

    def start_python(self, block: Block) -> subprocess.Popen[str]:
        """Starts a python block that runs until stopped, with Ctrl-C (SIGINT) raising
        KeyboardInterrupt as in a terminal (a process started in the background, as the
        test may be, inherits SIGINT ignored)."""
        self.write_models()
        script = self.path / "snippet.py"
        script.write_text(adapt(block, self.broker))
        return self._popen([sys.executable, "-c", AS_IN_A_TERMINAL, str(script)])

    def txmq(self, argv: list[str], timeout: float = 60) -> str:
        assert argv[0] == "txmq", argv
        done = subprocess.run(
            [sys.executable, "-m", "txmq.cli", *argv[1:]],
            capture_output=True,
            text=True,
            cwd=self.path,
            env=self.env(),
            timeout=timeout,
        )
        assert done.returncode == 0, f"{shlex.join(argv)}:\n{done.stdout}{done.stderr}"
        return done.stdout

    def start_txmq(self, argv: list[str]) -> subprocess.Popen[str]:
        assert argv[0] == "txmq", argv
        return self._popen([sys.executable, "-m", "txmq.cli", *argv[1:]])

    def _popen(self, argv: list[str]) -> subprocess.Popen[str]:
        errors = (self.path / f"proc{len(self.procs)}.stderr").open("w")
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=errors, text=True, cwd=self.path, env=self.env()
        )
        errors.close()
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[str], sig: int = signal.SIGINT) -> str:
        """Stops ``proc`` as a person would (Ctrl-C); the rest of its stdout."""
        proc.send_signal(sig)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise AssertionError(f"running 30 s after {sig!r}:\n{self.stderr(proc)}") from None
        assert proc.returncode in (0, -sig), f"ended with {proc.returncode}:\n{self.stderr(proc)}"
        return out

    def stderr(self, proc: subprocess.Popen[str]) -> str:
        return (self.path / f"proc{self.procs.index(proc)}.stderr").read_text()

    def upgrade_db(self) -> None:
        """The transactions guide's step 1, ``txmq db upgrade --url sqlite:///app.db``, here."""
        self.txmq(["txmq", "db", "upgrade", "--url", "sqlite:///app.db"])

    def group_lag(self, group: str) -> int:
        """Messages of ``group``'s topics not yet handled (-1 before it commits an offset)."""
        out = self.txmq(["txmq", "admin", "offsets", "--json", "--broker", self.broker])
        lags = [o["lag"] for o in json.loads(out) if o["group"] == group]
        return sum(lags) if lags else -1

    def topic_messages(self, topic: str) -> int:
        out = self.txmq(["txmq", "admin", "topics", "--json", "--broker", self.broker])
        return sum(t["messages"] for t in json.loads(out) if t["topic"] == topic)


def send_until(folder: Folder, proc: subprocess.Popen[str], prefix: str, msg: Message) -> str:
    """Sends ``msg`` every 0.5 s until ``proc`` prints a line starting with ``prefix`` (a
    new consumer group starts at the end of its queues: a message sent before its queues
    are assigned is not for it). All copies go to one queue."""
    deadline = time.monotonic() + 60
    with Producer(folder.broker) as producer:
        while True:
            producer.send(msg, sharding_key="readme")
            try:
                return read_line(proc, prefix, timeout=0.5)
            except AssertionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise


def rows(folder: Folder, sql: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(folder.path / "app.db") as conn:
        return conn.execute(sql).fetchall()


# -- the runners, one a block ---------------------------------------------------------------


def run_produce_and_pull(folder: Folder, block: Block) -> None:
    out = folder.python(block)
    assert out.strip() == "b'{\"id\": 42}'", out


def run_consumer_group(folder: Folder, block: Block) -> None:
    proc = folder.start_python(block)
    line = send_until(folder, proc, "got orders created", Message("orders", b"hi", tags="created"))
    assert line == "got orders created b'hi'", line
    out = folder.stop(proc)  # Ctrl-C ends it (the snippet says so): one line, no traceback
    assert proc.returncode == 0 and out.strip() == "stopped", out
    assert "Traceback" not in folder.stderr(proc), folder.stderr(proc)


def run_db_commands(folder: Folder, block: Block) -> None:
    """Upgrade, current (it prints what the block's comment says) and downgrade."""
    upgrade, current, downgrade = commands(adapt(block, folder.broker))
    [said] = re.findall(r"^txmq db current .*#\s*(.+?)\s*$", block.text, re.MULTILINE)
    assert folder.txmq(upgrade).strip() == f"txmq tables: base -> {said}"
    assert folder.txmq(current).strip() == said
    folder.txmq(downgrade)
    assert folder.txmq(current).startswith("base")


ALEMBIC_INI = """\
[alembic]
script_location = %(here)s/app_migrations
sqlalchemy.url = sqlite:///app.db
"""

ENV_PY_START = """\
# the start of an alembic env.py (the test's); the documentation's snippet follows
from alembic import context
from sqlalchemy import engine_from_config, pool

from models import Base

config = context.config
connectable = engine_from_config(
    config.get_section(config.config_ini_section, {}), prefix="sqlalchemy.", poolclass=pool.NullPool
)
target_metadata = Base.metadata
"""

APP_REVISION = '''\
"""the application's first revision: its own tables (models.py)"""
import sqlalchemy as sa
from alembic import op

revision = "app0001"
down_revision = None


def upgrade() -> None:
    op.create_table("orders", sa.Column("id", sa.String(), primary_key=True),
                    sa.Column("amount", sa.Integer(), nullable=False))
    op.create_table("invoices", sa.Column("order_id", sa.String(), primary_key=True),
                    sa.Column("amount", sa.Integer(), nullable=False))
'''


def run_alembic_env(folder: Folder, block: Block) -> None:
    """The snippet is the end of an application's alembic env.py: ``alembic upgrade head``
    makes txmq's tables and the application's, and ``alembic check`` (autogenerate) finds
    nothing to do, so txmq's tables are left out of the application's migrations."""
    folder.write_models()
    (folder.path / "alembic.ini").write_text(ALEMBIC_INI)
    migrations = folder.path / "app_migrations"
    (migrations / "versions").mkdir(parents=True)
    (migrations / "env.py").write_text(ENV_PY_START + adapt(block, folder.broker))
    (migrations / "versions" / "app0001.py").write_text(APP_REVISION)
    for argv in (["upgrade", "head"], ["check"]):
        done = subprocess.run(
            [sys.executable, "-m", "alembic", *argv],
            capture_output=True,
            text=True,
            cwd=folder.path,
            env=folder.env(),
            timeout=60,
        )
        assert done.returncode == 0, f"alembic {argv}:\n{done.stdout}{done.stderr}"
    tables = {name for (name,) in rows(folder, "SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"orders", "invoices", "txmq_transaction_log", "txmq_outbox"} <= tables, tables
    assert rows(folder, "SELECT version_num FROM alembic_version") == [("app0001",)]


def run_broker_start(folder: Folder, block: Block) -> None:
    """The bare ``txmq broker start`` (on free ports): it says where it listens and where its
    store is, ``./txmq-store``, and Ctrl-C stops it."""
    [argv] = commands(block.text)
    free = ["--port", "0", "--grpc-port", "0", "--metrics-port", "0"]
    proc = folder.start_txmq([*argv, *free])
    said = read_line(proc, "txmq broker: store ")
    assert said.startswith(f"txmq broker: store {(folder.path / 'txmq-store').resolve()} ")
    read_line(proc, "txmq broker listening on ")
    folder.stop(proc)
    assert (folder.path / "txmq-store" / "commitlog").is_dir()


def run_db_upgrade(folder: Folder, block: Block) -> None:
    [argv] = commands(adapt(block, folder.broker))
    [said] = re.findall(r"#\s*prints: (.+?)\s*$", block.text, re.MULTILINE)
    assert folder.txmq(argv).strip() == said


def run_broker_toml(folder: Folder, block: Block) -> None:
    """A broker's settings file: every key is known and every value fits."""
    (folder.path / "broker.toml").write_text(block.text)
    config = BrokerConfig.load(folder.path / "broker.toml", env={})
    table = tomllib.loads(block.text)["broker"]
    for key, value in table.items():
        read = getattr(config, key)
        assert read == type(read)(value), key


def run_first_example(folder: Folder, block: Block) -> None:
    """The README's example: the order row, txmq's transaction log and the message."""
    out = folder.python(block)
    assert out.strip() == "order o-42 saved and announced", out
    with sqlite3.connect(folder.path / "shop.db") as conn:
        assert conn.execute("SELECT id, amount FROM orders").fetchall() == [("o-42", 42)]
        log = conn.execute("SELECT state FROM txmq_transaction_log").fetchall()
    assert log == [("COMMITTED",)]
    assert folder.topic_messages("orders") == 1


def run_models(folder: Folder, block: Block) -> None:
    folder.python(block)  # imports and defines; the other blocks use it as models.py


def run_transactional_send(folder: Folder, block: Block) -> None:
    folder.upgrade_db()
    out = folder.python(block)
    [order_id] = re.findall(r"^order (\w+) saved and published$", out, re.MULTILINE)
    assert rows(folder, "SELECT id, amount FROM orders") == [(order_id, 42)]
    assert rows(folder, "SELECT state FROM txmq_transaction_log") == [("COMMITTED",)]
    assert folder.topic_messages("orders") == 1


def run_outbox_add(folder: Folder, block: Block) -> None:
    folder.upgrade_db()
    folder.python(block)
    [(order_id,)] = rows(folder, "SELECT id FROM orders")
    [(keys,)] = rows(folder, "SELECT keys FROM txmq_outbox")
    assert f"order-{order_id}-created" in keys


def run_outbox_commands(folder: Folder, block: Block) -> None:
    """After the outbox.add block: the relay sends its row, then the other commands."""
    run_outbox_add(folder, folder.block("outbox.add(session"))
    relay, stats, parked, requeue = commands(adapt(block, folder.broker))
    proc = folder.start_txmq(relay)
    read_line(proc, "txmq outbox relay: sqlite:///app.db")
    wait_for(lambda: folder.topic_messages("orders") == 1)
    assert "txmq outbox relay stopped; sent 1 row(s)" in folder.stop(proc, signal.SIGTERM)
    table = folder.txmq(stats).splitlines()
    assert table[0].split() == ["BACKLOG", "LAG_SECONDS", "PARKED", "SENT"], table
    assert table[2].split()[0] == "0" and table[2].split()[2] == "0", table
    assert folder.txmq(parked).strip() == "(none)"
    assert folder.txmq(requeue).strip() == "requeued 0 parked row(s)"


def run_idempotent_consumer(folder: Folder, block: Block) -> None:
    folder.upgrade_db()
    proc = folder.start_python(block)
    msg = Message("orders", b"{}", keys=["order-7-created"])
    assert send_until(folder, proc, "invoiced", msg) == "invoiced order-7-created"
    # Ctrl-C once every copy sent is handled: with copies still waiting for SQLite's writer
    # lock, the process does not end (reported with issue 16, item 17)
    wait_for(lambda: folder.group_lag("billing") == 0)
    folder.stop(proc)
    assert rows(folder, "SELECT order_id FROM invoices") == [("order-7-created",)]
    done = rows(folder, "SELECT consumer_group, key, state FROM txmq_consumed_keys")
    assert done == [("billing", "order-7-created", "done")], done


def run_dead_letter(folder: Folder, block: Block) -> None:
    """The listener dead-letters the parcel at its first delivery; the reason is kept and
    ``txmq admin dlq list`` shows it."""
    out = folder.python(block)
    assert out.splitlines() == ["dead-lettered: not JSON: b'<not json>'"], out
    argv = ["txmq", "admin", "dlq", "list", "--group", "shipping", "--broker", folder.broker]
    [row] = json.loads(folder.txmq([*argv, "--json"]))
    assert (row["reason"], row["reconsume_times"], row["keys"]) == (
        "not JSON: b'<not json>'",
        1,
        ["parcel-1"],
    )
    table = folder.txmq(argv).splitlines()
    assert table[0].split()[-1] == "REASON" and table[2].endswith("  not JSON: b'<not json>'")


def run_pytest_example(folder: Folder, block: Block) -> None:
    """The block is a project's test module: pytest runs it as that project would, with no
    broker address or transport in its environment."""
    (folder.path / "test_orders.py").write_text(block.text)
    env = {k: v for k, v in folder.env().items() if not k.startswith("TXMQ_")}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"],
        cwd=folder.path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


CLUSTER_CLIENT = "Producer(namesrv=NAMESRV)"


def run_cluster_by_hand(folder: Folder, block: Block) -> None:
    """The three commands (the name server on a free port instead of 9876, the brokers on
    free ports instead of 10911 and 10921), then the client snippet against them; then
    Ctrl-C stops each server, brokers first."""
    namesrv_cmd, *broker_cmds = commands(block.text)
    assert namesrv_cmd[:3] == ["txmq", "namesrv", "start"], namesrv_cmd
    assert "--port" in namesrv_cmd and len(broker_cmds) == 2, block.text
    said = read_line(folder.start_txmq([*namesrv_cmd, "--port", "0"]), "txmq namesrv listening on ")
    namesrv = said.rsplit(" ", 1)[1]
    brokers = []
    for argv in broker_cmds:
        argv = [a.replace("127.0.0.1:9876", namesrv) for a in argv]
        assert argv[:3] == ["txmq", "broker", "start"] and "--port" in argv, argv
        proc = folder.start_txmq([*argv, "--port", "0"])  # the last --port wins
        read_line(proc, "txmq broker listening on ")
        brokers.append(proc)
    # both registered before the first send creates the topic on every broker set
    wait_for(lambda: len(ask(namesrv, GetClusterInfo()).brokers) == 2, timeout=10)

    client = folder.block(CLUSTER_CLIENT)
    out = folder.python(replace(client, text=client.text.replace("127.0.0.1:9876", namesrv)))
    sent = re.findall(r"^sent (\d) to (broker-[ab]) queue (\d)$", out, re.MULTILINE)
    assert [i for i, _, _ in sent] == [str(i) for i in range(8)], out
    assert {b for _, b, _ in sent} == {"broker-a", "broker-b"}, out
    assert out.splitlines()[-1] == "received 8 from ['broker-a', 'broker-b']", out
    for proc in [*brokers, folder.procs[0]]:
        folder.stop(proc)


def run_replicated_set_by_hand(folder: Folder, block: Block) -> None:
    """The four commands (free ports instead of 9876 and 10911...; the stores and the
    controller's folder in the block's folder); a send through the name server; the
    master SIGKILLed: another replica takes over and the next send is acknowledged."""
    namesrv_cmd, *broker_cmds = commands(block.text)
    assert namesrv_cmd[:3] == ["txmq", "namesrv", "start"], namesrv_cmd
    assert "--controller-store" in namesrv_cmd and len(broker_cmds) == 3, block.text
    said = read_line(folder.start_txmq([*namesrv_cmd, "--port", "0"]), "txmq namesrv listening on ")
    namesrv = said.rsplit(" ", 1)[1]
    brokers: dict[int, subprocess.Popen[str]] = {}
    for argv in broker_cmds:
        argv = [a.replace("127.0.0.1:9876", namesrv) for a in argv]
        assert argv[:3] == ["txmq", "broker", "start"] and "--controller" in argv, argv
        proc = folder.start_txmq([*argv, "--port", "0"])  # the last --port wins
        read_line(proc, "txmq broker listening on ")
        brokers[int(argv[argv.index("--broker-id") + 1])] = proc

    def master(other_than: int = -1) -> int:
        """1 + the master's id, once it acts and every other live replica is in sync (0 until
        then; ``other_than``: a master other than that one)."""
        sets = ask(namesrv, GetReplicaInfo(broker_name="a")).sets
        if not sets or sets[0].electing or sets[0].master_id in (-1, other_than):
            return 0
        s = sets[0]
        acting = [r for r in s.replicas if r.broker_id == s.master_id and r.master and r.alive]
        live = sum(1 for p in brokers.values() if p.poll() is None)
        return s.master_id + 1 if acting and len(s.in_sync) == live - 1 else 0

    first = wait_for(master, timeout=30) - 1
    with Producer(namesrv=namesrv) as producer:
        assert producer.send(Message("readme-ha", b"before")).status == "SEND_OK"
        brokers[first].kill()
        brokers[first].wait(10)
        # the send waits for the set's new master (the failover takes a few seconds)
        assert producer.send(Message("readme-ha", b"after"), timeout=15).status == "SEND_OK"
    assert wait_for(lambda: master(other_than=first), timeout=30) - 1 != first
    for i, proc in brokers.items():
        if i != first:
            folder.stop(proc)
    folder.stop(folder.procs[0])


Runner = Callable[[Folder, Block], None]


#: text only one block contains -> how the test runs it, or why it does not
def run_official_client(folder: Folder, block: Block) -> None:
    """The official RocketMQ 5 client's snippet, against a broker serving gRPC on a free
    port (the block's 127.0.0.1:8081)."""
    port = free_port()
    bp = BrokerProcess(folder.path / "grpc-store", ["--grpc-port", str(port)],
                       folder.path / "grpc-broker.log").start()  # fmt: skip
    try:
        moved = replace(block, text=block.text.replace("127.0.0.1:8081", f"127.0.0.1:{port}"))
        out = folder.python(moved, timeout=120)
    finally:
        bp.kill()
    lines = out.splitlines()
    assert lines[0].startswith("sent ") and lines[1:] == ["got b'{\"id\": 7}'"], out


def run_acl_file(folder: Folder, block: Block) -> None:
    """The ACL file parses, and its rules decide as the guide's prose says."""
    from txmq.security.acl import Acl, Resource

    acl = Acl.parse(tomllib.loads(block.text), block.where)
    orders = acl.users["orders-service"]
    assert acl.users["ops"].super_user and not orders.super_user
    assert orders.may("pub", Resource("topic", "orders"), "192.168.1.1")
    assert not orders.may("sub", Resource("topic", "orders"), "192.168.1.1")
    assert orders.may("sub", Resource("topic", "stock-replies"), "10.2.3.4")
    assert not orders.may("sub", Resource("topic", "stock-replies"), "192.168.1.1")
    assert not orders.may("sub", Resource("topic", "stock-audit"), "10.2.3.4")  # the deny
    assert orders.may("sub", Resource("group", "orders-service"), "127.0.0.1")


def run_acl_by_hand(folder: Folder, block: Block) -> None:
    """The broker with the guide's ACL file (on a free port); the ``export`` and the admin
    commands as ``ops`` against it; then billing, with the secret key ``user create``
    printed, may consume orders and may not send."""
    (folder.path / "acl.toml").write_text(folder.block("# acl.toml").text)
    broker_cmd, export, *admin_cmds = commands(block.text)
    assert broker_cmd[:3] == ["txmq", "broker", "start"] and "--acl" in broker_cmd, broker_cmd
    extra = ["--port", "0", "--grpc-port", "0", "--metrics-port", "0"]
    said = read_line(folder.start_txmq([*broker_cmd, *extra]), "txmq broker listening on ")
    address = said.rsplit(" ", 1)[1]
    assert export[0] == "export", export
    env = dict(a.split("=", 1) for a in export[1:])
    out = ""
    for argv in admin_cmds:
        done = subprocess.run(
            [sys.executable, "-m", "txmq.cli", *argv[1:], "--broker", address],
            capture_output=True,
            text=True,
            cwd=folder.path,
            env={**folder.env(), **env},
            timeout=60,
        )
        assert done.returncode == 0, f"{shlex.join(argv)}:\n{done.stdout}{done.stderr}"
        out += done.stdout
    secret = re.search(r"secret key: (\S+)", out)
    assert secret, out
    assert "allow sub topic:orders" in out and "allow sub group:billing" in out, out
    ops = {"access_key": env["TXMQ_ACCESS_KEY"], "secret_key": env["TXMQ_SECRET_KEY"]}
    billing = {"access_key": "billing", "secret_key": secret[1]}
    with Producer(address, **ops) as p:
        sent = p.send(Message("orders", b"for billing"))
    with PullConsumer(address, "billing", **billing) as c:
        got = c.pull("orders", sent.queue_id, sent.queue_offset, long_poll=0)
        assert [m.body for m in got.messages] == [b"for billing"]
    with Producer(address, **billing) as p, pytest.raises(NoPermission, match="'billing'"):
        p.send(Message("orders", b"not allowed"))
    folder.stop(folder.procs[0])


def run_fastapi_service(folder: Folder, block: Block) -> None:
    """The FastAPI service, run as ``python app.py`` (uvicorn on a free port instead of
    8000): an order over the limit answers 422 and leaves neither its row nor its message;
    an order placed commits both, and the service's own consumer bills it; Ctrl-C stops it."""
    folder.upgrade_db()
    port = free_port()
    assert "port=8000" in block.text, block.where
    proc = folder.start_python(replace(block, text=block.text.replace("port=8000", f"port={port}")))

    def post(amount: int) -> tuple[int, Any]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/orders?amount={amount}", method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def serving() -> bool:
        assert proc.poll() is None, folder.stderr(proc)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        except OSError:
            return False
        return True

    wait_for(serving, timeout=60, interval=0.1)
    assert post(5000) == (422, {"detail": "amount over the limit"})
    status, placed = post(42)
    assert status == 200, placed
    try:
        billed = read_line(proc, "billed ")
    except AssertionError as exc:  # where it stopped, in the service's own words
        raise AssertionError(f"{exc}; the service's log:\n{folder.stderr(proc)[-4000:]}") from None
    assert billed == f"billed {placed['order']}"
    assert folder.topic_messages("orders") == 1  # the one over the limit never committed
    assert "billed" not in folder.stop(proc)
    assert rows(folder, "SELECT id, amount FROM orders") == [(placed["order"], 42)]


PLAN: dict[str, Runner | str] = {
    "scripts/test.sh": "the README's two commands: scripts/test.sh is this suite; "
    "tests/acceptance/test_orders.py runs scripts/demo.sh",
    "b'{\"id\": 42}'": run_produce_and_pull,
    'consumer.subscribe("orders", "created || paid")': run_consumer_group,
    "txmq db current --url": run_db_commands,
    "txmq.sqla.upgrade(connection)": run_alembic_env,
    "# models.py": run_models,
    "its store in ./txmq-store": run_broker_start,
    "txmq db upgrade --url sqlite:///app.db": run_db_upgrade,
    "# broker.toml: one replica": run_broker_toml,
    "order o-42 saved and announced": run_first_example,
    "async with transaction(producer, session) as tx:": run_transactional_send,
    "outbox.add(session": run_outbox_add,
    "txmq outbox relay --db": run_outbox_commands,
    "@txmq.idempotent(": run_idempotent_consumer,
    "raise txmq.DeadLetter(": run_dead_letter,
    'txmq_broker.wait_consumed("billing", "orders")': run_pytest_example,
    "def test_a_declined_card_releases_the_stock": run_pytest_example,
    "books:     BALANCED": "the demo's output, not a command",
    "txmq reconcile: checking 1 store": "a reconcile run's output, not a command",
    "have not reported that they stopped": "a controller's log line, not a command",
    "port (the seam": "the package's tree, not a command",
    "python -m examples.orders seed": "services started by hand that run until stopped; "
    "tests/acceptance/test_orders.py::test_a_person_places_and_looks_at_orders_through_the_front "
    "drives the same subcommands (seed, seed-accounts, place, orders, stock, accounts, "
    "check) and the three services' fronts",
    "txmq namesrv start --port 9876": run_cluster_by_hand,
    "txmq namesrv start --controller-store ./controller": run_replicated_set_by_hand,
    "--advertised-address c1:9878": "a deployment over several machines (host names c1, e1, "
    "...); tests/integration/test_controllers_etcd.py::"
    "test_three_controllers_on_etcd_fail_over_through_controller_and_etcd_faults runs "
    "three such controllers, an etcd of three and a broker set on one machine",
    "pip install rocketmq-python-client": run_official_client,
    "txmq proxy start --namesrv 127.0.0.1:9876 --grpc-port 8082": "five processes on fixed "
    "ports that run until stopped; "
    "tests/integration/test_grpc_proxy.py::test_send_and_receive_across_both_broker_sets runs "
    "this cluster (a name server, broker-a and broker-b, two proxies) on free ports",
    'ClientConfiguration("127.0.0.1:8081;127.0.0.1:8082"': "a fragment; "
    "tests/integration/test_grpc_proxy.py::"
    "test_a_proxy_killed_while_clients_work_loses_no_acknowledged_message gives the official "
    "client two proxies so, and kills the one it uses",
    "# acl.toml": run_acl_file,
    "# app.py": run_fastapi_service,
    "async def place_order(request: Request)": "a fragment of a Starlette application; "
    "tests/integration/test_asgi.py::test_a_starlette_app_runs_the_lifespan_and_a_transaction "
    "runs such an application (the lifespan, txmq.sqla.transaction in the endpoint)",
    "txmq broker start --store ./store --acl acl.toml": run_acl_by_hand,
    CLUSTER_CLIENT: "run by run_cluster_by_hand, against the cluster of the three commands "
    "before it",
    "txmq reconcile --store": "placeholders throughout (/var/lib/txmq, [--since -1h], "
    "spark://host:7077) and a Spark job of 30-60 s per run, in the Spark tests' group: "
    "tests/spark/test_reconcile.py::test_the_txmq_reconcile_command_finds_the_same runs "
    "the txmq reconcile command end to end with the first command's options (--store, --db "
    "twice, --sla, --master, --conf, --out), "
    "tests/spark/test_reconcile.py::test_spark_submit_local_2_finds_the_same the "
    "spark-submit line, and "
    "tests/spark/test_cluster.py::test_anomalies_of_every_store_are_found_on_their_broker_set "
    "the job over NAME=STORE stores",
}

#: a test a reason above names, as tests/PATH.py::NAME
NAMED_TEST = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def _plan_of(block: Block) -> list[str]:
    return [marker for marker in PLAN if marker in block.text]


def test_every_block_is_run_or_says_why_not() -> None:
    blocks = all_blocks()
    assert len(blocks) >= 10
    assert {b.path for b in blocks} >= {"README.md", "docs/getting-started.md"}
    for block in blocks:
        assert len(_plan_of(block)) == 1, (
            f"{block.where}: a ```{block.lang} block matched by "
            f"{_plan_of(block) or 'no entry'} of PLAN in {__name__}: give it exactly one"
        )
    for marker in PLAN:
        found = [b for b in blocks if marker in b.text]
        assert found, f"PLAN entry {marker!r} matches no block"
        assert len({b.text for b in found}) == 1, (
            f"PLAN entry {marker!r} matches different blocks at {[b.where for b in found]}"
        )


def test_the_tests_a_reason_names_exist() -> None:
    """A block not run here because another test runs it: that test exists (renamed or
    removed, the reason would no longer be true)."""
    named = [
        m
        for reason in PLAN.values()
        if isinstance(reason, str)
        for m in NAMED_TEST.finditer(reason)
    ]
    assert len(named) >= 3
    for m in named:
        path, name = ROOT / m[1], m[2]
        assert path.is_file(), m[0]
        assert re.search(rf"^def {name}\(", path.read_text(), re.MULTILINE), m[0]


def _runnable() -> list[Any]:
    params = []
    for block in all_blocks():
        markers = _plan_of(block)
        runner = PLAN[markers[0]] if len(markers) == 1 else None
        if callable(runner):
            params.append(pytest.param(block, runner, id=f"{runner.__name__}-{block.where}"))
    return params


@pytest.mark.parametrize(("block", "runner"), _runnable())
def test_readme_block_runs(
    block: Block,
    runner: Runner,
    broker_process: Callable[..., BrokerProcess],
    tmp_path: Path,
) -> None:
    bp = broker_process().start()
    here = tmp_path / "readme"
    here.mkdir()
    folder = Folder(here, bp.address, all_blocks(), [])
    try:
        runner(folder, block)
    finally:
        for proc in folder.procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=10)
