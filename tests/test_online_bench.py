"""Unit tier: the measurements of bench/online.py are pure functions of what the client saw and
what the durable streams hold, tested here on hand-made readings: SSE events parsed as both
`vllm serve` and `vigil api` write them, TTFT and inter-token gaps counted as `vllm bench
serve` counts them, each token's live delay taken from the chunk that holds its position (not
from its neighbour's), the kill's accounting of durable and recomputed tokens, and the engine
args turned into `vllm serve` flags that vLLM's own parser reads back as the same values."""
from __future__ import annotations

import json

import pytest

from app.state.streams import Entry
from bench.online_client import Stream, quantile, take_event
from bench.online_redis import accounting, by_position, first_token_stages, live_delays


def event(ids: list[int], text: str = "x", finish=None) -> bytes:
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": [
        {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}]}).encode()


def test_events_with_tokens_are_timed_and_the_end_needs_done_and_a_finish():
    s = Stream("r", sent=10.0, sent_wall=1000.0)
    take_event(s, event([5]), 10.2, 1000.2)
    take_event(s, event([6, 7]), 10.5, 1000.5)
    take_event(s, event([], "", finish="length"), 10.6, 1000.6)  # vLLM's finish chunk
    assert not s.ok
    take_event(s, b"[DONE]", 10.7, 1000.7)
    assert s.ok and s.token_ids == [5, 6, 7] and s.counts == [1, 2]
    assert s.ttft == pytest.approx(0.2)
    assert s.gaps() == [pytest.approx(0.3)]  # one gap per event, as vllm bench serve counts


def test_an_error_event_fails_the_stream():
    s = Stream("r")
    take_event(s, json.dumps({"error": {"message": "boom", "code": "x"}}).encode(), 1, 1)
    take_event(s, b"[DONE]", 2, 2)
    assert not s.ok and "boom" in s.error


def chunk(start: int, ids: list[int], w: float | None, ms: int, attempt: int = 1) -> Entry:
    return Entry(f"{ms}-0", start=start, token_ids=ids, attempt=attempt, made_at=w)


def test_live_delay_matches_each_token_to_the_chunk_holding_its_position():
    es = [chunk(0, [1], 100.000, 100_004), chunk(1, [2, 3], 100.010, 100_013),
          chunk(3, [4], 100.020, 100_022)]
    assert by_position(es)[2] is es[1]
    s = Stream("r", walls=[100.006, 100.016, 100.030, 100.050], counts=[1, 2, 1, 1])
    total, worker, relay, tail, multi = live_delays(s, es)
    assert total == pytest.approx([0.006, 0.006, 0.006, 0.010])
    assert worker == pytest.approx([0.004, 0.003, 0.003, 0.002])
    assert relay == pytest.approx([0.002, 0.003, 0.003, 0.008])
    assert tail == 1  # the fifth token came with the result: no chunk, no w
    assert multi == 2


def test_first_token_stages_add_up_to_the_ttft():
    class Client:
        def hmget(self, key, *fields):
            return [b"1000.010", b"1000.030"]

    s = Stream("r", sent_wall=1000.0, walls=[1000.080], counts=[1])
    es = [chunk(0, [1], 1000.060, 1_000_070)]
    st = first_token_stages(Client(), s, es)
    assert list(st.values()) == pytest.approx([0.010, 0.020, 0.030, 0.010, 0.010])
    assert sum(st.values()) == pytest.approx(0.080)


def test_kill_accounting_counts_the_dead_attempts_durable_tokens_and_the_steps_after():
    es = [chunk(0, [1], 10.00, 10_001), chunk(1, [2], 10.01, 10_011),
          chunk(2, [3, 4], 10.03, 10_031), chunk(4, [5], 10.04, 10_041),
          chunk(5, [6], 20.00, 20_001, attempt=2)]
    a = accounting(es, {"resumed_at": [5]}, killed_at=10.075)
    assert a["durable"] == 5 and a["resumed_at"] == [5] and a["attempts"] == 2
    assert a["step_s"] == pytest.approx(0.01)
    assert a["after_last"] == pytest.approx(3.5)  # 3 whole steps made after the last chunk


def test_quantile_is_nearest_rank():
    xs = list(range(1, 101))
    assert quantile(xs, 0.5) == 50 and quantile(xs, 0.99) == 99 and quantile(xs, 1.0) == 100


def test_engine_args_become_vllm_serve_flags_that_vllm_reads_back_the_same():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from app.requests.models import ModelSpec
    from bench.online_fleet import serve_flags

    spec = ModelSpec(name="m", path="/m", engine_args={
        "max_model_len": 512, "enforce_eager": True, "seed": 0,
        "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}})
    from vllm.config import StructuredOutputsConfig

    args = {"disable_log_stats": True, "scheduling_policy": "priority",
            "distributed_executor_backend": object, "max_model_len": 512,
            "enforce_eager": True, "seed": 0, "dtype": "float32",
            "kv_cache_memory_bytes": 1 << 30, "enable_lora": True, "max_loras": 2,
            "max_lora_rank": 8, "structured_outputs_config": StructuredOutputsConfig(
                backend="xgrammar", disable_any_whitespace=True)}
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    parsed = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", "/m",
                                                              *serve_flags(spec, args)]))
    for k, v in args.items():
        if k == "distributed_executor_backend":
            assert parsed.distributed_executor_backend in (None, "mp", "uni")  # not a flag
        elif k == "structured_outputs_config":
            assert parsed.structured_outputs_config.backend == "xgrammar"
            assert parsed.structured_outputs_config.disable_any_whitespace is True
        else:
            assert getattr(parsed, k) == v, k


def test_the_engines_own_inter_token_time_comes_from_consecutive_chunks_of_one_attempt():
    from bench.online_redis import step_gaps

    es = [chunk(0, [1], 10.00, 0), chunk(1, [2], 10.02, 0), chunk(2, [3, 4], 10.06, 0),
          chunk(4, [5], 30.00, 0, attempt=2), chunk(5, [6], 30.01, 0, attempt=2)]
    assert step_gaps(es) == pytest.approx([0.02, 0.02, 0.02, 0.01])  # not across the attempts
