"""The engine's own account of a measured segment: its steps and how full they ran.

Throughput in tokens/s is exactly (engine steps per second) x (request outputs per step), one
output per request per token made. Counted on both sides of bench/throughput.py by the same
code (workers/engine/vllm.py, `StepCounter`, from the messages EngineCore sends), read from the
worker through its Prometheus endpoint (`vigil_engine_steps_total`,
`vigil_engine_step_outputs_total`) and from the direct engine's round reply. The split says where
a ratio is lost: fewer steps per second (the engine got less CPU, or each step did more work)
or emptier steps (the engine was not fed fast enough).
"""
from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Steps:
    """Engine steps and the request outputs in them, over a segment of `wall` seconds."""

    steps: int
    outputs: int
    wall: float = 0.0

    @property
    def per_s(self) -> float:
        """Engine steps per second of the segment."""
        return self.steps / self.wall if self.wall else 0.0

    @property
    def batch(self) -> float:
        """Mean request outputs per step: how full the engine ran."""
        return self.outputs / self.steps if self.steps else 0.0

    def over(self, before: "Steps", wall: float) -> "Steps":
        """This reading minus `before`, over a segment of `wall` seconds."""
        return Steps(self.steps - before.steps, self.outputs - before.outputs, wall)

    def describe(self) -> str:
        """'steps N (S/s), batch B' for a round's line."""
        return f"steps {self.steps} ({self.per_s:.1f}/s), batch {self.batch:.1f}"


def scrape_steps(port: int, timeout: float = 10.0) -> Steps:
    """The worker's engine counters, read from its /metrics on 127.0.0.1:`port`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    found = {s.name: s.value for fam in text_string_to_metric_families(text)
             for s in fam.samples}
    return Steps(int(found.get("vigil_engine_steps_total", 0)),
                 int(found.get("vigil_engine_step_outputs_total", 0)))
