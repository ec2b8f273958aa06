"""Worker-tier helpers (docs/testing.md): real `vigil worker` processes, their engines, the
queues they take from, and the exactly-once checks against the engines' witness."""
from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def worker_entry(client, name: str) -> dict[str, str] | None:
    """The registry hash of the live worker called `name` (Celery node name), if any."""
    for key in client.scan_iter("vigil:worker:*"):
        raw = client.hgetall(key)
        entry = {k.decode(): v.decode() for k, v in raw.items()}
        if entry.get("name") == name:
            return entry
    return None


# The line that closes the dump of a worker's threads (Celery's SIGUSR1 handler, `cry`).
STACKS_END = "LOCAL VARIABLES"

_zygote = None  # tests/worker_zygote.py: this process' pre-imported parent of its workers


def forked_worker(redis_url: str, name: str, log: Path, concurrency: int | None,
                  pools: str | None, **env):
    """A real `vigil worker --cpu` (app/local/embedded.py's command line and environment),
    forked from this test process' zygote so that it skips importing vLLM again
    (tests/worker_zygote.py); VIGIL_TEST_FORK_WORKERS=0 starts it with a plain exec instead."""
    global _zygote
    from app.local.embedded import REPO, start_worker, vigil_env, worker_command
    from tests.worker_zygote import Zygote

    if os.environ.get("VIGIL_TEST_FORK_WORKERS", "1") == "0":
        return start_worker(redis_url, name, log, concurrency=concurrency, pools=pools, **env)
    if _zygote is None:
        _zygote = Zygote.start(vigil_env(redis_url), REPO)
    return _zygote.spawn(worker_command(name, concurrency, pools), vigil_env(redis_url, **env),
                         REPO, log)


class RunningWorker:
    """A real `vigil worker --cpu` subprocess (Celery threads pool, vLLM CPU engine)."""

    def __init__(self, redis_server, name: str, tmp: Path, pools: str = "tiny-llama",
                 concurrency: int = 64, **env):
        self.name = name
        self.log = tmp / f"{name.split('@')[0]}.log"
        self.client = redis_server.client()
        env.setdefault("VIGIL_HEARTBEAT_INTERVAL", "1")
        self.proc = forked_worker(redis_server.url, name, self.log, concurrency, pools, **env)

    def entry(self) -> dict[str, str] | None:
        return worker_entry(self.client, self.name)

    def wait_engine(self, timeout: float = 300) -> dict[str, str]:
        from app.local.embedded import wait_for

        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited ({self.proc.returncode}); log:\n"
                                   + self.log.read_text()[-4000:])
            e = self.entry()
            # Loaded and ready (has_pinged): a test that kills it from here on meets a worker
            # the reaper judges by the reap timeout, not the registration grace.
            return (e if e and int(e.get("engine_loads", 0)) >= 1 and e.get("has_pinged") == "1"
                    else None)

        return wait_for(ready, timeout, 0.2, f"{self.name}'s engine")

    def wait_registered(self, timeout: float = 120) -> dict[str, str]:
        """The worker's registry entry once it heartbeats (no engine needed)."""
        from app.local.embedded import wait_for

        def up():
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited ({self.proc.returncode}); log:\n"
                                   + self.log.read_text()[-4000:])
            return self.entry()

        return wait_for(up, timeout, 0.2, f"{self.name} to register")

    def engine_core_pids(self) -> list[int]:
        """PIDs of this worker's vLLM EngineCore process(es)."""
        import psutil

        out = []
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if "EngineCore" in " ".join(p.cmdline()) + p.name():
                    out.append(p.pid)
            except psutil.Error:
                continue
        return out

    def stacks(self, timeout: float = 10) -> str:
        """Every thread's stack in the worker, as Celery's SIGUSR1 handler writes them to its log
        (what a hung worker was doing), or a line saying why there are none."""
        from app.local.embedded import wait_for

        if self.proc.poll() is not None:
            return f"(worker exited: {self.proc.returncode})"
        before = self.log.read_text(errors="replace")
        os.kill(self.proc.pid, signal.SIGUSR1)

        def dumped():
            text = self.log.read_text(errors="replace")
            return text[len(before):] if text.count(STACKS_END) > before.count(STACKS_END) \
                else None

        try:
            return wait_for(dumped, timeout, 0.2, "the worker's stacks")
        except TimeoutError:
            return f"(no stacks in the log {timeout:.0f} s after SIGUSR1)"

    def explain(self, err: Exception, extra: str = "", lines: int = 80) -> AssertionError:
        """`err` (a wait that timed out) with what the worker was doing: `extra` (what the test
        saw), the last `lines` lines of its log before the dump, then every thread's stack
        (`stacks`)."""
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return AssertionError(f"{err}\n{extra}\n--- {self.name}'s log, last {lines} lines ---\n"
                              f"{tail}\n--- {self.name}'s threads ---\n{self.stacks()}")

    def stop(self) -> None:
        from app.local.embedded import stop_process

        stop_process(self.proc, timeout=60)


def engine_processes(pid: int) -> list:
    """Live descendants (psutil.Process) of the worker `pid`: its engine processes, less its
    orphan guard."""
    import psutil

    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "orphan_guard" not in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


def wait_processes_gone(procs, timeout: float = 30) -> None:
    """Wait until none of `procs` (psutil.Process) is alive (zombies count as gone)."""
    import psutil

    from app.local.embedded import wait_for

    wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                             for p in procs), timeout, what="engine processes to exit")



def stop_zygote() -> None:
    """Stop this process' worker zygote, if `forked_worker` started one (the end of the run)."""
    global _zygote
    if _zygote is not None:
        _zygote.stop()
        _zygote = None


def start_batch_beat(redis_server, tmp: Path, **env):
    """A real `celery beat` on the suite's Redis whose batch tick runs every half second (the
    batch objects' driver; the warm worker, which consumes vigil.housekeeping, runs it)."""
    import sys

    from app.local.embedded import start_process, vigil_env

    return start_process([sys.executable, "-m", "celery", "-A", "app", "beat", "-l", "INFO",
                          "-s", str(tmp / "batch-beat-schedule")],
                         vigil_env(redis_server.url, VIGIL_BATCH_TICK_INTERVAL="0.5", **env),
                         tmp / "batch-beat.log")


def queued(client, queue: str) -> int:
    """Messages waiting in `queue`, every priority list of it (a request's tier picks the list:
    app/requests/tiers.py)."""
    from app.state import broker

    return broker.depths(client, [queue])[0]


@contextlib.contextmanager
def stepped_aside(name: str, queue: str = "vigil.pool.tiny-llama", timeout: float = 30):
    """Worker `name` stops consuming `queue` for the block and consumes it again after (each
    change waited for, as the worker itself reports its queues). A test whose victim must hold
    the requests sends them inside: which consumer takes a message is otherwise a race, and an
    idle warm worker with free slots (prefetch = concurrency) may take a whole batch before a
    just-started one pops any."""
    from app import app
    from app.local.embedded import wait_for

    bus = app.vigil_ports.bus
    bus.cancel_consumer(queue, [name])
    wait_for(lambda: queue not in (bus.active_queues(name) or [queue]), timeout, 0.2,
             f"{name} to stop consuming {queue}")
    try:
        yield
    finally:
        bus.add_consumer(queue, [name])
        wait_for(lambda: queue in (bus.active_queues(name) or []), timeout, 0.2,
                 f"{name} to consume {queue} again")


def every_request_taken(store, results, instances, queue: str = "vigil.pool.tiny-llama") -> bool:
    """True once every request of `results` has left the queue and is held by one of the worker
    `instances` (or has ended). Fault tests kill only then: a message a consumer popped in the
    last instant before a SIGKILL, before its hold was written with kombu's note of it
    (app/state/transport.py), is not in the worker's in-flight set: it comes back through the
    reaper's audit (app/fleet/message_audit.py), not with the worker's other requests, which
    would blur what the test measures."""
    from app.state import keys

    if queued(store.raw, queue):
        return False
    held = set().union(*(store.raw.smembers(keys.inflight(i)) for i in instances))
    return all(r.id.encode() in held or store.get(r.id)["status"] in ("SUCCEEDED", "FAILED")
               for r in results)


def assert_each_ran_to_a_result_once(store, request_ids, *,
                                     at_most: dict[str, int] | None = None) -> None:
    """Exactly once, per request, from its own history: one attempt succeeded, and no attempt
    is left open (a second run that lost its finish leaves its attempt open). Unlike the global
    `duplicate_results` counter, this cannot be moved by other tests' stragglers. And from a
    witness outside Vigil's records (`assert_witnessed`): one finished generation each, but
    for the requests `at_most` names, which may have up to that many."""
    assert_witnessed(store, request_ids, at_most=at_most)
    bad = {}
    for rid in request_ids:
        h = store.history(rid)
        succeeded = sum(e["outcome"] == "succeeded" for e in h)
        still_open = sum(e["outcome"] is None for e in h)
        if succeeded != 1 or still_open:
            bad[rid] = [(e["worker"], e["outcome"], e["error"]) for e in h]
    assert not bad, f"requests not run to a result exactly once: {bad}"


def assert_witnessed(store, request_ids, *, at_most: dict[str, int] | None = None,
                     witness_dir: Path | None = None) -> dict[str, int]:
    """The engines' witness (workers/engine/witness.py, written by the engine side, read by no
    Vigil code) agrees with the stored results: each request has exactly one stored result,
    a generation its engine finished in that attempt produced as many tokens (counting those
    it continued from, for a resumed run), and its engines ran it to completion exactly once
    (`finished_generations`; canaries belong to no request). A request that may legitimately
    have finished more than once (its engine finished, then its finish was lost: a worker
    killed or a wedge aborted in between, a Redis crash undoing the write) must be named in
    `at_most` with the most it may have; no other request gets that leeway. Returns the
    number of finished generations per request. `witness_dir`: the suite's unless given."""
    import json

    from workers.engine.witness import finished_generations, read_witness

    from tests.conftest import WITNESS_DIR

    at_most = at_most or {}
    seen = read_witness(WITNESS_DIR if witness_dir is None else witness_dir)
    bad, generations = {}, {}
    for rid in request_ids:
        rec = store.get(rid) or {}
        runs = seen.get(rid, [])
        generations[rid] = finished_generations(runs)
        if rec.get("status") != "SUCCEEDED" or not rec.get("result"):
            bad[rid] = f"no stored result ({rec.get('status')})"
            continue
        res = json.loads(rec["result"])
        if not any(g["attempt"] == res["attempts"] and g["total"] == res["completion_tokens"]
                   and g["sample"] == 0 for g in runs):
            bad[rid] = (f"stored attempt {res['attempts']}, {res['completion_tokens']} tokens; "
                        f"the witness saw {runs}")
        elif not 1 <= generations[rid] <= at_most.get(rid, 1):
            bad[rid] = (f"ran to completion {generations[rid]} times (allowed "
                        f"{at_most.get(rid, 1)}); the witness saw {runs}")
    assert not bad, f"stored results the engines' witness does not back: {bad}"
    return generations
