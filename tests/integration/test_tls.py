"""TLS on real processes: a broker with ``--tls-cert/--tls-key`` serves TLS clients and
tells plaintext ones to use TLS, ``--tls-ca`` requires client certificates, a name server
with TLS and brokers registering over TLS, a replicated broker set copying over TLS, the
gRPC endpoint with TLS (txmq's own gRPC transport and the official RocketMQ 5 client), the
admin CLI and the web console (https) reaching a TLS broker."""

from __future__ import annotations

import functools
import os
import random
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import anyio
import pytest

import tests.replicaset as replicaset
from tests.conftest import ROOT, BrokerProcess, NamesrvProcess, ask, free_port, wait_for
from tests.integration.test_transactions import read_topic
from tests.replicaset import ReplicaSet
from tests.tls_support import certs, other
from txmq import Message
from txmq.protocol.message import MessageExt
from txmq.protocol.peer import RemotingClient
from txmq.protocol.wire import GetBrokerRuntimeInfo, GetClusterInfo, Request
from txmq.protocol.wire.base import R
from txmq.protocol.wire.errors import BadRequest, BrokerUnavailable, TxmqError
from txmq.security.certs import CertFiles
from txmq.security.client import ClientSecurity
from txmq.sync import Producer, PullConsumer, PushConsumer

__all__ = ["certs", "other"]  # the fixtures, used by name

pytestmark = pytest.mark.timeout(180)

BrokerFactory = Callable[..., BrokerProcess]
NamesrvFactory = Callable[..., NamesrvProcess]


def server_flags(certs: CertFiles, *, client_ca: bool = False) -> list[str]:
    flags = ["--tls-cert", str(certs.cert), "--tls-key", str(certs.key)]
    return [*flags, "--tls-ca", str(certs.ca)] if client_ca else flags


def mutual(certs: CertFiles) -> ClientSecurity:
    """A client that trusts the test CA and shows the test client certificate."""
    return ClientSecurity(
        tls=True, tls_ca=certs.ca, tls_cert=certs.client_cert, tls_key=certs.client_key
    )


class Ask(Protocol):
    def __call__(self, address: str, request: Request[R], timeout: float = 5.0) -> R: ...


def tls_ask(security: ClientSecurity) -> Ask:
    """:func:`tests.conftest.ask` over TLS."""

    def ask_tls(address: str, request: Request[R], timeout: float = 5.0) -> R:
        async def go() -> R:
            async with RemotingClient(
                address, connect_timeout=timeout, security=security
            ) as client:
                return (await client.call(request, timeout=timeout)).header

        return anyio.run(go)

    return ask_tls


class Collector:
    def __init__(self) -> None:
        self.got: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def __call__(self, msg: MessageExt) -> None:
        with self.lock:
            self.got[msg.msg_id] = msg.body


def test_a_tls_broker_serves_tls_clients_and_tells_plaintext_ones(
    broker_process: BrokerFactory, certs: CertFiles, other: CertFiles
) -> None:
    bp = broker_process(*server_flags(certs)).start()
    received = Collector()
    consumer = PushConsumer(
        bp.address,
        "tls-group",
        listener=received,
        consume_from="FIRST_OFFSET",
        tls=True,
        tls_ca=certs.ca,
    )
    consumer.subscribe("secured")
    with Producer(bp.address, tls=True, tls_ca=certs.ca) as producer, consumer:
        sent = [producer.send(Message("secured", b"m%d" % i)).msg_id for i in range(5)]
        wait_for(lambda: len(received.got) == 5, timeout=30)
        assert sorted(received.got) == sorted(sent)
        assert received.got[sent[3]] == b"m3"
        # a plaintext client is told what to do, in its own protocol
        with Producer(bp.address, send_timeout=5) as plain:
            with pytest.raises(BadRequest, match="requires TLS: connect with tls=True"):
                plain.send(Message("secured", b"plain"))
        # a client that trusts another authority is told why it cannot connect
        with pytest.raises(BrokerUnavailable, match="CERTIFICATE_VERIFY_FAILED") as wrong:
            Producer(bp.address, tls=True, tls_ca=other.ca).start()
        assert "tls_ca" in str(wrong.value)
        # the broker goes on serving its TLS clients
        late = producer.send(Message("secured", b"after"))
        wait_for(lambda: late.msg_id in received.got, timeout=30)
    log = bp.output()
    assert "refused a plaintext connection from 127.0.0.1:" in log
    assert "Traceback" not in log
    assert bp.terminate() == 0


def test_a_tls_client_of_a_plaintext_broker_is_told_why(
    broker_process: BrokerFactory, certs: CertFiles
) -> None:
    bp = broker_process().start()
    with pytest.raises(BrokerUnavailable, match=r"TLS handshake with .* (failed|did not)"):
        Producer(bp.address, tls=True, tls_ca=certs.ca).start()
    with Producer(bp.address) as plain:  # and plaintext still works
        assert plain.send(Message("t", b"x")).status == "SEND_OK"


def test_tls_ca_requires_client_certificates(
    broker_process: BrokerFactory,
    certs: CertFiles,
    other: CertFiles,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bp = broker_process(*server_flags(certs, client_ca=True)).start()
    with pytest.raises(BrokerUnavailable, match="refused this client's certificate"):
        Producer(bp.address, tls=True, tls_ca=certs.ca).start()
    stranger = ClientSecurity(
        tls=True, tls_ca=certs.ca, tls_cert=other.client_cert, tls_key=other.client_key
    )
    with pytest.raises(BrokerUnavailable, match="refused this client's certificate"):
        Producer(bp.address, security=stranger).start()
    # the certificate from the environment, as the CLI's clients take it
    env = {
        "TXMQ_TLS": "1",
        "TXMQ_TLS_CA": str(certs.ca),
        "TXMQ_TLS_CERT": str(certs.client_cert),
        "TXMQ_TLS_KEY": str(certs.client_key),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with Producer(bp.address) as producer:
        assert producer.send(Message("mtls", b"x")).status == "SEND_OK"
    admin = subprocess.run(
        [sys.executable, "-m", "txmq.cli", "admin", "topics", "--broker", bp.address, "--json"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert admin.returncode == 0, admin.stderr
    assert "mtls" in admin.stdout
    monkeypatch.delenv("TXMQ_TLS_CERT")
    monkeypatch.delenv("TXMQ_TLS_KEY")
    refused = subprocess.run(
        [sys.executable, "-m", "txmq.cli", "admin", "topics", "--broker", bp.address],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert refused.returncode == 1
    assert refused.stderr.startswith("txmq: error: ") and "certificate" in refused.stderr
    assert "Traceback" not in refused.stderr
    log = bp.output()
    assert "TLS handshake with 127.0.0.1:" in log and "Traceback" not in log


def test_a_tls_producer_lives_through_sigkills_of_its_broker(
    broker_process: BrokerFactory, certs: CertFiles
) -> None:
    """A broker SIGKILLed while a TLS producer's connection writes to it ends that
    connection, nothing more (anyio says EndOfStream from such a write: once it stopped the
    whole client, and every later request failed "client is not started"): the producer
    reconnects to the restarted broker, and every acknowledged message is there."""
    rng = random.Random(11)
    bp = broker_process(*server_flags(certs, client_ca=True), "--port", str(free_port())).start()
    acked: dict[str, tuple[int, int]] = {}
    errors: list[TxmqError] = []  # not retriable: the sender stopped
    lock, stop = threading.Lock(), threading.Event()

    def sender(producer: Producer, n: int) -> None:
        count = 0
        while not stop.is_set():
            count += 1
            try:
                r = producer.send(Message("killed", b"%d-%d " % (n, count) * 10))
            except TxmqError as exc:
                if not exc.retriable:
                    errors.append(exc)
                    return
                stop.wait(0.01)
                continue
            with lock:
                acked[r.msg_id] = (r.queue_id, r.queue_offset)

    with Producer(bp.address, security=mutual(certs)) as producer:
        threads = [threading.Thread(target=sender, args=(producer, n)) for n in range(6)]
        for t in threads:
            t.start()
        try:
            for _ in range(8):
                goal = len(acked) + 20
                wait_for(lambda g=goal: len(acked) >= g, timeout=30)  # sends flow again
                time.sleep(rng.uniform(0.0, 0.5))
                bp.kill()  # SIGKILL, by PID
                time.sleep(rng.uniform(0.0, 0.3))
                bp.start()  # on its store and port
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert not errors
        # and the same client goes on
        assert producer.send(Message("killed", b"last")).status == "SEND_OK"
    stored = {
        m.msg_id: (m.queue_id, m.queue_offset)
        for m in anyio.run(
            functools.partial(read_topic, bp.address, "killed", security=mutual(certs))
        )
    }
    lost = [mid for mid in acked if stored.get(mid) != acked[mid]]
    assert not lost, f"{len(lost)} of {len(acked)} acknowledged messages not where acknowledged"
    assert bp.terminate() == 0


def test_name_server_and_brokers_over_tls(
    namesrv_process: NamesrvFactory, cluster_broker: BrokerFactory, certs: CertFiles
) -> None:
    ns = namesrv_process("ns")
    ns.args = server_flags(certs)
    ns.start()
    # the brokers check the name server against --tls-ca (and ask their clients for
    # certificates signed by it)
    brokers = [
        cluster_broker(name, [ns.address], *server_flags(certs, client_ca=True)).start()
        for name in ("broker-a", "broker-b")
    ]
    ask_tls = tls_ask(mutual(certs))

    def registered() -> bool:
        info = ask_tls(ns.address, GetClusterInfo())
        return {b.broker_name for b in info.brokers} == {"broker-a", "broker-b"}

    wait_for(registered, timeout=30)
    with pytest.raises(BadRequest, match="requires TLS"):
        ask(ns.address, GetClusterInfo())
    security = mutual(certs)
    with Producer(namesrv=ns.address, security=security) as producer:
        sent = [producer.send(Message("routed", b"%d" % i)) for i in range(16)]
    assert {r.broker_name for r in sent} == {"broker-a", "broker-b"}
    with PullConsumer(namesrv=ns.address, security=security) as pc:
        total = 0
        for q in pc.message_queues("routed"):
            got = pc.pull(q.topic, q.queue_id, 0, long_poll=0, broker_name=q.broker_name)
            total += len(got.messages)
    assert total == 16
    # the one plaintext connection it saw was the test's own, not a broker's
    assert ns.output().count("refused a plaintext connection") == 1
    for bp in brokers:
        assert bp.terminate() == 0, bp.output()[-2000:]


@pytest.fixture
def tls_replica_set(
    tmp_path: Path,
    namesrv_process: NamesrvFactory,
    certs: CertFiles,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[ReplicaSet]:
    """A name server with the controller inside and a SYNC_MASTER broker set of two, all
    over TLS with client certificates (tests/replicaset.py, its requests over TLS)."""
    monkeypatch.setattr(replicaset, "ask", tls_ask(mutual(certs)))
    ns = namesrv_process("ns")
    ns.args = ["--controller-store", str(tmp_path / "controller"), *server_flags(certs)]
    ns.start()
    env = {
        "TXMQ_BROKER_TLS_CERT": str(certs.cert),
        "TXMQ_BROKER_TLS_KEY": str(certs.key),
        "TXMQ_BROKER_TLS_CA": str(certs.ca),
    }
    rs = ReplicaSet(tmp_path, ns, "sync", n=2, env=env)
    try:
        yield rs.start()
    finally:
        for b in rs.brokers.values():
            if b.alive():
                b.kill()


def test_a_replica_set_replicates_over_tls(tls_replica_set: ReplicaSet, certs: CertFiles) -> None:
    rs = tls_replica_set
    master = rs.wait_healthy()
    slave = 1 - master
    with Producer(namesrv=rs.namesrv.address, security=mutual(certs)) as producer:
        results = [producer.send(Message("copied", b"x" * 100)) for _ in range(20)]
    # SYNC_MASTER: SEND_OK once the slave has the bytes (over the TLS HA port)
    assert {r.status for r in results} == {"SEND_OK"}
    end = rs.runtime(master)[1]
    wait_for(lambda: rs.runtime(slave)[1] == end, timeout=30)
    assert rs.log_bytes(slave, end) == rs.log_bytes(master, end)
    ask_tls = tls_ask(mutual(certs))
    info: Any = ask_tls(rs.brokers[slave].address, GetBrokerRuntimeInfo())
    assert info.commit_log_max_offset == end and info.connected
    # the HA port the slave copies from speaks TLS only
    ha = ask_tls(rs.brokers[master].address, GetBrokerRuntimeInfo()).ha_address
    assert ha and info.master_ha_address == ha
    with pytest.raises(BadRequest, match="requires TLS"):
        ask(ha, GetBrokerRuntimeInfo())
    assert "replicating from master" in rs.brokers[slave].output()
    for b in rs.brokers.values():
        assert "Traceback" not in b.output()


OFFICIAL_CLIENT = """
import sys, time
from rocketmq.v5.client import ClientConfiguration, Credentials
from rocketmq.v5.consumer import SimpleConsumer
from rocketmq.v5.model import FilterExpression, Message
from rocketmq.v5.producer import Producer
endpoint, topic = sys.argv[1], sys.argv[2]
cfg = ClientConfiguration(endpoint, Credentials(), request_timeout=5)
producer = Producer(cfg, (topic,), tls_enable=True)
producer.startup()
m = Message()
m.topic, m.body = topic, b"over tls"
print("SENT", producer.send(m).message_id, flush=True)
producer.shutdown()
sub = {topic: FilterExpression("*")}
consumer = SimpleConsumer(cfg, "tls-group", sub, await_duration=2, tls_enable=True)
consumer.startup()
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    got = consumer.receive(16, 15)
    for x in got:
        consumer.ack(x)
        print("RECEIVED", x.message_id, x.body.decode(), flush=True)
    if got:
        break
consumer.shutdown()
"""


def test_the_grpc_endpoint_over_tls(broker_process: BrokerFactory, certs: CertFiles) -> None:
    pytest.importorskip("rocketmq.grpc_protocol")
    port = free_port()
    bp = broker_process("--grpc-port", str(port), *server_flags(certs)).start()
    endpoint = f"127.0.0.1:{port}"
    # the official client trusts what grpc's default roots say: the test CA here
    env = {**os.environ, "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(certs.ca)}
    done = subprocess.run(
        [sys.executable, "-c", OFFICIAL_CLIENT, endpoint, "official-tls"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip
    sent = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("SENT")]
    got = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("RECEIVED")]
    assert len(sent) == 1, done.stdout + done.stderr[-3000:]
    assert got == [[sent[0], "over", "tls"]], done.stdout + done.stderr[-3000:]
    # txmq's own gRPC transport, trusting the CA; and without TLS it cannot connect
    with Producer(endpoint, transport="grpc", tls=True, tls_ca=certs.ca) as producer:
        assert producer.send(Message("official-tls", b"txmq")).status == "SEND_OK"
    with pytest.raises(TxmqError):
        with Producer(endpoint, transport="grpc", connect_timeout=1.0) as plain:
            plain.send(Message("official-tls", b"plain"))
    assert "gRPC endpoint (RocketMQ 5 protocol) listening on" in bp.output()
    assert "(TLS)" in bp.output()


def test_the_console_over_https_reaches_a_tls_broker(
    broker_process: BrokerFactory, certs: CertFiles, tmp_path: Path
) -> None:
    pytest.importorskip("uvicorn")
    bp = broker_process(*server_flags(certs)).start()
    port = free_port()
    env = {**os.environ, "TXMQ_TLS": "1", "TXMQ_TLS_CA": str(certs.ca), "PYTHONUNBUFFERED": "1"}
    log_path = tmp_path / "console.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "txmq.cli", "console", "--broker", bp.address,
             "--port", str(port), *server_flags(certs)],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
        )  # fmt: skip
    trust = ssl.create_default_context(cafile=str(certs.ca))
    url = f"https://127.0.0.1:{port}"
    try:

        def page() -> str | None:
            if proc.poll() is not None:
                raise AssertionError(f"txmq console exited:\n{log_path.read_text()}")
            try:
                with urllib.request.urlopen(url + "/", timeout=5, context=trust) as answer:
                    body: str = answer.read().decode()
                    return body if "broker-a" in body else None
            except (urllib.error.URLError, OSError):
                return None

        body = wait_for(page, timeout=60, interval=0.2)
        assert "broker-a" in body  # the cluster page, read from the TLS broker
        with pytest.raises((urllib.error.URLError, OSError)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert "on https://127.0.0.1:" in log_path.read_text()
