"""Soak: thousands of requests over two CPU workers and beat while a supervisor kills them.

    python -m bench.soak                                    # 10,000 requests, kills every 20/30 s
    python -m bench.soak --requests 2000 --json             # the report as JSON on stdout

Self-contained, like bench/throughput.py: a private redis-server (append-only), two
`vigil worker --cpu` processes (real vLLM CPU engine, tiny-llama), `--beats` `celery beat`s
(two by default: each with its own schedule file, so every housekeeping task is sent twice and
only its lock keeps it from acting twice), a producer thread calling `generate.delay` (`--rate`
per second, never more than `--window` requests open; a submit refused with a TransientError is
retried after 0.5 s and counted) and a supervisor thread that, while the producer submits,

- every `--worker-kill-every` s SIGKILLs the whole process group of the *victim* worker (its
  engine processes and orphan guard with it) once it is ready, and starts a fresh one under the
  same node name;
- every `--engine-kill-every` s SIGKILLs the EngineCore process of a live worker (the *steady*
  worker and the victim in turn). The steady worker's main process is never killed, so its RSS
  from after warm-up to the end says whether a worker leaks.

Each kill is recorded with the request ids the worker held at that moment (its in-flight set,
`vigil:inflight:{instance}`); its recovery time is from the kill until the last of them ended.

The report comes from Vigil's own records once every request ended (or `--drain-timeout`
passed): succeeded, failed by code, lost (no terminal record), duplicates and double
requeues/fails (from each request's attempt history), latency from the records' timestamps,
reaps per dead instance (from the workers' logs), the steady worker's RSS, and a sample of
results read back through Celery's result backend. Exit status 1 when anything was lost, ran to a
result twice, was requeued twice for one dispatch or failed twice.

`--kill-worker-at N` / `--kill-engine-at N` kill by progress instead of time (when N requests
have ended): the short version in the test suite (tests/test_soak_e2e.py) uses them.
`--quiesce-kills` pauses the producer around a whole-worker kill: from before it until every
open request is held by a worker (in its in-flight set), to after it until Redis has dropped the
dead worker's connections. Without it, as by default, kills land at any moment, and a message
can be lost to the reaper: one a consumer fetched in the last milliseconds before the SIGKILL,
before Celery's task_received (docs/architecture.md, Known gaps), or one that a BRPOP the dead
worker left blocked took in the milliseconds before Redis saw its socket close (Redis pops the
message and writes it to a socket nobody reads: it is in no queue, no unacked hash and no
in-flight set, and only the deadline sweep ends its request). The report lists every request
that never ended with where its message is; the drain stops waiting once every open request has
had no message anywhere for STRANDED_S.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from app.embedded import (REPO, EmbeddedRedis, start_process, start_worker, stop_process,
                          vigil_env, wait_for)

MODEL = "tiny-llama"
QUEUE = f"vigil.pool.{MODEL}"
STEADY = "steady@soakhost"
VICTIM = "victim@soakhost"
WORDS = ("river stone light paper window garden music silver engine winter market story "
         "lantern forest signal harbor").split()
# Open requests with no message anywhere for this long are stranded: the drain stops waiting.
STRANDED_S = 30
SHM_DIR = "/dev/shm"
# Records are read back this many at a time (one pipeline each).
READ_CHUNK = 500


@dataclass
class Kill:
    """One kill by the supervisor: what, when (Unix time), and what the worker held then."""

    kind: str  # "worker" (whole process group) or "engine" (EngineCore only)
    worker: str
    at: float
    held: list[str]
    quiesced: bool = False
    t_s: float = 0.0  # seconds after the first submit
    recovery_s: float | None = None  # kill -> the last held request ended (None: some never did)


@dataclass
class SoakReport:
    """What a soak run found; `ok` says whether it met the goal (see `problems`)."""

    requests: int
    accepted: int = 0
    submit_retries: dict[str, int] = field(default_factory=dict)
    succeeded: int = 0
    failed_by_code: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    lost_ids: list[str] = field(default_factory=list)
    lost_detail: list[dict] = field(default_factory=list)  # where each lost request is stuck
    duplicates: int = 0  # per request: not exactly one result, or an attempt left open
    duplicate_ids: list[str] = field(default_factory=list)
    requeued_twice: int = 0  # one dispatch begun (hence published) more than once
    failed_twice: int = 0  # more than one terminal outcome in the history
    wrong_results: int = 0  # succeeded with a token count other than asked (ignore_eos)
    stats: dict[str, int] = field(default_factory=dict)  # vigil:stats (own Redis: this run only)
    attempts: dict[int, int] = field(default_factory=dict)
    reaps: dict[str, int] = field(default_factory=dict)  # dead instance -> times reaped
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    latency_max_s: float | None = None
    slowest: list[dict] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    recovery_worst_s: float | None = None
    recovery_median_s: float | None = None
    unrecovered_kills: int = 0
    rss_main_mib: dict[str, float] = field(default_factory=dict)  # steady worker, main process
    rss_total_mib: dict[str, float] = field(default_factory=dict)  # ... plus its engine processes
    shm_left: dict[str, int] = field(default_factory=dict)  # /dev/shm segments left behind
    backend_checked: int = 0
    backend_disagreements: list[str] = field(default_factory=list)
    log_errors: dict[str, int] = field(default_factory=dict)  # log file -> ERROR/Traceback lines
    log_error_samples: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    settings: dict = field(default_factory=dict)
    logdir: str = ""

    @property
    def worker_kills(self) -> int:
        return sum(k.kind == "worker" for k in self.kills)

    @property
    def engine_kills(self) -> int:
        return sum(k.kind == "engine" for k in self.kills)

    def problems(self) -> list[str]:
        """What breaks the goal: lost, duplicated, requeued twice, failed twice, double reaps."""
        out = []
        for name in ("lost", "duplicates", "requeued_twice", "failed_twice", "wrong_results"):
            if getattr(self, name):
                out.append(f"{name} {getattr(self, name)}")
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
        return not self.problems()

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(worker_kills=self.worker_kills, engine_kills=self.engine_kills, ok=self.ok,
                 problems=self.problems())
        return d

    def table(self) -> str:
        """The human report."""
        def s(x):
            return "-" if x is None else f"{x:.1f} s"

        rss = self.rss_main_mib
        tot = self.rss_total_mib
        rows = [
            ("requests", f"{self.requests} asked, {self.accepted} accepted"
             + (f" (submit retries: {_fmt(self.submit_retries)})" if self.submit_retries else "")),
            ("succeeded", str(self.succeeded)),
            ("failed by code", _fmt(self.failed_by_code) or "0"),
            ("lost (never ended)", str(self.lost)),
            ("duplicate results", f"{self.duplicates} (per request history); vigil:stats "
             f"duplicate_results {self.stats.get('duplicate_results', 0)}"),
            ("requeued twice / failed twice", f"{self.requeued_twice} / {self.failed_twice}"),
            ("wrong token counts", str(self.wrong_results)),
            ("deliveries dropped", f"duplicate {self.stats.get('duplicate_deliveries', 0)}, "
             f"stale {self.stats.get('stale_deliveries', 0)}"),
            ("attempts", _fmt(self.attempts)),
            ("latency p50 / p99 / max", f"{s(self.latency_p50_s)} / {s(self.latency_p99_s)} / "
             f"{s(self.latency_max_s)}"),
            ("kills", f"{self.worker_kills} worker, {self.engine_kills} engine; held at kill: "
             f"{sum(len(k.held) for k in self.kills)} requests"),
            ("recovery worst / median", f"{s(self.recovery_worst_s)} / "
             f"{s(self.recovery_median_s)}"
             + (f"; {self.unrecovered_kills} kill(s) never recovered" if self.unrecovered_kills
                else "")),
            ("reaps", f"{len(self.reaps)} dead instances, reaped "
             f"{_fmt(Counter(self.reaps.values()))} time(s)"),
            ("steady RSS main", f"start {rss.get('start', 0):.0f} MiB, end {rss.get('end', 0):.0f}"
             f" MiB, max {rss.get('max', 0):.0f} MiB (at ready {rss.get('ready', 0):.0f})"),
            ("steady RSS incl. engine", f"start {tot.get('start', 0):.0f} MiB, end "
             f"{tot.get('end', 0):.0f} MiB, max {tot.get('max', 0):.0f} MiB"),
            ("/dev/shm left after stop", f"{self.shm_left.get('segments', '?')} segments, "
             f"{self.shm_left.get('used_kib', '?')} KiB used"),
            ("result backend sample", f"{self.backend_checked} checked, "
             f"{len(self.backend_disagreements)} disagree"),
            ("log ERROR lines", _fmt(self.log_errors) or "0"),
            ("wall time", f"{self.wall_s:.0f} s"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = ["-- soak report --"] + [f"{k:<{width}}  {v}" for k, v in rows]
        lines.append("kills (t = s after the first submit):")
        for k in self.kills:
            lines.append(f"  t {k.t_s:6.1f}  {k.kind:6s} {k.worker:18s} held {len(k.held):3d}"
                         f"{' (quiesced)' if k.quiesced else ''}, recovered "
                         f"{s(k.recovery_s)}")
        for line in self.log_error_samples:
            lines.append(f"  log: {line}")
        for x in self.slowest:
            lines.append(f"  slow: {x}")
        for x in self.lost_detail:
            lines.append(f"  lost: {x}")
        lines.append("OK" if self.ok else "PROBLEMS: " + "; ".join(self.problems()))
        return "\n".join(lines)


def _fmt(counts: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=lambda kv: str(kv[0])))


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Soak:
    """One soak run (use `run_soak`)."""

    def __init__(self, *, requests: int, worker_kill_every: float, engine_kill_every: float,
                 beats: int, max_tokens: int, window: int, rate: float, kill_worker_at: list[int],
                 kill_engine_at: list[int], quiesce_kills: bool, reap_timeout: float,
                 request_timeout: float, drain_timeout: float | None, logdir: Path,
                 cache_dir: str, seed: int, say):
        self.n = requests
        self.worker_every, self.engine_every = worker_kill_every, engine_kill_every
        self.beats_n, self.max_tokens, self.window, self.rate = beats, max_tokens, window, rate
        self.kill_worker_at, self.kill_engine_at = sorted(kill_worker_at), sorted(kill_engine_at)
        self.by_progress = bool(kill_worker_at or kill_engine_at)
        self.quiesce_kills = quiesce_kills
        self.reap_timeout, self.request_timeout = reap_timeout, request_timeout
        self.logdir, self.cache_dir, self.seed, self.say = logdir, cache_dir, seed, say
        # Past Redis' visibility timeout with these settings (VIGIL_REQUEST_TIMEOUT + backoff
        # max + 60): a message left in a dead worker's unacked hash comes back after it.
        self.drain_timeout = drain_timeout or request_timeout + 60 + 60 + 120
        self.env = dict(
            VIGIL_CACHE_DIR=cache_dir, VIGIL_HEARTBEAT_INTERVAL="1",
            VIGIL_WORKER_REAP_TIMEOUT=f"{reap_timeout:g}",
            # A dead worker that never became ready is judged by the same window (a warming
            # worker heartbeats, so it is never reaped while alive).
            VIGIL_WORKER_REGISTRATION_GRACE=f"{reap_timeout:g}",
            VIGIL_ALLOW_SHORT_REAP_TIMEOUT="1", VIGIL_REQUEST_TIMEOUT=f"{request_timeout:g}",
            # The engine stays loaded through the drain: RSS start and end are comparable.
            VIGIL_IDLE_CLEANUP="0")
        self.redis: EmbeddedRedis | None = None
        self.procs: dict[str, object] = {}  # role -> Popen (workers: node name)
        self.lock = threading.Lock()  # guards self.procs against the supervisor's restarts
        self.stop = threading.Event()
        self.pause = threading.Event()  # set: the producer must not submit
        self.producer_idle = threading.Event()  # the producer is waiting, not in a submit
        self.producer_done = threading.Event()
        self.ids: list[str] = []
        self.asked_tokens: dict[str, int] = {}
        self.submit_retries: Counter = Counter()
        self.kills: list[Kill] = []
        self.rss: list[dict] = []  # the steady worker's memory every 2 s (`_sample`)
        self.rss_ready: dict | None = None
        self.errors: list[BaseException] = []
        self.shm_before: set[str] = set()
        self.client = None
        self.t0 = self.t_wall0 = 0.0

    # -- processes ---------------------------------------------------------------------------
    def _start_worker(self, name: str):
        log = self.logdir / f"{name.split('@')[0]}.log"
        proc = start_worker(self.redis.url, name, log, concurrency=64, pools=MODEL, **self.env)
        with self.lock:
            self.procs[name] = proc
        return proc

    def _entry(self, name: str) -> dict[str, str] | None:
        """The registry entry of the live process now running as `name` (matched by pid: a
        killed incarnation's entry stays until it is reaped)."""
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return None
        r = self.client
        for key in r.scan_iter("vigil:worker:*", count=100):
            e = {k.decode(): v.decode() for k, v in r.hgetall(key).items()}
            if e.get("pid") == str(proc.pid) and e.get("name") == name:
                return e
        return None

    def _ready(self, name: str) -> dict[str, str] | None:
        e = self._entry(name)
        if e and int(e.get("engine_loads") or 0) >= 1 and e.get("engine_state") == "ready":
            return e
        return None

    def _engine_cores(self, name: str) -> list[int]:
        import psutil

        proc = self.procs.get(name)
        out = []
        try:
            for p in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if "EngineCore" in " ".join(p.cmdline()) + p.name():
                        out.append(p.pid)
                except psutil.Error:
                    continue
        except psutil.Error:
            pass
        return out

    def _sample(self, name: str) -> dict | None:
        """A worker's memory now: RSS (MiB) of its main process and of main + every
        descendant (engine processes, orphan guard)."""
        import psutil

        try:
            p = psutil.Process(self.procs[name].pid)
            main = p.memory_info().rss
            total = main
            for c in p.children(recursive=True):
                try:
                    total += c.memory_info().rss
                except psutil.Error:
                    continue
        except psutil.Error:
            return None
        return {"t": round(time.monotonic() - self.t0, 1), "ended": self.ended(),
                "main": main / 2**20, "total": total / 2**20,
                "engine_up": bool(self._ready(name) and self._engine_cores(name))}

    @staticmethod
    def _shm_files() -> set[str]:
        try:
            return {f for f in os.listdir(SHM_DIR) if f.startswith("psm_")}
        except OSError:
            return set()

    def shm_left(self, rep: SoakReport) -> None:
        """POSIX shared-memory segments (vLLM's message queues) created during the run and
        still in /dev/shm after every process stopped: leaked (another user's processes on
        the machine could add to this count)."""
        left = self._shm_files() - self.shm_before
        used = 0
        for f in left:
            try:
                used += os.stat(os.path.join(SHM_DIR, f)).st_blocks * 512
            except OSError:
                continue
        rep.shm_left = {"segments": len(left), "used_kib": used // 1024}

    # -- load --------------------------------------------------------------------------------
    def open_requests(self) -> int:
        from app import keys

        return self.client.scard(keys.pool_requests(MODEL))

    def ended(self) -> int:
        return len(self.ids) - self.open_requests()

    def produce(self) -> None:
        """Submit every request at `rate` per second (0: as fast as allowed), keeping at most
        `window` open (not yet ended) at once."""
        from app.errors import TransientError
        from tasks.inference import generate

        rng = random.Random(self.seed)
        try:
            for i in range(self.n):
                words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
                tokens = rng.randint(max(1, self.max_tokens // 4), self.max_tokens)
                while True:
                    self.producer_idle.set()
                    due = self.t0 + i / self.rate if self.rate else 0
                    while (self.pause.is_set() or time.monotonic() < due
                           or self.open_requests() >= self.window) and not self.stop.is_set():
                        time.sleep(0.02)
                    if self.stop.is_set():
                        return
                    self.producer_idle.clear()
                    if self.pause.is_set():
                        continue
                    try:
                        r = generate.delay(model=MODEL, prompt=f"soak {i}: {words}",
                                           max_tokens=tokens, ignore_eos=True)
                        break
                    except TransientError as e:  # redis_unavailable / overloaded: wait, retry
                        self.submit_retries[e.code] += 1
                        time.sleep(0.5)
                self.ids.append(r.id)
                self.asked_tokens[r.id] = tokens
        except BaseException as e:
            self.errors.append(e)
            raise
        finally:
            self.producer_idle.set()
            self.producer_done.set()

    # -- the supervisor ----------------------------------------------------------------------
    def supervise(self) -> None:
        try:
            self._supervise()
        except BaseException as e:
            self.errors.append(e)
            raise

    def _supervise(self) -> None:
        last_worker = last_engine = last_rss = time.monotonic()
        engine_turn = 0
        while not self.stop.is_set():
            now = time.monotonic()
            ended = self.ended()
            if now - last_rss >= 2:
                last_rss = now
                sample = self._sample(STEADY)
                if sample:
                    self.rss.append(sample)
            if self.by_progress:  # once the count is reached and the target holds requests
                if self.kill_worker_at and ended >= self.kill_worker_at[0] \
                        and self._ready(VICTIM) and self._held(VICTIM):
                    self.kill_worker_at.pop(0)
                    self.kill_worker()
                if self.kill_engine_at and ended >= self.kill_engine_at[0]:
                    for target in (STEADY, VICTIM):
                        if self._ready(target) and self._engine_cores(target) \
                                and self._held(target):
                            self.kill_engine_at.pop(0)
                            self.kill_engine(target)
                            break
            elif not self.producer_done.is_set():  # by time, not while the last ones drain
                if self.worker_every and now - last_worker >= self.worker_every \
                        and self._ready(VICTIM):
                    self.kill_worker()
                    last_worker = time.monotonic()
                if self.engine_every and now - last_engine >= self.engine_every:
                    order = (STEADY, VICTIM) if engine_turn % 2 == 0 else (VICTIM, STEADY)
                    for target in order:
                        if self._ready(target) and self._engine_cores(target):
                            self.kill_engine(target)
                            engine_turn += 1
                            last_engine = time.monotonic()
                            break
            self.stop.wait(0.25)

    def _held(self, name: str) -> list[str]:
        from app import keys

        e = self._entry(name)
        if not e:
            return []
        return sorted(x.decode() for x in self.client.smembers(keys.inflight(e["instance_id"])))

    def _quiesce(self) -> bool:
        """Pause the producer until every open request is held by a live worker (or ended)."""
        from app import keys

        self.pause.set()
        self.producer_idle.wait(30)

        def all_taken():
            if self.client.llen(QUEUE):
                return False
            open_ids = self.client.smembers(keys.pool_requests(MODEL))
            held = set()
            for name in (STEADY, VICTIM):
                e = self._entry(name)
                if e:
                    held |= self.client.smembers(keys.inflight(e["instance_id"]))
            return open_ids <= held

        try:
            wait_for(all_taken, 60, 0.02, "every open request to be held by a worker")
            return True
        except TimeoutError:
            self.say("quiesce timed out: killing anyway")
            return False

    def kill_worker(self) -> None:
        """SIGKILL the victim's whole process group, then start a fresh one under its name.

        Quiesced, the producer stays paused until Redis has dropped every connection of the
        dead worker: until then a BRPOP it left blocked still takes the next message published
        (Redis pops it and writes it to a socket nobody will read), and that message is in no
        queue, no unacked hash and no in-flight set."""
        quiesced = self._quiesce() if self.quiesce_kills else False
        proc = self.procs[VICTIM]
        try:
            held = self._held(VICTIM)
            ports = self._redis_ports(proc.pid)
            at = time.time()
            os.killpg(proc.pid, signal.SIGKILL)
            stop_process(proc, timeout=10)  # reaps it; anything left of the group is killed
            if quiesced:
                try:
                    wait_for(lambda: not ports & self._client_ports(), 30, 0.02,
                             "Redis to drop the killed worker's connections")
                except TimeoutError as e:
                    self.say(f"{e}: resuming the producer anyway")
        finally:
            self.pause.clear()
        self.kills.append(Kill("worker", VICTIM, at, held, quiesced, at - self.t_wall0))
        self.say(f"[{at - self.t_wall0:6.1f} s] SIGKILL worker {VICTIM} (group {proc.pid}), "
                 f"holding {len(held)}; ended {self.ended()}/{len(self.ids)}")
        self._start_worker(VICTIM)

    def _redis_ports(self, pid: int) -> set[int]:
        """Local ports of a process's (and its children's) TCP connections to our Redis."""
        import psutil

        out = set()
        try:
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                try:
                    out |= {c.laddr.port for c in p.net_connections(kind="tcp")
                            if c.raddr and c.raddr.port == self.redis.port}
                except psutil.Error:
                    continue
        except psutil.Error:
            pass
        return out

    def _client_ports(self) -> set[int]:
        """Ports of the clients Redis has connected now."""
        return {int(c["addr"].rsplit(":", 1)[1]) for c in self.client.client_list()}

    def kill_engine(self, name: str) -> None:
        pids = self._engine_cores(name)
        held = self._held(name)
        at = time.time()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.kills.append(Kill("engine", name, at, held, t_s=at - self.t_wall0))
        self.say(f"[{at - self.t_wall0:6.1f} s] SIGKILL EngineCore {pids} of {name}, holding "
                 f"{len(held)}; ended {self.ended()}/{len(self.ids)}")

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> SoakReport:
        started = time.monotonic()
        self.shm_before = self._shm_files()
        self.redis = EmbeddedRedis(appendonly=True).start()
        self.client = self.redis.client()
        os.environ["VIGIL_REDIS_URL"] = self.redis.url
        os.environ["VIGIL_CACHE_DIR"] = self.cache_dir
        _fresh_app(self.redis.url)
        self._build_model()
        self.say(f"soak: {self.n} requests, logs in {self.logdir}, Redis {self.redis.url}")
        for name in (STEADY, VICTIM):
            self._start_worker(name)
        for i in range(self.beats_n):
            self.procs[f"beat{i}"] = start_process(
                [sys.executable, "-m", "celery", "-A", "app", "beat", "-l", "INFO",
                 "-s", str(self.logdir / f"beat{i}-schedule")],
                vigil_env(self.redis.url, **self.env), self.logdir / f"beat{i}.log")
        for name in (STEADY, VICTIM):
            wait_for(lambda: self._alive_or_raise(name) and self._ready(name), 600, 0.5,
                     f"{name}'s engine")
        self.rss_ready = self._sample(STEADY)
        self.say(f"workers ready after {time.monotonic() - started:.0f} s; submitting")
        self.t0, self.t_wall0 = time.monotonic(), time.time()
        producer = threading.Thread(target=self.produce, name="soak-producer", daemon=True)
        supervisor = threading.Thread(target=self.supervise, name="soak-supervisor", daemon=True)
        producer.start()
        supervisor.start()
        try:
            self._wait_all(producer)
        finally:
            self.stop.set()
            producer.join(10)
            supervisor.join(60)
        last = self._sample(STEADY)
        if last:
            self.rss.append(last)
        report = self.report(time.monotonic() - started)
        return report

    def _alive_or_raise(self, name: str) -> bool:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited ({proc.returncode}); see {self.logdir}")
        return True

    def _build_model(self) -> None:
        from app.models import get_registry
        from workers.tiny_model import is_built

        path = get_registry().get(MODEL).path
        if not is_built(path):  # once, here: two workers building it at once would race
            subprocess.run([sys.executable, "-m", "app.cli", "model", "build-tiny", path],
                           check=True, env=vigil_env(self.redis.url, **self.env), cwd=str(REPO),
                           stdout=subprocess.DEVNULL)

    def _wait_all(self, producer: threading.Thread) -> None:
        """Until every request is submitted and ended, printing progress every 10 s. After the
        last submit, stop waiting at the drain timeout, or once every open request has had no
        message anywhere (queue, unacked, in-flight set) for STRANDED_S: nothing will run it."""
        from app import keys

        last_say = last_look = 0.0
        drain_deadline = stranded_since = None
        while True:
            if self.errors:
                raise RuntimeError(f"soak thread failed: {self.errors[0]!r}") from self.errors[0]
            now = time.monotonic()
            done = self.producer_done.is_set()
            open_n = self.open_requests()
            if done and drain_deadline is None:
                drain_deadline = now + self.drain_timeout
            if done and open_n == 0:
                return
            if drain_deadline is not None and now > drain_deadline:
                self.say(f"drain timeout: {open_n} request(s) still open")
                return
            if done and now - last_look >= 5:
                last_look = now
                open_ids = [x.decode() for x in
                            self.client.smembers(keys.pool_requests(MODEL))]
                if all(self._nowhere(w) for w in self._locate(open_ids).values()):
                    stranded_since = stranded_since or now
                    if now - stranded_since >= STRANDED_S:
                        self.say(f"{open_n} open request(s) have had no message anywhere for "
                                 f"{STRANDED_S} s: not waiting for them")
                        return
                else:
                    stranded_since = None
            if now - last_say >= 10:
                last_say = now
                rss = self.rss[-1]["main"] if self.rss else 0
                self.say(f"[{now - self.t0:6.1f} s] submitted {len(self.ids)}/{self.n}, "
                         f"ended {len(self.ids) - open_n}, open {open_n}, kills "
                         f"{len(self.kills)}, steady RSS {rss:.0f} MiB")
            time.sleep(0.5)

    # -- the report --------------------------------------------------------------------------
    def _records(self) -> dict[str, dict | None]:
        from app import keys

        fields = ("status", "created_at", "finished_at", "error", "result", "attempts",
                  "dispatch", "history")
        out: dict[str, dict | None] = {}
        for i in range(0, len(self.ids), READ_CHUNK):
            chunk = self.ids[i:i + READ_CHUNK]
            pipe = self.client.pipeline(transaction=False)
            for rid in chunk:
                pipe.hmget(keys.request(rid), *fields)
            for rid, vals in zip(chunk, pipe.execute()):
                if vals[0] is None:
                    out[rid] = None
                    continue
                rec = {f: (v.decode() if v is not None else None) for f, v in zip(fields, vals)}
                h = json.loads(rec["history"]) if rec["history"] else []
                rec["history"] = h if isinstance(h, list) else []
                out[rid] = rec
        return out

    def report(self, wall: float) -> SoakReport:
        rep = SoakReport(requests=self.n, accepted=len(self.ids),
                         submit_retries=dict(self.submit_retries), kills=self.kills,
                         wall_s=wall, logdir=str(self.logdir),
                         settings={k: v for k, v in self.env.items() if k != "VIGIL_CACHE_DIR"}
                         | {"beats": self.beats_n, "window": self.window,
                            "max_tokens": self.max_tokens, "rate": self.rate,
                            "worker_kill_every": self.worker_every,
                            "engine_kill_every": self.engine_every})
        recs = self._records()
        failed, attempts, latencies = Counter(), Counter(), []
        for rid, rec in recs.items():
            if rec is None or rec["status"] not in ("SUCCEEDED", "FAILED"):
                rep.lost += 1
                rep.lost_ids.append(rid)
                continue
            h = rec["history"]
            outcomes = Counter(e.get("outcome") for e in h)
            dispatches = Counter(e.get("dispatch") for e in h)
            attempts[int(rec["attempts"] or 0)] += 1
            latencies.append((float(rec["finished_at"]) - float(rec["created_at"]), rid))
            if rec["status"] == "SUCCEEDED":
                rep.succeeded += 1
                res = json.loads(rec["result"])
                if res.get("completion_tokens") != self.asked_tokens[rid]:
                    rep.wrong_results += 1
                bad = outcomes["succeeded"] != 1 or outcomes[None] or outcomes["failed"]
            else:
                failed[(rec["error"] or "unknown").split(":", 1)[0]] += 1
                bad = outcomes["succeeded"] or outcomes[None]
            if bad:
                rep.duplicates += 1
                rep.duplicate_ids.append(rid)
            if any(n > 1 for n in dispatches.values()):
                rep.requeued_twice += 1
            if outcomes["failed"] > 1:
                rep.failed_twice += 1
        rep.failed_by_code = dict(failed)
        rep.lost_detail = self._where(rep.lost_ids[:10], recs)
        rep.attempts = dict(sorted(attempts.items()))
        rep.stats = {k.decode(): int(v) for k, v in self.client.hgetall("vigil:stats").items()}
        if latencies:
            xs = [x for x, _ in latencies]
            rep.latency_p50_s, rep.latency_p99_s = _quantile(xs, 0.5), _quantile(xs, 0.99)
            rep.latency_max_s = max(xs)
            for lat, rid in sorted(latencies, reverse=True)[:3]:
                rec = recs[rid]
                rep.slowest.append({"id": rid, "latency_s": round(lat, 1),
                                    "history": [(e.get("worker"), e.get("dispatch"),
                                                 e.get("outcome"), e.get("error"))
                                                for e in rec["history"]]})
        for k in self.kills:
            ends = [recs.get(rid) for rid in k.held]
            if all(r and r["finished_at"] for r in ends):
                k.recovery_s = max([float(r["finished_at"]) - k.at for r in ends], default=0.0)
        recov = [k.recovery_s for k in self.kills if k.recovery_s is not None]
        rep.unrecovered_kills = sum(k.recovery_s is None for k in self.kills)
        if recov:
            rep.recovery_worst_s, rep.recovery_median_s = max(recov), statistics.median(recov)
        self._rss_report(rep)
        self._backend_check(rep, recs)
        self._logs_report(rep)
        return rep

    def _locate(self, ids) -> dict[str, dict]:
        """Where each request's message is: the pool queue, kombu's unacked hash (fetched by a
        consumer; its age in s), a worker's in-flight set. Nowhere at all means no message will
        ever run it: only the deadline sweep can end it."""
        r = self.client
        queued = {json.loads(m).get("headers", {}).get("id") for m in r.lrange(QUEUE, 0, -1)}
        unacked = {}
        for tag, raw in r.hgetall("unacked").items():
            try:
                mid = json.loads(raw)[0].get("headers", {}).get("id")
            except (ValueError, IndexError, AttributeError):
                continue
            score = r.zscore("unacked_index", tag)
            unacked[mid] = round(time.time() - score, 1) if score else None
        held: dict[str, list[str]] = {}
        for key in r.scan_iter("vigil:inflight:*"):
            for rid in r.smembers(key):
                held.setdefault(rid.decode(), []).append(key.decode().rsplit(":", 1)[-1])
        return {rid: {"queued": rid in queued, "unacked_age_s": unacked.get(rid, "absent"),
                      "held_by": held.get(rid, [])} for rid in ids}

    @staticmethod
    def _nowhere(where: dict) -> bool:
        return not where["queued"] and where["unacked_age_s"] == "absent" \
            and not where["held_by"]

    def _where(self, ids: list[str], recs: dict) -> list[dict]:
        """For requests that never ended: their record and where their message is."""
        out = []
        for rid, where in self._locate(ids).items():
            rec = recs.get(rid) or {}
            created = rec.get("created_at")
            near = min((float(created) - k.at for k in self.kills if k.kind == "worker"),
                       key=abs, default=None) if created else None
            out.append({"id": rid, "status": rec.get("status"), "dispatch": rec.get("dispatch"),
                        "submitted_t_s": round(float(created) - self.t_wall0, 1)
                        if created else None,
                        "submitted_after_worker_kill_s": None if near is None else round(near, 3),
                        **where,
                        "history": [(e.get("worker"), e.get("dispatch"), e.get("outcome"),
                                     e.get("error")) for e in rec.get("history") or []]})
        return out

    def _rss_report(self, rep: SoakReport) -> None:
        if not self.rss:
            return
        # "Start" is after warm-up: the first sample once a tenth of the requests ended with
        # the engine up (a sample between an engine kill and its restart has no engine).
        warm = max(50, self.n // 10)
        up = [x for x in self.rss if x["engine_up"]] or self.rss
        start = next((x for x in up if x["ended"] >= warm), up[0])
        end = self.rss[-1]
        for key, out in (("main", rep.rss_main_mib), ("total", rep.rss_total_mib)):
            out.update(start=round(start[key], 1), end=round(end[key], 1),
                       max=round(max(x[key] for x in self.rss), 1))
            if self.rss_ready:
                out["ready"] = round(self.rss_ready[key], 1)


    def _backend_check(self, rep: SoakReport, recs: dict) -> None:
        """Read a sample of results back through Celery's result backend (what `r.get()` sees)
        and compare them with the records."""
        from app import app
        from app.errors import VigilError

        rng = random.Random(self.seed + 1)
        done = [rid for rid, r in recs.items() if r and r["status"] == "SUCCEEDED"]
        failed = [rid for rid, r in recs.items() if r and r["status"] == "FAILED"]
        sample = rng.sample(done, min(100, len(done))) + failed[:100]
        for rid in sample:
            rec = recs[rid]
            try:
                got = app.AsyncResult(rid).get(timeout=10)
                if rec["status"] != "SUCCEEDED":
                    rep.backend_disagreements.append(f"{rid}: backend has a result, record "
                                                     f"says {rec['error']}")
                elif got != json.loads(rec["result"]):
                    rep.backend_disagreements.append(f"{rid}: backend result differs")
            except VigilError as e:
                if rec["status"] != "FAILED" or e.code != rec["error"].split(":", 1)[0]:
                    rep.backend_disagreements.append(f"{rid}: backend raised {e}, record "
                                                     f"{rec['status']}")
            except Exception as e:  # a timeout or a foreign error: a disagreement too
                rep.backend_disagreements.append(f"{rid}: {type(e).__name__}: {e}")
            rep.backend_checked += 1

    def _logs_report(self, rep: SoakReport) -> None:
        reaped = re.compile(r"reaped worker \S+ \(instance (\d+)\)")
        samples: Counter = Counter()
        for log in sorted(self.logdir.glob("*.log")):
            n = 0
            for line in log.read_text(errors="replace").splitlines():
                m = reaped.search(line)
                if m:
                    rep.reaps[m.group(1)] = rep.reaps.get(m.group(1), 0) + 1
                if " ERROR" in line or "CRITICAL" in line or line.startswith("Traceback"):
                    n += 1
                    # one sample per kind of line: drop timestamps, ids and numbers
                    key = re.sub(r"[0-9a-f]{8}-[0-9a-f-]{27}|\d+", "N", line.split("] ", 1)[-1])
                    if key not in samples:
                        rep.log_error_samples.append(f"{log.name}: {line[:300]}")
                    samples[key] += 1
            if n:
                rep.log_errors[log.name] = n
        rep.log_error_samples = rep.log_error_samples[:15]

    def close(self) -> None:
        """Stop every process this run started (workers, beats, Redis), all at once; nothing
        is left."""
        self.stop.set()
        with self.lock:
            procs = list(self.procs.values())
        stoppers = [threading.Thread(target=stop_process, args=(p, 30)) for p in procs]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
        if self.redis is not None:
            self.redis.stop()


def _fresh_app(url: str) -> None:
    """Make sure this process's Celery app and settings will be built for `url`. They are built
    once per process: a soak in a process that already built them for another Redis (a test
    session) must run in a subprocess instead."""
    import app as app_pkg

    built = getattr(app_pkg, "_app", None)
    if built is not None:
        if built.conf.broker_url != url:
            raise RuntimeError("bench.soak needs a process whose Celery app is not built yet "
                               "(run `python -m bench.soak` in a subprocess)")
        return
    from app.settings import get_settings

    get_settings.cache_clear()


def run_soak(requests: int = 10_000, *, worker_kill_every: float = 20,
             engine_kill_every: float = 30, beats: int = 2, max_tokens: int = 32,
             window: int = 192, rate: float = 25, kill_worker_at: list[int] | None = None,
             kill_engine_at: list[int] | None = None, quiesce_kills: bool = False,
             reap_timeout: float = 10, request_timeout: float = 120,
             drain_timeout: float | None = None, logdir: str | Path | None = None,
             cache_dir: str | None = None, seed: int = 0, say=print) -> SoakReport:
    """Run one soak (module docstring) and return its report. Starts and stops everything it
    needs (Redis, workers, beats), even on an exception or Ctrl-C; must run in a process whose
    Celery app is not built yet. Kills go by progress when `kill_worker_at` / `kill_engine_at`
    are given (request counts), else by time (`*_kill_every` seconds; 0 = never). The logs stay
    in `logdir` (default: a temporary directory, removed unless the run had problems)."""
    keep = logdir is not None
    logdir = Path(logdir) if logdir else Path(tempfile.mkdtemp(prefix="vigil-soak-"))
    logdir.mkdir(parents=True, exist_ok=True)
    cache = cache_dir or os.environ.get("VIGIL_CACHE_DIR") or str(
        Path.home() / ".cache" / "vigil")
    soak = Soak(requests=requests, worker_kill_every=worker_kill_every,
                engine_kill_every=engine_kill_every, beats=beats, max_tokens=max_tokens,
                window=window, rate=rate, kill_worker_at=list(kill_worker_at or []),
                kill_engine_at=list(kill_engine_at or []), quiesce_kills=quiesce_kills,
                reap_timeout=reap_timeout, request_timeout=request_timeout,
                drain_timeout=drain_timeout, logdir=logdir, cache_dir=cache, seed=seed, say=say)
    report = None
    try:
        report = soak.run()
    finally:
        soak.close()
        if not keep and report is not None and report.ok:
            shutil.rmtree(logdir, ignore_errors=True)
    soak.shm_left(report)
    return report


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--worker-kill-every", type=float, default=20, metavar="S",
                   help="SIGKILL the victim worker's process group every S s (0: never)")
    p.add_argument("--engine-kill-every", type=float, default=30, metavar="S",
                   help="SIGKILL a worker's EngineCore every S s (0: never)")
    p.add_argument("--kill-worker-at", type=int, action="append", default=[], metavar="N",
                   help="kill the victim worker once N requests ended (repeatable; replaces "
                        "the timed kills)")
    p.add_argument("--kill-engine-at", type=int, action="append", default=[], metavar="N",
                   help="kill an EngineCore once N requests ended (repeatable)")
    p.add_argument("--quiesce-kills", action="store_true",
                   help="pause the producer before a worker kill until every open request is "
                        "held by a worker (the reaper then sees all of them)")
    p.add_argument("--beats", type=int, default=2, help="celery beats running at once")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="tokens per request: each asks a random count in [max/4, max]")
    p.add_argument("--window", type=int, default=192,
                   help="open (not yet ended) requests at most; the producer waits above it")
    p.add_argument("--rate", type=float, default=25,
                   help="requests submitted per second (0: as fast as --window allows)")
    p.add_argument("--reap-timeout", type=float, default=10,
                   help="VIGIL_WORKER_REAP_TIMEOUT (below the 30 s floor: test-only flag set)")
    p.add_argument("--request-timeout", type=float, default=120,
                   help="VIGIL_REQUEST_TIMEOUT (also sets Redis' visibility timeout)")
    p.add_argument("--drain-timeout", type=float, default=None,
                   help="seconds to wait for open requests after the last submit (default: "
                        "past the visibility timeout)")
    p.add_argument("--logdir", default=None, help="keep every process's log here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--report", default=None, metavar="FILE", help="also write the JSON here")
    return p.parse_args(argv)


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    a = parse_args(argv)
    # SIGTERM (a test's timeout, an operator) runs the same clean-up as Ctrl-C.
    signal.signal(signal.SIGTERM, _terminate)
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if a.json else \
        (lambda line: print(line, flush=True))
    rep = run_soak(a.requests, worker_kill_every=a.worker_kill_every,
                   engine_kill_every=a.engine_kill_every, beats=a.beats,
                   max_tokens=a.max_tokens, window=a.window, rate=a.rate,
                   kill_worker_at=a.kill_worker_at, kill_engine_at=a.kill_engine_at,
                   quiesce_kills=a.quiesce_kills,
                   reap_timeout=a.reap_timeout, request_timeout=a.request_timeout,
                   drain_timeout=a.drain_timeout, logdir=a.logdir, seed=a.seed, say=say)
    data = rep.to_dict()
    if a.report:
        Path(a.report).write_text(json.dumps(data, indent=1))
    print(json.dumps(data, indent=1) if a.json else rep.table(), flush=True)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
