"""Unit tier: the three forms of a request's id (app/request_ids.py), built and read back."""
from __future__ import annotations

import pytest

from app.request_ids import (EngineId, attempt_id, canary_id, parse_engine_id, request_id_of,
                             run_id)


@pytest.mark.parametrize("rid", ["6f1c-uuid-with-dashes", "plain", "job:a.b-c"])
def test_an_attempt_and_a_run_id_read_back_to_their_request(rid):
    a = attempt_id(rid, 3)
    assert parse_engine_id(a) == EngineId(rid, 3, 1) and request_id_of(a) == rid
    r = run_id(a, 4)
    assert r == f"{rid}-3.r4" and parse_engine_id(r) == EngineId(rid, 3, 4)
    assert request_id_of(r) == rid
    assert run_id(a, 1) == a  # run 1 is the attempt itself


def test_a_canary_is_no_request_and_a_bare_id_is_not_an_engine_id():
    assert canary_id(7) == "vigil-canary-7"
    with pytest.raises(ValueError):
        parse_engine_id("no-attempt-number-here")
    with pytest.raises(ValueError):
        parse_engine_id("bare")
