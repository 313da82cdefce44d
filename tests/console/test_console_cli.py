"""``txmq console``: its help, and one clear line when the console extra is missing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import ROOT
from txmq.cli import console as console_cli
from txmq.cli.main import main


def test_help_names_the_options_and_the_extra() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "txmq.cli", "console", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for word in ("--broker", "--namesrv", "--db", "--host", "--port", "examples:", "txmq[console]"):
        assert word in out


def test_a_missing_extra_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "starlette" else real(name, *args)

    monkeypatch.setattr(console_cli.importlib.util, "find_spec", find_spec)
    assert main(["console", "--broker", "127.0.0.1:1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "txmq: error: the web console needs the console extra (starlette not installed): "
        "pip install 'txmq[console]'"
    )
