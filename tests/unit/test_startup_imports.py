"""What starting a process imports: ``import txmq`` nothing of its own until a name is used,
the ``txmq`` command's parser none of what its commands run, and a broker without metrics,
gRPC or a database none of their libraries (tests and fault drills start brokers by the
hundred)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: libraries a process loads only for a feature that uses them
HEAVY = (
    "sqlalchemy",
    "alembic",
    "prometheus_client",
    "grpc",
    "cryptography",
    "opentelemetry",
    "http.client",
    "http.server",
    "urllib.request",
    "uvicorn",
    "starlette",
    "pyspark",
)


def _run(code: str) -> str:
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_import_txmq_imports_its_names_when_used() -> None:
    out = _run(
        """
        import importlib, sys
        import txmq
        assert [m for m in sys.modules if m.startswith("txmq.")] == [], sys.modules.keys()
        assert set(txmq.__all__) <= set(dir(txmq))
        from txmq import AdminClient
        assert AdminClient is importlib.import_module("txmq.admin.client").AdminClient
        for name in txmq.__all__:
            assert getattr(txmq, name) is not None, name
        try:
            txmq.no_such_name
        except AttributeError as exc:
            assert "no_such_name" in str(exc)
        print("ok")
        """
    )
    assert out == "ok"


def test_the_command_line_parser_imports_no_command() -> None:
    out = _run(
        f"""
        import sys
        from txmq.cli import build_parser
        build_parser()
        loaded = sorted(m for m in sys.modules if m.startswith({HEAVY!r}) or m.startswith(
            ("txmq.admin", "txmq.broker", "txmq.client", "txmq.namesrv", "txmq.console")
        ))
        print(loaded)
        """
    )
    assert out == "[]"


def test_a_broker_without_metrics_grpc_or_database_imports_none_of_them(tmp_path: Path) -> None:
    out = _run(
        f"""
        import sys
        from pathlib import Path
        from txmq.broker.resources import prepare_process
        from txmq.broker.server import Broker
        from txmq.broker.state.config import BrokerConfig
        from txmq.cli.serve import run_server
        store = Path({str(tmp_path / "store")!r})
        Broker(BrokerConfig(store=store, port=0, grpc_port=0, metrics_port=0))
        print(sorted(m for m in sys.modules if m.startswith({HEAVY!r})))
        """
    )
    assert out == "[]"
