from __future__ import annotations

import pytest

from txmq.consumer.allocate import allocate_averagely, allocate_by_circle


@pytest.mark.parametrize("strategy", [allocate_averagely, allocate_by_circle])
@pytest.mark.parametrize(("queues", "members"), [(8, 3), (4, 4), (3, 5), (16, 3), (1, 2)])
def test_shares_are_disjoint_and_cover_everything(strategy, queues: int, members: int) -> None:  # type: ignore[no-untyped-def]
    mqs = [("t", q) for q in range(queues)]
    cids = [f"c{i}" for i in range(members)]
    shares = [strategy("g", c, mqs, cids) for c in cids]
    flat = [q for share in shares for q in share]
    assert sorted(flat) == mqs and len(flat) == len(set(flat))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert strategy("g", "stranger", mqs, cids) == []


def test_averagely_gives_contiguous_blocks_and_circle_interleaves() -> None:
    mqs = [("t", q) for q in range(8)]
    cids = ["a", "b", "c"]
    assert [[q for _, q in allocate_averagely("g", c, mqs, cids)] for c in cids] == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7],
    ]
    assert [[q for _, q in allocate_by_circle("g", c, mqs, cids)] for c in cids] == [
        [0, 3, 6],
        [1, 4, 7],
        [2, 5],
    ]
