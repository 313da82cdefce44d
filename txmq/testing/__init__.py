"""Test your services against txmq without starting broker processes.

A pytest plugin (installed with txmq; name it in your ``conftest.py`` to be explicit, or
where plugins are not loaded automatically)::

    pytest_plugins = ["txmq.testing"]

    def test_an_order_is_announced(txmq_broker):
        place_order(...)                        # your code: txmq.sync.Producer() etc.
        assert [m.body for m in txmq_broker.messages("orders")] == [b"..."]

The fixture ``txmq_broker`` is a real broker (:class:`InProcessBroker`: its store in
memory, ``/dev/shm``, where there is one, else in the test's temporary folder) reached
through the loopback transport: while the test runs,
clients given no address and no transport reach it (``$TXMQ_TRANSPORT`` and
``$TXMQ_BROKER_ADDRESS`` point there), and push consumers commit their offsets every
0.05 s (``$TXMQ_PERSIST_INTERVAL_S``), so that :meth:`~InProcessBroker.wait_consumed`
returns soon.  Give the broker other settings by overriding the fixture
``txmq_broker_settings`` (a dict of :class:`txmq.broker.state.config.BrokerConfig` fields).

What a test can ask of it: :meth:`~InProcessBroker.messages` of a topic,
:meth:`~InProcessBroker.wait_consumed` / :meth:`~InProcessBroker.wait_consumed_async`
for a group, :meth:`~InProcessBroker.check_back_now` (transaction check-backs),
:meth:`~InProcessBroker.fail_next` (the next sends fail, or lose their answer) and
:meth:`~InProcessBroker.advance` (delay levels, retries and timers come due now).
"""

from __future__ import annotations

import importlib.util

from txmq.testing.broker import ConsumeTimeout, InProcessBroker

__all__ = ["ConsumeTimeout", "InProcessBroker"]

if importlib.util.find_spec("pytest") is not None:  # the fixtures, where pytest is
    from txmq.testing.plugin import txmq_broker, txmq_broker_settings

    __all__ += ["txmq_broker", "txmq_broker_settings"]
