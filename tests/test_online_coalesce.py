"""Unit tier: concurrent online calls submitted together (app/online/coalesce.py), over a
stand-in submit that records each submit it is given and can be held or made to refuse."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.errors import OVERLOADED, RequestError
from app.online.coalesce import Coalescer
from tests.conftest import wait_until


class Submits:
    """Records every submit; the first one blocks until `go` is set; ids in `refuse` make a
    submit that holds them raise (all or nothing, as app/requests/submit.py)."""

    def __init__(self, refuse=()):
        self.calls: list[list[str]] = []
        self.go = threading.Event()
        self.refuse = set(refuse)
        self._lock = threading.Lock()

    def __call__(self, items, ids):
        with self._lock:
            self.calls.append(list(ids))
            first = len(self.calls) == 1
        if first:
            self.go.wait(10)
        if self.refuse & set(ids):
            raise RequestError.of(OVERLOADED, f"refused {sorted(self.refuse & set(ids))}")


def test_a_lone_call_is_submitted_at_once_as_it_is():
    s = Submits()
    s.go.set()
    Coalescer(s, 100).submit([{"p": 1}, {"p": 2}], ["a", "b"])
    assert s.calls == [["a", "b"]]


def test_calls_arriving_while_a_submit_is_in_flight_go_together_in_the_next_one():
    s = Submits()
    c = Coalescer(s, 100)
    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(c.submit, [{}], ["first"])
        wait_until(lambda: len(s.calls) == 1, 5)
        rest = [pool.submit(c.submit, [{}], [f"r{i}"]) for i in range(6)]
        wait_until(lambda: c.waiting == 6, 5)  # they wait while one is in flight
        s.go.set()
        for f in [first, *rest]:
            f.result(10)
    assert s.calls[0] == ["first"]
    assert sorted(s.calls[1]) == [f"r{i}" for i in range(6)] and len(s.calls) == 2
    assert c.batches == 2


def test_a_refused_batch_is_submitted_call_by_call_so_each_caller_gets_its_own_outcome():
    s = Submits(refuse={"bad"})
    c = Coalescer(s, 100)
    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(c.submit, [{}], ["first"])
        wait_until(lambda: len(s.calls) == 1, 5)
        good = pool.submit(c.submit, [{}, {}], ["g1", "g2"])
        bad = pool.submit(c.submit, [{}], ["bad"])
        also = pool.submit(c.submit, [{}], ["also"])
        wait_until(lambda: c.waiting == 3, 5)
        s.go.set()
        first.result(10)
        good.result(10)
        also.result(10)
        with pytest.raises(RequestError, match="refused"):
            bad.result(10)
    batch = s.calls[1]
    assert sorted(batch) == ["also", "bad", "g1", "g2"]  # tried together first
    alone = sorted(s.calls[2:])
    assert alone == [["also"], ["bad"], ["g1", "g2"]]  # then each call alone


def test_a_batch_takes_calls_up_to_the_most_requests_one_submit_takes():
    s = Submits()
    c = Coalescer(s, 4)
    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(c.submit, [{}], ["first"])
        wait_until(lambda: len(s.calls) == 1, 5)
        calls = [pool.submit(c.submit, [{}, {}], [f"a{i}", f"b{i}"]) for i in range(3)]
        wait_until(lambda: c.waiting == 3, 5)
        s.go.set()
        for f in [first, *calls]:
            f.result(10)
    assert [len(x) for x in s.calls] == [1, 4, 2]  # 2 + 2 of the 3 calls, then the last
    assert sorted(r for x in s.calls for r in x) == sorted(
        ["first"] + [f"{k}{i}" for i in range(3) for k in "ab"])
