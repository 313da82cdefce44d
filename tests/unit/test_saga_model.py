"""A saga's definition: what it refuses, in one line each, and what it keeps."""

from __future__ import annotations

import pytest

from txmq.saga import Saga, State, Step, tcc
from txmq.sqla.tables import SAGA_STATES


def test_a_definition_says_what_is_wrong_with_it() -> None:
    with pytest.raises(ValueError, match="no steps"):
        Saga("empty", [])
    with pytest.raises(ValueError, match="names a step twice"):
        Saga("twice", [Step("a", "s"), Step("a", "t")])
    with pytest.raises(ValueError, match="letters, digits"):
        Step("has space", "s")
    with pytest.raises(ValueError, match="retries must be 0 to 16"):
        Step("a", "s", retries=17)
    with pytest.raises(ValueError, match="positive number"):
        Step("a", "s", compensation="b", timeout=0)
    with pytest.raises(ValueError, match="has a timeout but no compensation"):
        Step("a", "s", timeout=5)


def test_a_definition_is_stored_and_read_back_the_same() -> None:
    saga = Saga("pay", [Step("charge", "payment", compensation="refund", timeout=60, retries=2)])
    assert Saga.from_dict(saga.to_dict()) == saga
    hold = tcc("hold", [("inventory", "hold", "ship", "unhold")], confirm_retries=2)
    step = hold.steps[0]
    assert (step.action, step.confirm, step.compensation, step.compensation_retries) == (
        "hold",
        "ship",
        "unhold",
        2,
    )


def test_the_table_allows_exactly_the_states_a_saga_has() -> None:
    assert SAGA_STATES == State.ALL
