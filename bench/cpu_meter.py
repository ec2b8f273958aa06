"""CPU accounting for the benchmark: per-process CPU over a measured segment, and helpers."""
from __future__ import annotations

import os
from pathlib import Path

# How long the bench waits for one request's result before counting it as failed.
GET_TIMEOUT_S = 900.0


class CpuMeter:
    """CPU seconds used by labelled process trees over a segment, as % of one core."""

    def __init__(self):
        self.roots: dict[str, tuple[int, bool]] = {}

    def add(self, label: str, pid: int, children: bool = True) -> None:
        self.roots[label] = (pid, children)

    def remove(self, label: str) -> None:
        self.roots.pop(label, None)

    def snapshot(self) -> dict[int, tuple[str, float]]:
        import psutil

        out = {}
        for label, (pid, children) in self.roots.items():
            try:
                root = psutil.Process(pid)
                procs = [(label, root)] + [(f"{label}/{_pname(c)}", c)
                                           for c in (root.children(recursive=True)
                                                     if children else ())]
            except psutil.Error:
                continue
            for name, p in procs:
                try:
                    t = p.cpu_times()
                    out[p.pid] = (name, t.user + t.system)
                except psutil.Error:
                    continue
        return out

    @staticmethod
    def diff(before, after, wall: float) -> dict[str, float]:
        """label -> % of one core over `wall` seconds (children of one kind summed)."""
        agg: dict[str, float] = {}
        for pid, (name, cpu) in after.items():
            used = cpu - before.get(pid, (name, 0.0))[1]
            agg[name] = agg.get(name, 0.0) + used
        return {k: 100.0 * v / wall for k, v in sorted(agg.items()) if 100.0 * v / wall >= 0.5}


def collect(results) -> tuple[list, list[str]]:
    """Wait for every AsyncResult: (values of the successes, errors as 'Type: message')."""
    values, errors = [], []
    for res in results:
        try:
            values.append(res.get(timeout=GET_TIMEOUT_S))
        except Exception as e:  # a failed request is counted and reported, not fatal
            errors.append(f"{type(e).__name__}: {e}"[:200])
    return values, errors


def _errors_note(errors: list[str]) -> str:
    if not errors:
        return ""
    kinds: dict[str, int] = {}
    for e in errors:
        kinds[e] = kinds.get(e, 0) + 1
    top = max(kinds, key=kinds.get)
    return f" (!) {len(errors)} FAILED, e.g. {kinds[top]} x {top}"


def renice_engine(root_pid: int, niceness: int) -> int:
    """Experiment: lower the priority of every thread of root_pid's vLLM child processes
    (EngineCore, model worker). Nice is per thread on Linux. Returns threads reniced."""
    import psutil

    done = 0
    for child in psutil.Process(root_pid).children(recursive=True):
        try:
            if not child.name().startswith("VLLM::"):
                continue
            for tid in os.listdir(f"/proc/{child.pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
                done += 1
        except (psutil.Error, OSError):
            continue
    return done


def _pname(p) -> str:
    try:
        name = p.name()
        if name.startswith("python"):
            cmd = p.cmdline()
            name = next((c for c in cmd[1:] if not c.startswith("-")), name).split(".")[-1]
        return name
    except Exception:
        return "?"


def _fmt_cpu(cpu: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.0f}" for k, v in cpu.items())


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


