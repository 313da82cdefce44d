#!/usr/bin/env bash
# The README's first command: set up, then run the orders demo on the embedded default
# (a broker process with its store in a temporary folder, SQLite databases, no other
# server): a few hundred orders, faults injected, a summary, exit 0 if the books balance.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m examples.orders --log-level ERROR demo "$@"
