"""A version that means something: ``txmq.__version__`` and ``txmq --version`` say the
installed distribution's version (pyproject.toml's), which CHANGELOG.md's newest release
describes; sources that were never installed say ``0+unknown``."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import txmq
from txmq.cli import main

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_txmq_version_is_the_installed_one() -> None:
    assert txmq.__version__ == VERSION, (
        "the installed metadata is older than pyproject.toml: install again (scripts/setup.sh)"
    )


def test_the_command_prints_its_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        main(["--version"])  # no command needed
    assert raised.value.code == 0
    assert capsys.readouterr().out == f"txmq {VERSION}\n"


def test_the_version_is_looked_up_when_asked_and_unknown_when_not_installed() -> None:
    """``import txmq`` stays cheap (importlib.metadata loads only for ``__version__``); with
    no distribution metadata (PackageNotFoundError) the version is ``0+unknown``."""
    code = """
        import importlib, sys
        import txmq
        assert "importlib.metadata" not in sys.modules, "imported by 'import txmq'"
        metadata = importlib.import_module("importlib.metadata")
        def not_installed(name):
            raise metadata.PackageNotFoundError(name)
        metadata.version = not_installed
        print(txmq.__version__)
    """
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == "0+unknown\n"


def test_the_changelogs_newest_release_is_this_version() -> None:
    releases = re.findall(
        r"^## \[(\d[^\]]*)\] - \d{4}-\d\d-\d\d$", (ROOT / "CHANGELOG.md").read_text(), re.M
    )
    assert releases and releases[0] == VERSION, releases
