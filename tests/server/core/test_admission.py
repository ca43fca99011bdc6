"""The byte and call budgets every front end admits a request body through (server/core/admission.py)."""

from __future__ import annotations

import gc

import pytest

from server.core.admission import Admission
from server.core.errors import Overloaded


def test_bodies_beyond_the_byte_budget_are_refused_and_released_bytes_return() -> None:
    admission = Admission(max_bytes=6400, max_calls=100)
    large = [admission.receive(1600) for _ in range(3)]  # 4,800: three quarters
    with pytest.raises(Overloaded, match=r"request bytes budget full \(4800 of 6400 .* kept for small requests"):
        admission.receive(1600)
    small = [admission.receive(100) for _ in range(16)]  # at most 6,400 / 64 = 100: may use the last quarter
    assert admission.held_bytes == 6400
    with pytest.raises(Overloaded, match="request bytes budget full"):
        admission.receive(1)
    large[0].release()
    large[0].release()  # once only
    assert admission.held_bytes == 4800
    del small
    gc.collect()
    assert admission.held_bytes == 3200  # a dropped ticket gives its bytes back


def test_a_connection_holding_calls_is_refused_first_and_a_new_one_gets_the_reserved_places() -> None:
    admission = Admission(max_bytes=1 << 30, max_calls=8)
    flood = [admission.enter("flooder") for _ in range(6)]  # three quarters of 8
    with pytest.raises(Overloaded, match=r"6 of 8 calls .* 6 of them this connection's; the last 25%"):
        admission.enter("flooder")
    others = [admission.enter("first"), admission.enter("second")]  # holding none: the reserve is theirs
    with pytest.raises(Overloaded, match=r"8 of 8 calls"):
        admission.enter("third")
    for ticket in others + flood:
        ticket.release()
    assert admission.calls == 0
    assert admission.enter("flooder") is not None
