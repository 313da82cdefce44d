#!/usr/bin/env bash
# The README's first command: set up, then run the orders demo with no outside server (three
# services — orders, inventory, payment — whose orders are sagas): by default on a local cluster (a name server with the failover controller inside, broker set
# broker-a replicated — a master and a slave — and broker-b one broker; each node its own
# process and store in a temporary folder; --single-broker: one broker alone, as before),
# SQLite databases: a few hundred orders, faults injected, a summary, exit 0 if the books
# balance (money and stock; every saga COMPLETED or COMPENSATED).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== setting up .venv (the first run installs txmq and its packages: about 15 s)"
scripts/setup.sh
layout="a name server and two broker sets (broker-a a master and a slave: its master SIGKILLed and replaced; broker-b SIGKILLed and restarted)"
faults="thirteen injected faults"
takes="about 90 s"
for arg in "$@"; do
    if [ "$arg" = "--single-broker" ]; then
        layout="one broker (--single-broker)"
        faults="twelve injected faults"
        takes="about 70 s"
    fi
done
echo "== running the orders demo on $layout: 300 orders (each a saga), $faults, then the books ($takes)"
exec .venv/bin/python -m examples.orders --log-level ERROR demo "$@"
