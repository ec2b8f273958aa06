"""The soak's two threads (bench/soak.py): the producer, submitting every request at `--rate`
with at most `--window` open, and the supervisor, sampling the steady worker's memory and
killing the victim worker and the EngineCores by time (`--worker-kill-every`,
`--engine-kill-every`) or by progress (`--kill-worker-at`, `--kill-engine-at`)."""
from __future__ import annotations

import random
import time

from bench import soak_mix
from bench.soak_fleet import MODEL, STEADY, VICTIM
from bench.soak_report import Kill

WORDS = ("river stone light paper window garden music silver engine winter market story "
         "lantern forest signal harbor").split()
RSS_EVERY_S = 2


class SoakThreads:
    """The producer and the supervisor of bench/soak.py's `Soak`, its base class: they read
    and fill the run's state, which `Soak.__init__` sets (its fleet, events, ids, kills)."""

    # -- load --------------------------------------------------------------------------------
    def open_requests(self) -> int:
        """Requests accepted and not yet ended (the pool's open set)."""
        from app.state import keys

        return self.fleet.client.scard(keys.pool_requests(MODEL))

    def ended(self) -> int:
        """Requests submitted so far that have ended."""
        return len(self.ids) - self.open_requests()

    def produce(self) -> None:
        """Submit every request at `rate` per second (0: as fast as allowed), keeping at most
        `window` open (not yet ended) at once; a TransientError is counted and retried."""
        from app.errors import TransientError
        from tasks.inference import generate

        rng = random.Random(self.seed)
        try:
            for i in range(self.n):
                words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
                tokens = rng.randint(max(1, self.max_tokens // 4), self.max_tokens)
                kind, extra = soak_mix.pick(rng) if self.mix else ("plain", {})
                while True:
                    due = self.t0 + i / self.rate if self.rate else 0
                    while (time.monotonic() < due or self.open_requests() >= self.window) \
                            and not self.stop.is_set():
                        time.sleep(0.02)
                    if self.stop.is_set():
                        return
                    kw = {**dict(model=MODEL, prompt=f"soak {i}: {words}", max_tokens=tokens,
                                 ignore_eos=True, **({"temperature": 0.0} if self.greedy else {})),
                          **extra}
                    try:
                        r = generate.delay(**kw)
                        break
                    except TransientError as e:  # redis_unavailable / overloaded: wait, retry
                        self.submit_retries[e.code] += 1
                        time.sleep(0.5)
                self.ids.append(r.id)
                self.asked_tokens[r.id] = tokens
                self.runs[r.id] = kw
                self.kinds[r.id] = kind
        except BaseException as e:
            self.errors.append(e)
            raise
        finally:
            self.producer_done.set()

    # -- the supervisor ----------------------------------------------------------------------
    def supervise(self) -> None:
        """Sample the steady worker's memory and kill, by progress or by time, until `stop`."""
        try:
            self._supervise()
        except BaseException as e:
            self.errors.append(e)
            raise

    def _supervise(self) -> None:
        fleet = self.fleet
        last_worker = last_engine = last_rss = time.monotonic()
        engine_turn = 0
        while not self.stop.is_set():
            now = time.monotonic()
            if now - last_rss >= RSS_EVERY_S:
                last_rss = now
                sample = self._sample()
                if sample:
                    self.rss.append(sample)
            if self.by_progress:  # once the count is reached and the target holds requests
                ended = self.ended()
                if self.kill_worker_at and ended >= self.kill_worker_at[0] \
                        and fleet.ready(VICTIM) and fleet.held(VICTIM):
                    self.kill_worker_at.pop(0)
                    self.kill_worker()
                if self.kill_engine_at and ended >= self.kill_engine_at[0]:
                    for target in (STEADY, VICTIM):
                        if fleet.ready(target) and fleet.engine_cores(target) \
                                and fleet.held(target):
                            self.kill_engine_at.pop(0)
                            self.kill_engine(target)
                            break
            elif not self.producer_done.is_set():  # by time, not while the last ones drain
                if self.worker_every and now - last_worker >= self.worker_every \
                        and fleet.ready(VICTIM):
                    self.kill_worker()
                    last_worker = time.monotonic()
                if self.engine_every and now - last_engine >= self.engine_every:
                    order = (STEADY, VICTIM) if engine_turn % 2 == 0 else (VICTIM, STEADY)
                    for target in order:
                        if fleet.ready(target) and fleet.engine_cores(target):
                            self.kill_engine(target)
                            engine_turn += 1
                            last_engine = time.monotonic()
                            break
            self.stop.wait(0.25)

    def _sample(self) -> dict | None:
        mem = self.fleet.memory(STEADY)
        if mem:
            mem.update(t=round(time.monotonic() - self.t0, 1), ended=self.ended())
        return mem

    def kill_worker(self) -> None:
        """SIGKILL the victim's whole process group (or SIGTERM its main process, with
        `--worker-signal term`: a drain), record it, start a fresh victim."""
        if self.worker_signal == "term":
            at, held, pid, exit_s = self.fleet.drain_worker(VICTIM)
            self._record(Kill("drain", VICTIM, at, held, exit_s=exit_s),
                         f"worker {VICTIM} (pid {pid}, exited "
                         f"{'-' if exit_s is None else f'{exit_s:.1f} s'} later)", "SIGTERM")
            return
        at, held, pgid = self.fleet.kill_worker(VICTIM)
        self._record(Kill("worker", VICTIM, at, held), f"worker {VICTIM} (group {pgid})")

    def kill_engine(self, name: str) -> None:
        """SIGKILL the EngineCore of worker `name` and record the kill."""
        at, held, pids = self.fleet.kill_engine(name)
        self._record(Kill("engine", name, at, held), f"EngineCore {pids} of {name}")

    def _record(self, kill: Kill, what: str, sig: str = "SIGKILL") -> None:
        kill.t_s = kill.at - self.t_wall0
        self.kills.append(kill)
        self.say(f"[{kill.t_s:6.1f} s] {sig} {what}, holding {len(kill.held)}; ended "
                 f"{self.ended()}/{len(self.ids)}")
