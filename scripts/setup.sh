#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with txmq installed (editable).
#   scripts/setup.sh            the package and the orders example's web stack (FastAPI,
#                               uvicorn): enough for the demo
#   scripts/setup.sh dev        plus test, lint, benchmark and documentation tools and PySpark
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "txmq needs Python 3.11 or newer (found $("$PY" --version 2>&1))" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
extras="[examples]"
if [ "${1:-}" = "dev" ]; then
    extras="[dev,bench,spark,grpc,console,docs,examples,etcd]"
fi
stamp=".venv/.txmq-installed${extras}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".${extras}"
    touch "$stamp"
fi
