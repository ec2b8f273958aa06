"""Soak: thousands of requests over two CPU workers and beat while a supervisor kills them.

    python -m bench.soak                                    # 10,000 requests, kills every 20/30 s
    python -m bench.soak --requests 2000 --json             # the report as JSON on stdout
    python -m bench.soak --worker-signal term --greedy --engine-kill-every 0   # a drain soak
    python -m bench.soak --mix --greedy               # every request kind, tiers, preemption

Self-contained (bench/README.md says what it runs and reports): a private Redis, a steady and a
victim `vigil worker --cpu`, `--beats` celery beats and the housekeeper (bench/soak_fleet.py;
`--no-housekeeper` leaves beat's tasks to the workers, as before it existed); in
bench/soak_threads.py, a producer thread calling `generate.delay` (`--rate` per second, at most
`--window` requests open) and a supervisor thread that, while the producer submits, SIGKILLs the
victim's whole process group every `--worker-kill-every` s (and starts a fresh one) and an
EngineCore every `--engine-kill-every` s (steady's and victim's in turn), or by progress with
`--kill-worker-at N` / `--kill-engine-at N` (once N requests ended and the target holds some:
tests/test_soak_e2e.py).
With `--worker-signal term` the victim gets SIGTERM instead (a scale-in: its drain hands every
request back with its tokens), and the report adds each drain's exit time and the tokens every
worker incarnation discarded (its own counter, logged as it exits; the goal is 0); with
`--greedy` the requests are greedy and `--twins` of the resumed ones are run again
uninterrupted at the end: each must be token-identical. With `--mix` (bench/soak_mix.py) each
request is of one kind (plain, structured, penalized, bad words, n = 2 sampled) and one tier,
on workers whose engine batch is small enough for bulk work to fill it, so interactive requests
preempt bulk runs; the report counts the kinds, their resumes and the preemptions.

Kills land at any moment: the producer never pauses for them. A message a dying consumer takes
with it (a BRPOP Redis answers on the dead socket) is published again by the reaper's audit
(app/fleet/message_audit.py), so a lost request is a bug. The report (bench/soak_report.py, filled by
bench/soak_findings.py) comes from Vigil's own records, and from the engines' witness of every
generation they finished (workers/engine/witness.py), once every request ended, or the drain
gave up: at `--drain-timeout`, or once every open request has had no message anywhere for longer
than a reap and its audit take (`stranded_s`). Exit status 1 when anything was lost, ran to a
result twice, was requeued twice for one dispatch or failed twice.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from bench import soak_findings as findings
from bench import soak_mix
from bench.soak_fleet import MODEL, STEADY, VICTIM, Fleet, fleet_env
from bench.soak_report import Kill, SoakReport
from bench.soak_threads import SoakThreads

# Open requests with no message anywhere for this long (or 3 reap timeouts, if longer: past the
# reap and the audit that publishes them again) are stranded: the drain stops waiting.
STRANDED_S = 30


class Soak(SoakThreads):
    """One soak run (use `run_soak`): the producer, the supervisor, the drain, the report."""

    def __init__(self, *, requests: int, worker_kill_every: float, engine_kill_every: float,
                 beats: int, max_tokens: int, window: int, rate: float, kill_worker_at: list[int],
                 kill_engine_at: list[int], reap_timeout: float, request_timeout: float,
                 drain_timeout: float | None, logdir: Path, cache_dir: str, seed: int, say,
                 housekeeper: bool = True, worker_signal: str = "kill", greedy: bool = False,
                 twins: int = 24, mix: bool = False):
        self.n = requests
        self.mix = mix
        self.worker_signal, self.greedy, self.twins_n = worker_signal, greedy, twins
        self.housekeeper = housekeeper
        self.worker_every, self.engine_every = worker_kill_every, engine_kill_every
        self.beats_n, self.max_tokens, self.window, self.rate = beats, max_tokens, window, rate
        self.kill_worker_at, self.kill_engine_at = sorted(kill_worker_at), sorted(kill_engine_at)
        self.by_progress = bool(kill_worker_at or kill_engine_at)
        self.logdir, self.seed, self.say = logdir, seed, say
        # A last resort: past Redis' visibility timeout with these settings (VIGIL_REQUEST_TIMEOUT
        # + backoff max + 60), when a message left in a dead worker's unacked hash comes back.
        self.drain_timeout = drain_timeout or request_timeout + 60 + 60 + 120
        self.stranded_s = max(STRANDED_S, 3 * reap_timeout)
        self.env = fleet_env(cache_dir, reap_timeout, request_timeout)
        # The engines' witness of every generation they finished (workers/engine/witness.py).
        self.witness_dir = logdir / "witness"
        self.env["VIGIL_WITNESS_DIR"] = str(self.witness_dir)
        if mix:  # a batch bulk work fills: interactive requests preempt it
            self.env["VIGIL_MODELS_FILE"] = str(soak_mix.batch_models_file(
                logdir / "models.json", MODEL, soak_mix.MIX_BATCH, cache_dir))
        self.fleet = Fleet(logdir, self.env)
        self.stop = threading.Event()
        self.producer_done = threading.Event()
        self.ids: list[str] = []
        self.asked_tokens: dict[str, int] = {}
        self.runs: dict[str, dict] = {}  # request id -> its kwargs (greedy twins)
        self.kinds: dict[str, str] = {}  # request id -> its kind (--mix)
        self.submit_retries: Counter = Counter()
        self.kills: list[Kill] = []
        self.rss: list[dict] = []  # the steady worker's memory every RSS_EVERY_S (soak_threads)
        self.rss_ready: dict | None = None
        self.errors: list[BaseException] = []
        self.shm_before: set[str] = set()
        self.t0 = self.t_wall0 = 0.0

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> SoakReport:
        """Start everything, submit and kill until every request ended (or the drain gave up),
        and return the report. The caller calls `close` (`run_soak` does)."""
        started = time.monotonic()
        fleet = self.fleet
        self.shm_before = fleet.shm_segments()
        url = fleet.start_redis()
        fleet.make_this_process_a_client()
        fleet.build_model()
        self.say(f"soak: {self.n} requests, logs in {self.logdir}, Redis {url}")
        for name in (STEADY, VICTIM):
            fleet.start_worker(name)
        fleet.start_beats(self.beats_n)
        if self.housekeeper:
            fleet.start_housekeeper()
        fleet.wait_ready((STEADY, VICTIM))
        self.rss_ready = self._sample()
        self.say(f"workers ready after {time.monotonic() - started:.0f} s; submitting")
        self.t0, self.t_wall0 = time.monotonic(), time.time()
        producer = threading.Thread(target=self.produce, name="soak-producer", daemon=True)
        supervisor = threading.Thread(target=self.supervise, name="soak-supervisor", daemon=True)
        producer.start()
        supervisor.start()
        try:
            self._wait_all()
        finally:
            self.stop.set()
            producer.join(10)
            supervisor.join(60)
        last = self._sample()
        if last:
            self.rss.append(last)
        return self.report(time.monotonic() - started)

    def _wait_all(self) -> None:
        """Until every request is submitted and ended, printing progress every 10 s. After the
        last submit, stop waiting at the drain timeout, or once every open request has had no
        message anywhere (queue, unacked, in-flight set) for `stranded_s`."""
        from app.state import keys

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
                            self.fleet.client.smembers(keys.pool_requests(MODEL))]
                where = findings.locate(self.fleet.client, open_ids)
                if all(findings.nowhere(w) for w in where.values()):
                    stranded_since = stranded_since or now
                    if now - stranded_since >= self.stranded_s:
                        self.say(f"{open_n} open request(s) have had no message anywhere for "
                                 f"{self.stranded_s:g} s: not waiting for them")
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

    def report(self, wall: float) -> SoakReport:
        """The report from the records, logs, memory samples and result backend (the /dev/shm
        figure is added by `run_soak` once every process stopped)."""
        rep = SoakReport(requests=self.n, accepted=len(self.ids),
                         submit_retries=dict(self.submit_retries), kills=self.kills,
                         wall_s=wall, logdir=str(self.logdir),
                         settings={k: v for k, v in self.env.items()
                                   if k not in ("VIGIL_CACHE_DIR", "VIGIL_WITNESS_DIR")}
                         | {"beats": self.beats_n, "housekeeper": self.housekeeper,
                            "window": self.window,
                            "max_tokens": self.max_tokens, "rate": self.rate,
                            "worker_kill_every": self.worker_every,
                            "engine_kill_every": self.engine_every,
                            "worker_signal": self.worker_signal, "greedy": self.greedy,
                            "mix": self.mix})
        client = self.fleet.client
        recs = findings.read_records(client, self.ids)
        findings.tally_records(rep, recs, self.asked_tokens)
        findings.tally_recovery(rep, recs)
        rep.lost_detail = findings.describe_lost(client, rep.lost_ids[:10], recs, self.kills,
                                                 self.t_wall0)
        rep.republished_detail = findings.describe_republished(recs, self.kills, self.t_wall0)
        rep.stats = {k.decode(): int(v) for k, v in client.hgetall("vigil:stats").items()}
        # "Start" is after warm-up: once a tenth of the requests (at least 50) ended.
        findings.rss_figures(rep, self.rss, self.rss_ready, warm=max(50, self.n // 10))
        findings.check_backend(rep, recs, self.seed)
        findings.tally_witness(rep, recs, self.witness_dir)
        findings.read_logs(rep, self.logdir)
        findings.tally_kinds(rep, recs, self.kinds)
        if self.greedy:
            findings.check_twins(rep, recs, self.runs, self.twins_n, self._twin)
        return rep

    def _twin(self, kwargs: dict) -> dict:
        """A request run again, uninterrupted (its result)."""
        from tasks.inference import generate

        return generate.delay(**kwargs).get(timeout=300)

    def close(self) -> None:
        """Stop the threads and every process this run started; nothing is left."""
        self.stop.set()
        self.fleet.close()


def run_soak(requests: int = 10_000, *, worker_kill_every: float = 20,
             engine_kill_every: float = 30, beats: int = 2, max_tokens: int = 32,
             window: int = 192, rate: float = 25, kill_worker_at: list[int] | None = None,
             kill_engine_at: list[int] | None = None, reap_timeout: float = 10,
             request_timeout: float = 120, drain_timeout: float | None = None,
             logdir: str | Path | None = None, cache_dir: str | None = None, seed: int = 0,
             say=print, housekeeper: bool = True, worker_signal: str = "kill",
             greedy: bool = False, twins: int = 24, mix: bool = False) -> SoakReport:
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
                kill_engine_at=list(kill_engine_at or []), reap_timeout=reap_timeout,
                request_timeout=request_timeout, drain_timeout=drain_timeout, logdir=logdir,
                cache_dir=cache, seed=seed, say=say, housekeeper=housekeeper,
                worker_signal=worker_signal, greedy=greedy, twins=twins, mix=mix)
    report = None
    try:
        report = soak.run()
    finally:
        soak.close()
        if report is not None:  # every worker has stopped and logged its token counters
            findings.read_exit_totals(report, logdir)
        if not keep and report is not None and report.ok:
            shutil.rmtree(logdir, ignore_errors=True)
    report.shm_left = Fleet.shm_left(soak.shm_before)
    return report


def parse_args(argv=None) -> argparse.Namespace:
    """The command line of `python -m bench.soak`."""
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
    p.add_argument("--worker-signal", choices=("kill", "term"), default="kill",
                   help="how the victim worker is stopped: SIGKILL of its process group, or "
                        "SIGTERM of its main process (a drain: its requests handed back with "
                        "their tokens)")
    p.add_argument("--greedy", action="store_true",
                   help="greedy requests (temperature 0), and --twins of the resumed ones run "
                        "again at the end: each must be token-identical")
    p.add_argument("--mix", action="store_true",
                   help="every request kind (plain, structured, penalized, bad words, n = 2) "
                        "in every tier, on an engine batch bulk work fills: preemptions too "
                        "(bench/soak_mix.py)")
    p.add_argument("--twins", type=int, default=24, metavar="N",
                   help="with --greedy, resumed requests run again uninterrupted (at most N)")
    p.add_argument("--beats", type=int, default=2, help="celery beats running at once")
    p.add_argument("--no-housekeeper", action="store_true",
                   help="run beat's tasks on the workers only, as without `vigil housekeeper`")
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
    """Run the soak from the command line; print the report (table or JSON); 0 when OK."""
    a = parse_args(argv)
    # SIGTERM (a test's timeout, an operator) runs the same clean-up as Ctrl-C.
    signal.signal(signal.SIGTERM, _terminate)
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if a.json else \
        (lambda line: print(line, flush=True))
    rep = run_soak(a.requests, worker_kill_every=a.worker_kill_every,
                   engine_kill_every=a.engine_kill_every, beats=a.beats,
                   max_tokens=a.max_tokens, window=a.window, rate=a.rate,
                   kill_worker_at=a.kill_worker_at, kill_engine_at=a.kill_engine_at,
                   reap_timeout=a.reap_timeout, request_timeout=a.request_timeout,
                   drain_timeout=a.drain_timeout, logdir=a.logdir, seed=a.seed, say=say,
                   housekeeper=not a.no_housekeeper, worker_signal=a.worker_signal,
                   greedy=a.greedy, twins=a.twins, mix=a.mix)
    data = rep.to_dict()
    if a.report:
        Path(a.report).write_text(json.dumps(data, indent=1))
    print(json.dumps(data, indent=1) if a.json else rep.table(), flush=True)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
