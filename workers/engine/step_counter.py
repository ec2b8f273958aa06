"""The count of an AsyncLLM's engine steps and how full they ran, from vLLM's own messages."""
from __future__ import annotations


class StepCounter:
    """Counts what an AsyncLLM's EngineCore sends its front end: batches of outputs (`steps`:
    about one per engine step; 3 requests of 4 tokens each, run together, arrived in 5) and the
    request outputs in them (`outputs`: one per request that made a token in a step, so `outputs /
    steps` is the engine's mean batch, how full it ran). Counted from vLLM's own messages, not
    Vigil's records: the worker's engine and the benchmark's direct engine (bench/direct_engine.py)
    count alike.

    Wraps the method AsyncLLM's output handler calls for each batch; the handler looks it up on
    every iteration."""

    def __init__(self, llm):
        self.steps = 0
        self.outputs = 0
        # True while the output handler waits for EngineCore's next batch: everything before it
        # has been processed into vLLM's request states.
        self.waiting = False
        core = llm.engine_core
        fetch = core.get_output_async

        async def counted():
            self.waiting = True
            try:
                out = await fetch()
            finally:
                self.waiting = False
            self.steps += 1
            self.outputs += len(out.outputs)
            return out

        core.get_output_async = counted
