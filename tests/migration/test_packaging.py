"""What the wheel installs: everything under ``txmq`` (txmq.broker, txmq.outbox, ...),
nothing under a common top-level name that an application's own package could shadow or be
shadowed by; and that installing says nothing a newcomer would take for a problem.  And
what the wheel says it is: its version (``txmq --version``), license, type information and
a short description."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect

ROOT = Path(__file__).resolve().parents[2]
#: what a build reads: pyproject names the description (PYPI.md) and the LICENSE
SOURCES = ["pyproject.toml", "README.md", "PYPI.md", "LICENSE", "txmq"]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


#: what setuptools says when something about the package looks wrong to it (the editable
#: install of a tree with symbolic links printed a boxed BuildBackendWarning)
SETUPTOOLS_WARNINGS = ("BuildBackendWarning", "SetuptoolsWarning", "SetuptoolsDeprecationWarning")


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the sources (a build leaves nothing in the tree)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    return src


def _quiet(run: subprocess.CompletedProcess[str]) -> None:
    said = run.stdout + run.stderr
    assert run.returncode == 0, said[-3000:]
    assert not [w for w in SETUPTOOLS_WARNINGS if w in said], said[-3000:]


@pytest.fixture(scope="module")
def wheel(src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from the sources; building it says nothing (no setuptools warning)."""
    out = tmp_path_factory.mktemp("dist")
    run = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"),
            *("-v", "-w", str(out), str(src)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    _quiet(run)
    (built,) = out.glob("txmq-*.whl")
    return built


def test_an_editable_install_says_nothing_and_installs_txmq_alone(
    src: Path, tmp_path: Path
) -> None:
    """What scripts/setup.sh does (``pip install -e .``), into a fresh environment."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    run = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")),
            *("install", "-v", "--no-deps", "-e", str(src)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    _quiet(run)
    # (found, not imported: --no-deps left txmq's dependencies out)
    find = "import importlib.util as u; print(u.find_spec('txmq').origin)"
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", find],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout.strip()
    assert where == str(src / "txmq" / "__init__.py")


@pytest.fixture(scope="module")
def site(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed into a fresh virtual environment; its site-packages."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "--python", str(python)),
            *("install", "-q", "--no-deps", str(wheel)),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (packages,) = venv.glob("lib/python*/site-packages")
    return packages


def test_the_wheel_holds_only_txmq(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"txmq"}
    for expected in (
        "txmq/broker/server.py",
        "txmq/broker/store/commitlog.py",
        "txmq/outbox/relay.py",
        "txmq/spark/job.py",
        "txmq/migrations/alembic.ini",
        "txmq/migrations/versions/0001_transaction_log.py",
        "txmq/cli/main.py",
        "txmq/namesrv/server.py",
    ):
        assert expected in names


def test_a_fresh_install_has_no_top_level_broker_outbox_spark_or_migrations(site: Path) -> None:
    present = {p.name for p in site.iterdir()}
    assert present & {"broker", "outbox", "spark", "migrations", "cli", "namesrv"} == set()
    assert (site / "txmq" / "broker" / "server.py").is_file()
    assert (site / "txmq" / "py.typed").is_file()


def test_the_wheel_says_what_it_is(wheel: Path) -> None:
    """Its metadata is short (the description, not the 1,300-line README), names the
    license, which it carries, and the version pyproject.toml gives."""
    names = zipfile.ZipFile(wheel).namelist()
    info = f"txmq-{VERSION}.dist-info"
    metadata = zipfile.ZipFile(wheel).read(f"{info}/METADATA")
    assert len(metadata) < 10 * 1024, len(metadata)
    text = metadata.decode()
    assert f"\nVersion: {VERSION}\n" in text
    assert "\nLicense-Expression: Apache-2.0\n" in text and "\nLicense-File: LICENSE\n" in text
    assert "\nClassifier: Typing :: Typed\n" in text
    assert text.endswith((ROOT / "PYPI.md").read_text())
    assert f"{info}/licenses/LICENSE" in names
    assert "txmq/py.typed" in names


@pytest.fixture(scope="module")
def txmq_command(site: Path) -> Path:
    """The fresh environment's ``txmq`` script.  Its dependencies (left out by --no-deps:
    fetching them would make the test slow and need the network) are lent by the running
    environment, appended to the fresh one's path by a .pth line: txmq and its metadata are
    found in the fresh site-packages first."""
    lent = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    (site / "zz_lent_dependencies.pth").write_text("\n".join(lent) + "\n")
    return site.parents[2] / "bin" / "txmq"


def test_a_fresh_install_says_its_version_and_carries_its_license(
    txmq_command: Path, site: Path, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [str(txmq_command), "--version"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=60,
    )
    assert (run.returncode, run.stdout, run.stderr) == (0, f"txmq {VERSION}\n", "")
    # the package and the distribution whose metadata said the version: the wheel's
    where = "import importlib.metadata as m, txmq; print(txmq.__file__, m.distribution('txmq')"
    where += ".locate_file('txmq'))"
    found = subprocess.run(
        [str(txmq_command.parent / "python"), "-c", where],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        check=True,
    ).stdout.split()
    assert [Path(p).is_relative_to(site) for p in found] == [True, True], found
    (license_file,) = site.glob("txmq-*.dist-info/licenses/LICENSE")
    assert "Apache License\n                           Version 2.0" in license_file.read_text()
    assert (site / "txmq" / "py.typed").is_file()


def _app_with_its_own_migrations(tmp_path: Path) -> Path:
    """A project folder as Flask-Migrate leaves it: a ``migrations`` package of its own."""
    app = tmp_path / "app"
    (app / "migrations" / "versions").mkdir(parents=True)
    (app / "migrations" / "__init__.py").write_text(
        'raise ImportError("this is the application\'s own migrations package")\n'
    )
    (app / "migrations" / "env.py").write_text("# the application's alembic env\n")
    (app / "migrations" / "alembic.ini").write_text("[alembic]\n")
    return app


@pytest.mark.parametrize("install", ["wheel", "editable"])
def test_db_upgrade_from_a_project_with_its_own_migrations_package(
    install: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    app = _app_with_its_own_migrations(tmp_path)
    db = app / "app.db"
    env = {**os.environ, "PYTHONPATH": str(app)}  # as an application run from its folder
    if install == "wheel":
        env["PYTHONPATH"] += os.pathsep + str(request.getfixturevalue("site"))
    r = subprocess.run(
        [sys.executable, "-m", "txmq.cli", "db", "upgrade", "--url", f"sqlite:///{db}"],
        cwd=app,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "-> 0005 (head)" in r.stdout
    engine = create_engine(f"sqlite:///{db}")
    try:
        with engine.connect() as conn:
            tables = set(inspect(conn).get_table_names())
    finally:
        engine.dispose()
    assert {"txmq_transaction_log", "txmq_outbox", "txmq_consumed_keys", "txmq_sagas"} <= tables
    if install == "wheel":
        where = subprocess.run(
            [sys.executable, "-c", "import txmq.migrations; print(txmq.migrations.__file__)"],
            cwd=app,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert where.startswith(str(request.getfixturevalue("site")))
