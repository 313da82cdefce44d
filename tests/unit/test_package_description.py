"""PYPI.md, the package's long description (what an index shows; the README is the
repository's front page): short, no link an index cannot follow, its commands parse and
its example runs as pasted."""

from __future__ import annotations

import re
import runpy
import shlex
import sqlite3
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from txmq.cli import build_parser, main
from txmq.testing import InProcessBroker

ROOT = Path(__file__).resolve().parents[2]
DESCRIPTION = ROOT / "PYPI.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", DESCRIPTION.read_text(), re.M | re.S)


def test_it_is_the_long_description_and_short() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["readme"] == DESCRIPTION.name
    # METADATA is the description and ~2 KB of headers; the wheel's test keeps it under 10 KB
    assert len(DESCRIPTION.read_bytes()) < 6000


def test_every_link_is_absolute() -> None:
    """An index shows the text alone: a relative link or image (``docs/x.png``,
    ``../shared/...``) leads nowhere there."""
    targets = re.findall(r"\]\(([^)]*)\)", DESCRIPTION.read_text())
    assert [t for t in targets if not t.startswith("https://")] == []


def test_its_txmq_commands_parse() -> None:
    commands = [
        shlex.split(line, comments=True)
        for block in _blocks("sh")
        for line in block.splitlines()
        if line.startswith("txmq ")
    ]
    assert len(commands) == 2
    for argv in commands:
        build_parser().parse_args(argv[1:])  # argparse exits (2) on a wrong command


def test_its_example_runs_as_pasted(
    in_process_broker: Callable[..., InProcessBroker],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ``txmq db upgrade`` line, then the Python block against a broker in this process
    (its address for the default one); the row and the message are both there."""
    broker = in_process_broker()
    monkeypatch.chdir(tmp_path)
    (upgrade,) = [
        line for block in _blocks("sh") for line in block.splitlines() if "db upgrade" in line
    ]
    assert main(shlex.split(upgrade)[1:]) == 0  # in this process: a second start costs ~1 s
    (example,) = _blocks("python")
    assert len(example.splitlines()) <= 25
    script = tmp_path / "example.py"
    script.write_text(example.replace("127.0.0.1:10911", broker.address))
    runpy.run_path(str(script), run_name="__main__")
    assert broker.bodies("orders") == [b'{"id": "o-1", "amount": 42}']
    with sqlite3.connect(tmp_path / "app.db") as db:
        assert db.execute("SELECT id, amount FROM orders").fetchall() == [("o-1", 42)]
