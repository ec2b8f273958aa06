"""An engine that answers at once without a model: overhead benchmarks and unit tests only.

It exists to measure Vigil's own per-request overhead (bench/throughput.py); it is never a
default and a worker running it logs loudly (`VIGIL_ENGINE=instant`).
"""
from __future__ import annotations

from app.requests.adapters import AdapterRef
from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from workers.engine.memory import MemoryPlan
from workers.engine.output import EngineOutput, Sample


class InstantEngine:
    """Answers every request at once with the prompt echoed back: overhead benchmarks only."""

    def __init__(self, spec: ModelSpec, plan: MemoryPlan | None = None):
        self.spec = spec
        self.max_model_len = spec.max_model_len or 1 << 30
        self.max_num_seqs = 1 << 30
        self.dead = False

    async def run(self, req: GenerateRequest, request_id: str,
                  adapter: AdapterRef | None = None) -> EngineOutput:
        ids = list(req.prompt_token_ids or range(len((req.prompt or "").split())))
        n = min(req.max_tokens, 4)
        samples = [Sample(i, " instant" * n, [1] * n, "length") for i in range(req.n)]
        return EngineOutput.of(samples, len(ids))

    async def add_adapter(self, adapter: AdapterRef) -> None:
        pass

    async def remove_adapter(self, adapter: AdapterRef) -> None:
        pass

    def child_pids(self) -> list[tuple[int, float]]:
        return []

    def shutdown(self, timeout: float) -> None:
        self.dead = True
