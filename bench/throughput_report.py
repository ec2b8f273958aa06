"""bench/throughput.py's summary lines: medians and spreads of each side's per-round figures."""
from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

from bench.throughput_args import Workload


def overhead_summary(o: dict) -> list[str]:
    """The summary's lines for part 2 (bench/overhead.py's figures per round): each side's
    time and worker CPU per request, median (min-max), then each side against the bare no-op
    of the same round."""
    us, ms, rus = o["us"], o["worker_cpu_ms"], o["redis_cpu_us"]
    out = [f"overhead {side:16s}: {spread(us[side], 'us/req')}; worker CPU "
           f"{spread(ms[side], 'ms/req')}; Redis CPU {spread(rus[side], 'us/req')}"
           for side in us]
    for side in us:
        if side == "noop-bare":
            continue
        t = [x / b for x, b in zip(us[side], us["noop-bare"])]
        c = [x / b for x, b in zip(ms[side], ms["noop-bare"])]
        out.append(f"overhead ratio {side}/noop-bare per round: time {spread(t, '')}; "
                   f"worker CPU {spread(c, '')}")
    return out


def summary_lines(w: Workload, t: dict, a: argparse.Namespace) -> list[str]:
    """The summary's lines for one workload's figures `t` (Bench._workload)."""
    out = [f"throughput {w.describe()}, {w.rounds} rounds each, each side going first in turn:"]
    for side, values in t["rates"].items():
        out.append(f"  {side:9s} {spread(values, 'req/s')}")
    out.append(f"  ratio celery/direct per round {spread(t['ratios'], '')}")
    out.append(f"  = engine steps/s celery/direct {spread(t['step_ratios'], '')}")
    out.append(f"  x batch (outputs per step) celery/direct {spread(t['batch_ratios'], '')}")
    if "lp_ratios" in t:
        out.append(f"  logprobs={a.logprobs} (the same rounds): with/without celery "
                   f"{spread(t['celery_lp_cost'], '')}")
        out.append(f"  with/without direct {spread(t['direct_lp_cost'], '')}")
        out.append(f"  ratio celery/direct with logprobs {spread(t['lp_ratios'], '')}")
    if "many_ratios" in t:
        out.append(f"  ratio many/direct per round {spread(t['many_ratios'], '')}")
    if "many_bare_ratios" in t:
        out.append(f"  ratio many/bare per round {spread(t['many_bare_ratios'], '')}")
    if "bare_ratios" in t:
        out.append(f"  ratio bare/direct per round {spread(t['bare_ratios'], '')}")
        out.append(f"  ratio celery/bare per round {spread(t['celery_bare_ratios'], '')}")
    if "lora" in t:
        lr = t["lora"]
        out.append(f"LoRA lanes (direct engine, {a.lora_rounds} rounds each):")
        for side, values in lr.items():
            out.append(f"  {side:13s} {spread(values, 'req/s')}")
        out.append(f"  with/without LoRA: {statistics.median(lr['direct+lora']) / statistics.median(lr['direct-nolora']):.2f}")
    return out


def spread(values: list[float], unit: str) -> str:
    """'median M (min A - max B, N rounds)' of a list of per-round figures."""
    unit = f" {unit}" if unit else ""
    return (f"median {statistics.median(values):.2f}{unit} (min {min(values):.2f} - max "
            f"{max(values):.2f}, {len(values)} rounds)")


def worker_kv(log: Path) -> str:
    """The KV cache size the worker's memory planner gave its engine, from its log."""
    found = re.findall(r"loading engine for model \S+ \(([^\n]*)\)", log.read_text(errors="replace"))
    return found[-1][:200] if found else "(not in its log)"
