#!/usr/bin/env bash
# The README's first command: set up, then run the orders demo with no outside server: by
# default on a local cluster (a name server and two broker sets, each its own process and
# store in a temporary folder; --single-broker: one broker alone, as before), SQLite
# databases: a few hundred orders, faults injected, a summary, exit 0 if the books balance.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== setting up .venv (the first run installs txmq and its packages: about 15 s)"
scripts/setup.sh
layout="a name server and two broker sets (broker-b SIGKILLed and restarted as orders flow)"
for arg in "$@"; do
    if [ "$arg" = "--single-broker" ]; then layout="one broker (--single-broker)"; fi
done
echo "== running the orders demo on $layout: 300 orders, six injected faults, then the books (about 20 s)"
exec .venv/bin/python -m examples.orders --log-level ERROR demo "$@"
