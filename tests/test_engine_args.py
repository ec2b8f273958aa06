"""Unit tests: where the model runs (workers/engine/vllm_args.py `chooses_executor`, `executor_args`).

On the CPU Vigil runs the model inside EngineCore (measured: bench/engine_layout.py); a registry
entry that chooses the executor itself keeps vLLM's choice. The engine side is exercised by every
worker-tier test; these check the rule without importing vLLM."""
from __future__ import annotations

from workers.engine.vllm_args import chooses_executor


def test_one_device_and_no_executor_named_leaves_the_choice_to_vigil():
    assert not chooses_executor({})
    assert not chooses_executor({"max_model_len": 512, "enforce_eager": True})
    assert not chooses_executor({"tensor_parallel_size": 1, "pipeline_parallel_size": "1"})


def test_a_registry_entry_that_names_an_executor_or_asks_for_devices_keeps_it():
    assert chooses_executor({"distributed_executor_backend": "mp"})
    assert chooses_executor({"tensor_parallel_size": 2})
    assert chooses_executor({"pipeline_parallel_size": "2"})
    assert chooses_executor({"data_parallel_size": 4})
