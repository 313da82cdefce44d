#!/usr/bin/env bash
# The README's second command: install everything the tests need, then lint, type-check
# and run the whole test suite.  Safe to run again and again.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi

# Debian packages for the Spark reconciliation job: the PostgreSQL JDBC driver, and a Java
# runtime for Spark (17, unless one is there already); chromium for the console's tests.
debs=""
dpkg -s libpostgresql-jdbc-java >/dev/null 2>&1 || debs="libpostgresql-jdbc-java"
command -v java >/dev/null || debs="$debs openjdk-17-jre-headless"
# the web console's browser tests (tests/console/): Debian's chromium and its driver
dpkg -s chromium >/dev/null 2>&1 || debs="$debs chromium"
dpkg -s chromium-driver >/dev/null 2>&1 || debs="$debs chromium-driver"
# the controllers-on-etcd tests (tests/etcd_cluster.py): Debian's etcd-server, whose etcd
# they start themselves on free ports (its systemd unit, and port 2379, play no part)
dpkg -s etcd-server >/dev/null 2>&1 || debs="$debs etcd-server"
if [ -n "$debs" ]; then
    echo "== installing Debian packages:$debs"
    $SUDO apt-get update -qq
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $debs >/dev/null
fi

# PostgreSQL: start the local cluster if it is down (tests use TXMQ_TEST_DATABASE_URL).
if command -v pg_isready >/dev/null && ! pg_isready -q -h 127.0.0.1 -p 5432; then
    echo "== starting PostgreSQL"
    $SUDO pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
    for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi

echo "== setting up .venv (the first run installs the dev, bench and spark extras: 1-2 min)"
scripts/setup.sh dev

echo "== ruff"
.venv/bin/ruff check txmq examples tests bench
echo "== mypy"
.venv/bin/mypy
workers="${TXMQ_TEST_WORKERS:-4}"
echo "== pytest on $workers workers (the whole suite takes several minutes; [done/total] at each line's end)"
# in parallel (pytest-xdist): every test has its own ports (0), stores (tmp_path) and
# PostgreSQL schemas; the Spark tests share one worker (tests/conftest.py, SparkTogether).
# The header says how many tests there are ("4 workers [N items]"); -ra ends with a line
# for every test that did not pass, with the reason a test was skipped.
exec .venv/bin/pytest -p no:cacheprovider -n "$workers" -ra -o console_output_style=count "$@"
