"""A real etcd cluster on loopback, for the controllers-on-etcd tests and benchmarks: N
members, each an ``etcd`` process of its own (Debian's ``etcd-server``; ``scripts/test.sh``
installs it) on free ports chosen at run time, with its data dir and log in a folder of
the caller's.  Nothing here touches a system etcd on port 2379.  Its home is ``bench/``
because the benchmarks may not import from ``tests/`` (``bench/failover_bench.py``'s
``ctl-kill`` runs its controllers on it); the tests import it from here too
(``tests/etcd_cluster.py`` re-exports it, with its pytest fixture).  Standard library only.

    cluster = start_cluster_in(tmp)   # tmp/etcd0/: m0/ m1/ m2/ (data), m0.log ...
    cluster.endpoints_arg             # "127.0.0.1:p0,127.0.0.1:p1,127.0.0.1:p2"
    cluster.kill(cluster.leader())    # SIGKILL by PID; restart(i) starts it again
    cluster.stop_all()                # SIGKILL every member still running

Timing: etcd's default ``--heartbeat-interval 100 --election-timeout 1000`` (ms).  On
loopback the round trip is negligible, so those defaults only have to absorb scheduling
stalls on a loaded machine (one second without a heartbeat before a follower campaigns);
longer values would make every leader-loss test wait longer (a new leader comes about one
to two election timeouts after the old one dies), shorter ones invite spurious elections
on 2 shared cores.  A caller may pass others.

Every wait is bounded (:class:`TimeoutError`); a member that exits on its own fails the
wait at once with :class:`EtcdError` and its log."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import wait_for

ETCD = shutil.which("etcd") or "/usr/bin/etcd"

__all__ = [
    "ETCD",
    "EtcdCluster",
    "EtcdError",
    "EtcdMember",
    "etcd_available",
    "start_cluster",
    "start_cluster_in",
]


class EtcdError(RuntimeError):
    """etcd is not installed, or a member exited on its own (the message has its log)."""


def etcd_available() -> bool:
    """The etcd binary (:data:`ETCD`) is there and executable."""
    return os.access(ETCD, os.X_OK)


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports nothing listens on now (all held at once while choosing, so that
    none is chosen twice); etcd must be told its peers' ports before they start, so port 0
    will not do."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(n):
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports.append(int(s.getsockname()[1]))
        return ports


def _http_json(url: str, body: bytes | None = None, timeout: float = 1.0) -> Any:
    """GET (or POST ``body``) ``url``; the decoded JSON answer, or None when the member does
    not answer (down, paused, not listening yet) or answers with an error."""
    try:
        with urllib.request.urlopen(url, data=body, timeout=timeout) as answer:
            return json.loads(answer.read())
    except (OSError, ValueError):  # URLError, HTTPError and timeouts are OSErrors
        return None


@dataclass
class EtcdMember:
    """One member: its name (``m<i>``), ports, data dir and log; ``proc`` while started."""

    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    paused: bool = False

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class EtcdCluster:
    """A started cluster (see :func:`start_cluster`).  Members are numbered 0..N-1."""

    members: list[EtcdMember]
    token: str
    heartbeat_ms: int = 100
    election_ms: int = 1000
    extra_args: list[str] = field(default_factory=list)

    # -- addresses -------------------------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        """Every member's client address, ``"127.0.0.1:port"`` (whether running or not)."""
        return [m.endpoint for m in self.members]

    @property
    def endpoints_arg(self) -> str:
        """``"127.0.0.1:p1,127.0.0.1:p2,..."``, as a command line takes them."""
        return ",".join(self.endpoints)

    # -- processes -------------------------------------------------------------------------

    def _command(self, m: EtcdMember, state: str) -> list[str]:
        initial = ",".join(f"{o.name}={o.peer_url}" for o in self.members)
        return [
            ETCD,
            "--name", m.name,
            "--data-dir", str(m.data_dir),
            "--listen-client-urls", m.client_url,
            "--advertise-client-urls", m.client_url,
            "--listen-peer-urls", m.peer_url,
            "--initial-advertise-peer-urls", m.peer_url,
            "--initial-cluster", initial,
            "--initial-cluster-state", state,
            "--initial-cluster-token", self.token,
            "--heartbeat-interval", str(self.heartbeat_ms),
            "--election-timeout", str(self.election_ms),
            "--logger", "zap",
            "--log-level", "warn",
            *self.extra_args,
        ]  # fmt: skip

    def _spawn(self, i: int, state: str) -> None:
        m = self.members[i]
        assert not m.running(), f"etcd member {i} is running already"
        # ETCD_* variables would be read as flags too: the command line says everything
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        with m.log_path.open("ab") as log:
            m.proc = subprocess.Popen(
                self._command(m, state), stdout=log, stderr=subprocess.STDOUT, env=env
            )
        m.paused = False

    def pid(self, i: int) -> int:
        proc = self.members[i].proc
        assert proc is not None, f"etcd member {i} was never started"
        return proc.pid

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (by PID) and wait for it to end."""
        m = self.members[i]
        assert m.proc is not None and m.running(), f"etcd member {i} is not running"
        m.proc.send_signal(signal.SIGKILL)
        m.proc.wait(10)
        m.paused = False

    def restart(self, i: int, timeout: float = 20.0) -> None:
        """Start member ``i`` again after :meth:`kill`: same data dir, ports and flags, with
        ``--initial-cluster-state existing``; returns once it reports itself healthy."""
        self._spawn(i, "existing")
        self.wait_member_healthy(i, timeout)

    def pause(self, i: int) -> None:
        """SIGSTOP member ``i``: it stops where it is, its sockets stay open."""
        m = self.members[i]
        assert m.proc is not None and m.running(), f"etcd member {i} is not running"
        m.proc.send_signal(signal.SIGSTOP)
        m.paused = True

    def resume(self, i: int) -> None:
        """SIGCONT member ``i`` after :meth:`pause`."""
        m = self.members[i]
        assert m.proc is not None and m.running(), f"etcd member {i} is not running"
        m.proc.send_signal(signal.SIGCONT)
        m.paused = False

    def live(self) -> list[int]:
        """The members running and not paused."""
        return [i for i, m in enumerate(self.members) if m.running() and not m.paused]

    def stop_all(self) -> None:
        """SIGKILL every member still running (paused ones too: SIGKILL needs no SIGCONT)."""
        for m in self.members:
            if m.proc is not None and m.running():
                m.proc.send_signal(signal.SIGKILL)
                m.proc.wait(10)
            m.paused = False

    # -- state -----------------------------------------------------------------------------

    def member_healthy(self, i: int) -> bool:
        """Member ``i`` answers ``/health`` with ``"health": "true"`` (it has a leader and
        the cluster answers its reads); False if it is down, paused or without a leader."""
        m = self.members[i]
        if not m.running() or m.paused:
            return False
        answer = _http_json(f"{m.client_url}/health")
        return isinstance(answer, dict) and answer.get("health") == "true"

    def healthy(self) -> bool:
        """Every member running and not paused is healthy (and at least one is)."""
        live = self.live()
        return bool(live) and all(self.member_healthy(i) for i in live)

    def wait_member_healthy(self, i: int, timeout: float = 20.0) -> None:
        def ok() -> bool:
            proc = self.members[i].proc
            if proc is not None and proc.poll() is not None:
                raise EtcdError(
                    f"etcd member {i} exited with {proc.returncode}:\n{self.members[i].log()}"
                )
            return self.member_healthy(i)

        wait_for(ok, timeout, 0.05, f"etcd member {i} healthy")

    def wait_healthy(self, timeout: float = 20.0) -> None:
        """Wait until :meth:`healthy` (a member that exits fails it at once, with its log)."""

        def ok() -> bool:
            for i, m in enumerate(self.members):
                code = None if m.proc is None else m.proc.poll()
                if code is not None and code != -signal.SIGKILL:  # not killed by kill()
                    raise EtcdError(f"etcd member {i} exited with {code}:\n{m.log()}")
            return self.healthy()

        wait_for(ok, timeout, 0.05, "etcd cluster healthy")

    def status(self, i: int) -> dict[str, Any] | None:
        """Member ``i``'s ``Maintenance.Status`` through the HTTP/JSON gateway (64-bit ids
        come as decimal strings), or None if it does not answer within a second."""
        m = self.members[i]
        if not m.running() or m.paused:
            return None
        answer = _http_json(f"{m.client_url}/v3/maintenance/status", b"{}")
        return answer if isinstance(answer, dict) else None

    def member_ids(self) -> dict[str, int]:
        """etcd's member id (as the gateway spells it) → member index, for the members that
        answer now."""
        ids = {}
        for i in range(len(self.members)):
            s = self.status(i)
            if s is not None:
                ids[str(s["header"]["member_id"])] = i
        return ids

    def _leader_now(self) -> int | None:
        statuses = {i: self.status(i) for i in self.live()}
        answered = {i: s for i, s in statuses.items() if s is not None}
        ids = {str(s["header"]["member_id"]): i for i, s in answered.items()}
        leaders = {str(s.get("leader", "0")) for s in answered.values()}
        if len(leaders) != 1:
            return None  # no answer, or members disagree (an election is going on)
        (leader,) = leaders
        return ids.get(leader)  # None: no leader ("0"), or one that does not answer

    def leader(self, timeout: float = 20.0) -> int:
        """The index of the current leader: the member that every live member names as
        leader and that answers itself (waits, up to ``timeout``, through an election)."""
        found: list[int] = []

        def known() -> bool:
            i = self._leader_now()
            if i is not None:
                found.append(i)
            return i is not None

        wait_for(known, timeout, 0.05, "an etcd leader")
        return found[-1]


def start_cluster(
    tmp_path: Path,
    members: int = 3,
    *,
    heartbeat_ms: int = 100,
    election_ms: int = 1000,
    extra_args: list[str] | None = None,
    timeout: float = 30.0,
) -> EtcdCluster:
    """Start a new cluster in ``tmp_path`` (data dirs ``m<i>/``, logs ``m<i>.log``) and wait
    until every member is healthy; the caller ends it with :meth:`EtcdCluster.stop_all`.
    EtcdError if etcd is not installed or a member exits (its log says why)."""
    if not etcd_available():
        raise EtcdError(f"etcd not found ({ETCD}): apt-get install etcd-server")
    ports = _free_ports(2 * members)
    token = f"txmq-test-{uuid.uuid4().hex[:12]}"
    cluster = EtcdCluster(
        [
            EtcdMember(
                f"m{i}",
                ports[2 * i],
                ports[2 * i + 1],
                tmp_path / f"m{i}",
                tmp_path / f"m{i}.log",
            )
            for i in range(members)
        ],
        token,
        heartbeat_ms,
        election_ms,
        list(extra_args or []),
    )
    try:
        for i in range(members):
            cluster._spawn(i, "new")
        cluster.wait_healthy(timeout)
    except BaseException:
        cluster.stop_all()
        raise
    return cluster


def start_cluster_in(
    parent: Path, members: int = 3, *, attempts: int = 3, **kwargs: Any
) -> EtcdCluster:
    """:func:`start_cluster` in the first folder ``parent/etcd<n>`` not there yet; if a
    port chosen free was taken by another process before etcd bound it, once more (in the
    next folder, with other ports), ``attempts`` times in all."""
    n = 0
    for attempt in range(attempts):
        while (parent / f"etcd{n}").exists():  # (as many as the folders there: bounded)
            n += 1
        where = parent / f"etcd{n}"
        where.mkdir(parents=True)
        try:
            return start_cluster(where, members, **kwargs)
        except EtcdError as exc:
            if "address already in use" in str(exc) and attempt < attempts - 1:
                continue
            raise
    raise AssertionError("unreachable")
