#!/usr/bin/env bash
# The README's first command: set up, then run the demo on the embedded default
# (a broker in a temporary folder, no other server).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/txmq --log-level WARNING quickstart "$@"
