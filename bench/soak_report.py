"""What a soak run found (bench/soak.py): each kill, the report, and its printed table.

The figures are filled in by bench/soak_findings.py from Vigil's records, the logs, the steady
worker's memory samples and the result backend.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class Kill:
    """One kill by the supervisor: what, when (Unix time), and what the worker held then."""

    kind: str  # "worker" (whole process group), "engine" (EngineCore only), "drain" (SIGTERM)
    worker: str
    at: float
    held: list[str]
    t_s: float = 0.0  # seconds after the first submit
    recovery_s: float | None = None  # kill -> the last held request ended (None: some never did)
    handback_s: float | None = None  # worker kill -> the last held request requeued or begun again
    exit_s: float | None = None  # a drain: SIGTERM -> the worker's exit (None: it was killed)


@dataclass
class SoakReport:
    """What a soak run found; `ok` says whether it met the goal (see `problems`)."""

    requests: int
    accepted: int = 0
    submit_retries: dict[str, int] = field(default_factory=dict)
    succeeded: int = 0
    failed_by_code: dict[str, int] = field(default_factory=dict)
    failed_samples: list[str] = field(default_factory=list)  # "id: error", the first few
    lost: int = 0
    lost_ids: list[str] = field(default_factory=list)
    lost_detail: list[dict] = field(default_factory=list)  # where each lost request is stuck
    duplicates: int = 0  # per request: not exactly one result, or an attempt left open
    duplicate_ids: list[str] = field(default_factory=list)
    requeued_twice: int = 0  # one dispatch begun (hence published) more than once
    failed_twice: int = 0  # more than one terminal outcome in the history
    wrong_results: int = 0  # succeeded with a token count other than asked (ignore_eos)
    # The engines' witness (workers/engine/witness.py), outside Vigil's records: generations
    # finished (canaries included, and counted apart), how many requests ran to completion N
    # times, those that ran more often than they may (once; twice if a killed worker held
    # them), and stored results no generation backs.
    witness_generations: int = 0
    witness_canaries: int = 0
    generations_per_request: dict[int, int] = field(default_factory=dict)
    ran_too_often: int = 0
    ran_too_often_ids: list[str] = field(default_factory=list)
    witness_mismatches: int = 0
    witness_mismatch_ids: list[str] = field(default_factory=list)
    # Tokens (bench/soak_findings.py, tally_witness): in the stored results; reused by resumes
    # (at each takeover, the tokens the new run did not make again); made by the engines' finished
    # runs (the witness); and thrown away among those (finished runs that are not the stored
    # result's). A SIGKILLed run writes no witness line: what it made after its last stream
    # write (at most one flush interval's worth) is lost and counted nowhere.
    requests_resumed: int = 0
    tokens_in_results: int = 0
    tokens_reused: int = 0
    tokens_generated: int = 0
    tokens_thrown_away: int = 0
    stats: dict[str, int] = field(default_factory=dict)  # vigil:stats (own Redis: this run only)
    attempts: dict[int, int] = field(default_factory=dict)
    reaps: dict[str, int] = field(default_factory=dict)  # dead instance -> times reaped
    republished_by_audit: int = 0  # messages a dead consumer took, published again (logs)
    republished_detail: list[dict] = field(default_factory=list)  # some of them, from records
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    latency_max_s: float | None = None
    slowest: list[dict] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    recovery_worst_s: float | None = None
    recovery_median_s: float | None = None
    unrecovered_kills: int = 0
    handback_worst_s: float | None = None  # over worker kills: see Kill.handback_s
    handback_median_s: float | None = None
    rss_main_mib: dict[str, float] = field(default_factory=dict)  # steady worker, main process
    rss_total_mib: dict[str, float] = field(default_factory=dict)  # ... plus its engine processes
    shm_left: dict[str, int] = field(default_factory=dict)  # /dev/shm segments left behind
    backend_checked: int = 0
    backend_disagreements: list[str] = field(default_factory=list)
    log_errors: dict[str, int] = field(default_factory=dict)  # log file -> ERROR/Traceback lines
    log_error_samples: list[str] = field(default_factory=list)
    # A drain soak (SIGTERM): the generated tokens the workers threw away, every incarnation's
    # own counter as it logged it at exit (None: not read); and, with greedy requests, resumed
    # requests run again uninterrupted (twins) and those whose tokens differ.
    tokens_discarded: int | None = None
    worker_exits_logged: int = 0
    twins_checked: int = 0
    twin_mismatches: int = 0
    twin_mismatch_ids: list[str] = field(default_factory=list)
    # The mix (--mix, bench/soak_mix.py): requests by kind, resumed requests by kind, and the
    # times a bulk run yielded its slot to an interactive request (the records' count).
    kinds: dict[str, int] = field(default_factory=dict)
    resumed_by_kind: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0
    wall_s: float = 0.0
    settings: dict = field(default_factory=dict)
    logdir: str = ""

    @property
    def worker_kills(self) -> int:
        """How many times the victim's whole process group was SIGKILLed."""
        return sum(k.kind == "worker" for k in self.kills)

    @property
    def drains(self) -> int:
        """How many times the victim was SIGTERMed (a drain)."""
        return sum(k.kind == "drain" for k in self.kills)

    @property
    def drain_exit_s(self) -> list[float]:
        """Each drain's SIGTERM -> exit, in seconds (drains that needed a SIGKILL left out)."""
        return [k.exit_s for k in self.kills if k.kind == "drain" and k.exit_s is not None]

    @property
    def engine_kills(self) -> int:
        """How many EngineCore processes were SIGKILLed."""
        return sum(k.kind == "engine" for k in self.kills)

    def problems(self) -> list[str]:
        """What breaks the goal: lost, duplicated, requeued twice, failed twice, wrong token
        counts, results the witness does not back, requests run to completion more often than
        they may, requests not accepted, instances reaped twice, backend disagreements."""
        out = []
        for name in ("lost", "duplicates", "requeued_twice", "failed_twice", "wrong_results",
                     "witness_mismatches", "ran_too_often", "twin_mismatches"):
            if getattr(self, name):
                out.append(f"{name} {getattr(self, name)}")
        if self.drains:  # a drain loses no token, and every drain ends in an exit
            if self.tokens_discarded:
                out.append(f"tokens_discarded {self.tokens_discarded}")
            if len(self.drain_exit_s) < self.drains:
                out.append(f"drains that needed a SIGKILL {self.drains - len(self.drain_exit_s)}")
        if self.accepted < self.requests:
            out.append(f"accepted {self.accepted} of {self.requests}")
        twice = [i for i, n in self.reaps.items() if n > 1]
        if twice:
            out.append(f"instances reaped more than once: {twice}")
        if self.backend_disagreements:
            out.append(f"backend disagreements {len(self.backend_disagreements)}")
        return out

    @property
    def ok(self) -> bool:
        """True when `problems()` is empty."""
        return not self.problems()

    def to_dict(self) -> dict:
        """Every field, plus the kill counts, `ok` and `problems` (for --json / --report)."""
        d = asdict(self)
        d.update(worker_kills=self.worker_kills, engine_kills=self.engine_kills,
                 drains=self.drains, drain_exit_s=self.drain_exit_s, ok=self.ok,
                 problems=self.problems())
        return d

    def table(self) -> str:
        """The human report: one row per figure, then every kill, samples of the log errors,
        the slowest and the lost requests, and OK or the problems."""
        rss = self.rss_main_mib
        tot = self.rss_total_mib
        rows = [
            ("requests", f"{self.requests} asked, {self.accepted} accepted"
             + (f" (submit retries: {fmt_counts(self.submit_retries)})"
                if self.submit_retries else "")),
            ("succeeded", str(self.succeeded)),
            ("failed by code", fmt_counts(self.failed_by_code) or "0"),
            ("lost (never ended)", str(self.lost)),
            ("duplicate results", f"{self.duplicates} (per request history); vigil:stats "
             f"duplicate_results {self.stats.get('duplicate_results', 0)}"),
            ("requeued twice / failed twice", f"{self.requeued_twice} / {self.failed_twice}"),
            ("wrong token counts", str(self.wrong_results)),
            ("witness (engines)", f"{self.witness_generations} generations finished "
             f"({self.witness_canaries} canaries); requests by runs to completion: "
             f"{fmt_counts(self.generations_per_request) or '-'}; more than they may: "
             f"{self.ran_too_often}; stored results no generation backs: "
             f"{self.witness_mismatches}"),
            ("tokens", f"{self.tokens_in_results} in results; {self.tokens_reused} reused by "
             f"{self.requests_resumed} resumed requests; {self.tokens_generated} made by "
             f"finished runs, {self.tokens_thrown_away} of them thrown away (a killed run's "
             f"unwritten tail is not counted)"),
            ("deliveries dropped", f"duplicate {self.stats.get('duplicate_deliveries', 0)}, "
             f"stale {self.stats.get('stale_deliveries', 0)}"),
            ("attempts", fmt_counts(self.attempts)),
            ("latency p50 / p99 / max", f"{_secs(self.latency_p50_s)} / "
             f"{_secs(self.latency_p99_s)} / {_secs(self.latency_max_s)}"),
            ("kills", f"{self.worker_kills} worker, {self.engine_kills} engine, {self.drains} "
             f"drain (SIGTERM); held at kill: {sum(len(k.held) for k in self.kills)} requests"),
            ("drain exit (SIGTERM -> exit)", _spread(self.drain_exit_s)),
            ("tokens discarded (workers' own)", "-" if self.tokens_discarded is None else
             f"{self.tokens_discarded} ({self.worker_exits_logged} worker exits logged; a "
             f"SIGKILLed one logs none)"),
            ("greedy twins", f"{self.twins_checked} resumed requests run again, "
             f"{self.twin_mismatches} differ"),
            ("mix (kinds / resumed)", f"{fmt_counts(self.kinds) or '-'} / "
             f"{fmt_counts(self.resumed_by_kind) or '-'}; preemptions {self.preemptions}"),
            ("recovery worst / median", f"{_secs(self.recovery_worst_s)} / "
             f"{_secs(self.recovery_median_s)}"
             + (f"; {self.unrecovered_kills} kill(s) never recovered" if self.unrecovered_kills
                else "")),
            ("worker kill -> held requeued", f"worst {_secs(self.handback_worst_s)} / median "
             f"{_secs(self.handback_median_s)} (reap timeout "
             f"{self.settings.get('VIGIL_WORKER_REAP_TIMEOUT', '?')} s)"),
            ("reaps", f"{len(self.reaps)} dead instances, reaped "
             f"{fmt_counts(Counter(self.reaps.values()))} time(s); republished by the audit "
             f"after a reap: {self.republished_by_audit}"),
            ("steady RSS main", f"start {rss.get('start', 0):.0f} MiB, end {rss.get('end', 0):.0f}"
             f" MiB, max {rss.get('max', 0):.0f} MiB (at ready {rss.get('ready', 0):.0f})"),
            ("steady RSS incl. engine", f"start {tot.get('start', 0):.0f} MiB, end "
             f"{tot.get('end', 0):.0f} MiB, max {tot.get('max', 0):.0f} MiB"),
            ("/dev/shm left after stop", f"{self.shm_left.get('segments', '?')} segments, "
             f"{self.shm_left.get('used_kib', '?')} KiB used"),
            ("result backend sample", f"{self.backend_checked} checked, "
             f"{len(self.backend_disagreements)} disagree"),
            ("log ERROR lines", fmt_counts(self.log_errors) or "0"),
            ("wall time", f"{self.wall_s:.0f} s"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = ["-- soak report --"] + [f"{k:<{width}}  {v}" for k, v in rows]
        lines.append("kills (t = s after the first submit):")
        for k in self.kills:
            lines.append(f"  t {k.t_s:6.1f}  {k.kind:6s} {k.worker:18s} held {len(k.held):3d}, "
                         f"recovered {_secs(k.recovery_s)}"
                         + (f", requeued {_secs(k.handback_s)}" if k.kind != "engine" else "")
                         + (f", exited {_secs(k.exit_s)}" if k.kind == "drain" else ""))
        lines += [f"  log: {line}" for line in self.log_error_samples]
        lines += [f"  slow: {x}" for x in self.slowest]
        lines += [f"  failed: {x}" for x in self.failed_samples]
        lines += [f"  lost: {x}" for x in self.lost_detail]
        lines += [f"  republished: {x}" for x in self.republished_detail]
        lines.append("OK" if self.ok else "PROBLEMS: " + "; ".join(self.problems()))
        return "\n".join(lines)


def fmt_counts(counts: dict) -> str:
    """`{"a": 1, "b": 2}` as "a: 1, b: 2", sorted by key."""
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=lambda kv: str(kv[0])))


def _spread(xs: list[float]) -> str:
    """Worst / median / best of some durations, or "-"."""
    if not xs:
        return "-"
    return (f"worst {max(xs):.1f} s / median {sorted(xs)[len(xs) // 2]:.1f} s / best "
            f"{min(xs):.1f} s over {len(xs)}")


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} s"
