#!/usr/bin/env bash
# The README's first command: set up, then run the orders demo with no outside server (three
# services — orders, inventory, payment — whose orders are sagas): by default on a local cluster (a name server with the failover controller inside, broker set
# broker-a replicated — a master and a slave — and broker-b one broker; each node its own
# process and store in a temporary folder; --single-broker: one broker alone, as before),
# SQLite databases: a load of 300 orders, faults injected between its parts (which place
# orders of their own), a summary, exit 0 if the books balance (money and stock; every saga
# COMPLETED or COMPENSATED).  Each service's HTTP front is a FastAPI app on uvicorn.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== setting up .venv (the first run installs txmq and its packages: about 15 s)"
scripts/setup.sh
layout="a name server and two broker sets (broker-a a master and a slave: its master SIGKILLed and replaced; broker-b SIGKILLed and restarted)"
# the faults' own orders: one for each crash, deadline and reordered fault, and in the
# cluster a flow of orders from the load's 4 clients while broker-b and broker-a's master
# die (some 150-180 in all, as fast as the services answer; one broker alone: 3 while it is
# down); the summary's "load:" line counts both
faults="thirteen injected faults, which place some 150-180 orders of their own (most while a broker set dies)"
takes="about 70 s"
for arg in "$@"; do
    if [ "$arg" = "--single-broker" ]; then
        layout="one broker (--single-broker)"
        faults="twelve injected faults, which place 12 orders of their own"
        takes="about 65 s"
    fi
done
echo "== running the orders demo on $layout: 300 orders of load and $faults; each order a saga; then the books ($takes)"
exec .venv/bin/python -m examples.orders --log-level ERROR demo "$@"
