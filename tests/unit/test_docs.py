"""The documentation site builds with ``mkdocs build --strict`` (a broken link or anchor, a
page missing from the navigation, an API name mkdocstrings cannot find, a stale
``docs/txmq.toml`` are errors), and its API reference shows every public name (issue 31,
item 1). The docs' code blocks run in tests/integration/test_readme.py."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

#: the modules the API reference documents, and their pages
REFERENCE = {
    "txmq": "txmq",
    "txmq.sync": "sync",
    "txmq.sqla": "sqla",
    "txmq.outbox": "outbox",
    "txmq.saga": "saga",
    "txmq.testing": "testing",
    "txmq.asgi": "asgi",
    "txmq.admin": "admin",
}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (the docs extra: pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return out


@pytest.mark.timeout(300)
def test_mkdocs_build_strict(site: Path) -> None:
    assert (site / "index.html").is_file()
    assert (site / "txmq.toml").is_file()  # the sample, served beside its reference
    assert not (site / "hooks").exists()  # the generator is not published
    page = (site / "configuration.html").read_text().replace("<wbr>", "")
    assert "<!-- configuration-reference -->" not in page
    assert "TXMQ_BROKER_DEDUPE_WINDOW_S" in page and "TXMQ_TLS_CA" in page
    operations = (site / "operations.html").read_text()
    assert "usage: txmq broker start" in operations and "txmq-help" not in operations


@pytest.mark.timeout(300)
def test_the_api_reference_shows_every_public_name(site: Path) -> None:
    for module, page in REFERENCE.items():
        html = (site / "reference" / f"{page}.html").read_text()
        ids = set(re.findall(r'id="([\w.]+)"', html))
        names = importlib.import_module(module).__all__
        # a function named as its submodule (txmq.saga.operate) is shown by its full path
        missing = [n for n in names if not {f"{module}.{n}", f"{module}.{n}.{n}"} & ids]
        assert missing == [], f"{module}: {missing} not on reference/{page}.md"
