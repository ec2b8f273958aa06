"""The online bench's figures (bench/online.py): each segment's line, and the summary with
Vigil's ratios to `vllm serve` against the goals of issue 41."""
from __future__ import annotations

import math
import statistics

from bench.online_client import Stream, quantile
from bench.online_redis import (counter_delta, entries, first_token_stages, live_delays,
                                stage_table, step_gaps)

GOAL_TTFT_MS = 60.0
GOAL_ITL = 1.2
GOAL_TPS = 0.8
GOAL_LIVE_P99_MS = 50.0


def ms(x: float) -> str:
    """Seconds as milliseconds with one decimal (nan for none)."""
    return "nan" if x is None or math.isnan(x) else f"{1000 * x:.1f}"


class Report:
    """Collects every segment (`add`), the Redis-side readings (`live_and_stages`, `kill`),
    and prints the summary."""

    def __init__(self, args, say):
        self.a, self.say = args, say
        self.rows: dict[tuple[str, int], list[tuple[int, list[Stream], float]]] = {}
        # level -> [Redis CPU s, {command: [calls, usec]}, tokens, requests]
        self.redis: dict[int, list] = {}
        self.live: dict[int, tuple] = {}
        self.stages: dict[int, list] = {}
        self.kill: dict | None = None
        self.other: dict[tuple[str, int], list[float]] = {}
        self.cpu: dict[tuple[str, int], list[tuple[dict, float, int]]] = {}
        self.engine_itl: dict[int, list[float]] = {}

    def add(self, side: str, level: int, round_no: int, streams: list[Stream], wall: float,
            c0, c1, cpu: dict[str, float]) -> str:
        """One segment's streams and its processes' CPU (% of a core, OTHER: the rest of the
        machine); its line."""
        self.rows.setdefault((side, level), []).append((round_no, streams, wall))
        self.other.setdefault((side, level), []).append(cpu.get("OTHER", 0.0))
        self.cpu.setdefault((side, level), []).append(
            (cpu, wall, sum(len(s.token_ids) for s in streams)))
        tokens = sum(len(s.token_ids) for s in streams)
        if c0 is not None:
            cpu, cmds = counter_delta(c0, c1)
            acc = self.redis.setdefault(level, [0.0, {}, 0, 0])
            acc[0] += cpu
            for k, (calls, usec) in cmds.items():
                cur = acc[1].setdefault(k, [0, 0])
                cur[0] += calls
                cur[1] += usec
            acc[2] += tokens
            acc[3] += len(streams)
        ttft = [s.ttft for s in streams if s.ttft is not None]
        gaps = [g for s in streams for g in s.gaps()]
        events = sum(len(s.counts) for s in streams)
        bad = [s for s in streams if not (s.ok and len(s.token_ids) == self.a.tokens)]
        note = f"; (!) {len(bad)} FAILED, e.g. {bad[0].error or bad[0].finish}" if bad else ""
        return (f"{side:9s} c={level:<2d} {len(streams):3d} req: TTFT p50 {ms(quantile(ttft, .5))}"
                f" p99 {ms(quantile(ttft, .99))} ms, ITL p50 {ms(quantile(gaps, .5))} p99 "
                f"{ms(quantile(gaps, .99))} ms, {tokens / wall:.0f} tok/s, "
                f"{tokens / max(1, events):.2f} tok/event{note}")

    def live_and_stages(self, client) -> None:
        """Vigil's streams read back from Redis: live delays and first-token stages."""
        for (side, level), rounds in self.rows.items():
            if side != "vigil":
                continue
            total, worker, relay, tail, multi, stages = [], [], [], 0, 0, []
            itl = self.engine_itl.setdefault(level, [])
            for _, streams, _ in rounds:
                for s in streams:
                    es = entries(client, s.key)
                    itl += step_gaps(es)
                    t, w, r, ta, mu = live_delays(s, es)
                    total += t
                    worker += w
                    relay += r
                    tail += ta
                    multi += mu
                    st = first_token_stages(client, s, es)
                    if st is not None:
                        stages.append(st)
            self.live[level] = (total, worker, relay, tail, multi)
            self.stages[level] = stages

    # -- the summary ----------------------------------------------------------------------------
    def level_figures(self, side: str, level: int) -> dict:
        """One side's figures at one concurrency over every round: TTFT, ITL, tokens/s per
        round, tokens per event, failed streams."""
        rounds = self.rows.get((side, level), [])
        streams = [s for _, ss, _ in rounds for s in ss]
        ttft = [s.ttft for s in streams if s.ttft is not None]
        gaps = [g for s in streams for g in s.gaps()]
        tps = {r: sum(len(s.token_ids) for s in ss) / wall for r, ss, wall in rounds}
        events = sum(len(s.counts) for s in streams)
        return {"ttft50": quantile(ttft, .5), "ttft99": quantile(ttft, .99),
                "itl50": quantile(gaps, .5), "itl99": quantile(gaps, .99), "tps": tps,
                "tpe": sum(len(s.token_ids) for s in streams) / max(1, events),
                "failed": sum(1 for s in streams
                              if not (s.ok and len(s.token_ids) == self.a.tokens))}

    def summary(self) -> int:
        """Print the summary; 0 when every stream ended whole and the kill lost or changed none."""
        say, sides = self.say, sorted({s for s, _ in self.rows}, key=lambda s: s != "vigil")
        levels = sorted({lv for _, lv in self.rows})
        say("-- summary --")
        say(f"{'side':9s} {'c':>3s}  {'TTFT p50/p99 ms':>17s}  {'ITL p50/p99 ms':>15s}  "
            f"{'tokens/s median (min-max)':>26s}  tok/event  failed  OTHER %")
        fig = {(s, lv): self.level_figures(s, lv) for s in sides for lv in levels}
        failed = 0
        for lv in levels:
            for s in sides:
                f = fig[(s, lv)]
                t = list(f["tps"].values())
                failed += f["failed"]
                say(f"{s:9s} {lv:3d}  {ms(f['ttft50']):>8s}/{ms(f['ttft99']):<8s}  "
                    f"{ms(f['itl50']):>7s}/{ms(f['itl99']):<7s}  "
                    f"{statistics.median(t):9.0f} ({min(t):.0f}-{max(t):.0f}){'':8s}  "
                    f"{f['tpe']:9.2f}  {f['failed']:6d}  "
                    f"{statistics.median(self.other.get((s, lv)) or [0]):.0f}")
        for base in [s for s in sides if s != "vigil"]:
            v1, b1 = fig[("vigil", levels[0])], fig[(base, levels[0])]
            d = 1000 * (v1["ttft50"] - b1["ttft50"])
            say(f"vigil vs {base}: TTFT p50 at c={levels[0]} {d:+.1f} ms (goal <= "
                f"+{GOAL_TTFT_MS:.0f} ms: {'met' if d <= GOAL_TTFT_MS else 'MISSED'})")
            itl = {lv: fig[("vigil", lv)]["itl50"] / fig[(base, lv)]["itl50"] for lv in levels}
            say("  ITL p50 ratio " + ", ".join(
                f"c={lv} {x:.2f}x ({'met' if x <= GOAL_ITL else 'MISSED'})"
                for lv, x in itl.items()) + f" (goal <= {GOAL_ITL}x)")
            top = levels[-1]
            vt, bt = fig[("vigil", top)]["tps"], fig[(base, top)]["tps"]
            ratios = [vt[r] / bt[r] for r in vt if r in bt and bt[r]]
            m = statistics.median(ratios)
            say(f"  tokens/s ratio at c={top}: {m:.2f}x ({min(ratios):.2f}-{max(ratios):.2f} over "
                f"{len(ratios)} rounds) (goal >= {GOAL_TPS}x: "
                f"{'met' if m >= GOAL_TPS else 'MISSED'})")
        self.print_cpu(sides, levels[-1])
        self.print_live(levels)
        self.print_redis(levels)
        ok = failed == 0
        if self.kill is not None:
            ok = self.print_kill() and ok
        return 0 if ok else 1

    def print_cpu(self, sides, level: int) -> None:
        """CPU per token by process at `level` (median over rounds): where the cores went."""
        self.say(f"CPU per streamed token at c={level}, us (median over rounds; the engine's "
                 "processes, the serving path's, the client's):")
        for side in sides:
            per: dict[str, list[float]] = {}
            for cpu, wall, tokens in self.cpu.get((side, level), []):
                for k, pct in cpu.items():
                    if k != "OTHER" and tokens and (k.split("/")[0] in (side, "client")
                                                    or side == "vigil" and k.split("/")[0] in
                                                    ("api", "worker", "redis")):
                        per.setdefault(k, []).append(pct / 100 * wall / tokens * 1e6)
            self.say(f"  {side:9s} " + ", ".join(
                f"{k} {statistics.median(v):.0f}" for k, v in sorted(per.items())))

    def print_live(self, levels) -> None:
        """The live delays, the engine's own inter-token time and the first token's stages."""
        say = self.say
        say("live delay (vigil): client receipt - the engine step's w, per token; = step -> "
            "in Redis + in Redis -> client")
        every = []
        for lv in levels:
            if lv not in self.live:
                continue
            total, worker, relay, tail, multi = self.live[lv]
            every += total
            say(f"  c={lv:<2d} {len(total):6d} tokens: p50 {ms(quantile(total, .5))} p99 "
                f"{ms(quantile(total, .99))} ms (step -> Redis p50 {ms(quantile(worker, .5))} "
                f"p99 {ms(quantile(worker, .99))}; Redis -> client p50 "
                f"{ms(quantile(relay, .5))} p99 {ms(quantile(relay, .99))}); from the result "
                f"(no w) {tail}; in chunks of >1 token {multi}")
        for lv in levels:
            itl = self.engine_itl.get(lv) or []
            if itl:
                say(f"  engine's own inter-token time at c={lv} (consecutive chunks' w, per "
                    f"token): p50 {ms(quantile(itl, .5))} p99 {ms(quantile(itl, .99))} ms")
        p99 = quantile(every, .99)
        say(f"  all    {len(every):6d} tokens: p50 {ms(quantile(every, .5))} p99 {ms(p99)} ms "
            f"(goal p99 <= {GOAL_LIVE_P99_MS:.0f} ms: "
            f"{'met' if 1000 * p99 <= GOAL_LIVE_P99_MS else 'MISSED'})")
        for lv in levels:
            rows = stage_table(self.stages.get(lv, []))
            if rows:
                say(f"  first token's stages at c={lv} (p50/p99 ms, {len(self.stages[lv])} "
                    "requests): " + "; ".join(f"{k} {ms(a)}/{ms(b)}" for k, a, b in rows))

    def print_redis(self, levels) -> None:
        """Redis' work per streamed token, per concurrency."""
        say = self.say
        say("Redis per streamed token (vigil segments; INFO commandstats and used_cpu, idle "
            "traffic included)")
        for lv in levels:
            if lv not in self.redis:
                continue
            cpu, cmds, tokens, reqs = self.redis[lv]
            calls = sum(c for c, _ in cmds.values())
            top = sorted(cmds.items(), key=lambda kv: -kv[1][1])[:8]
            say(f"  c={lv:<2d} {tokens} tokens, {reqs} requests: Redis CPU "
                f"{1e6 * cpu / tokens:.1f} us/token ({1e3 * cpu / reqs:.2f} ms/request), "
                f"{calls / tokens:.2f} commands/token; " + ", ".join(
                    f"{k} {c / tokens:.2f}x {u / tokens:.1f}us" for k, (c, u) in top))

    def print_kill(self) -> bool:
        """The kill's figures; True when every stream completed identical to its twin."""
        k, say = self.kill, self.say
        say(f"kill under load: {k['completed']}/{k['streams']} streams completed, "
            f"{k['identical']}/{k['streams']} identical to their uninterrupted twins "
            f"({k['twins_ok']} twins ok); first attempt on the victim, ended on the steady "
            f"worker: {k['first_attempt_on_victim']}/{k['streams']}")
        say(f"  pause each client saw: p50 {k['p50']:.2f} s, p99 {k['p99']:.2f} s, max "
            f"{k['max']:.2f} s; streams went on {k['resumed_first_s']:.2f}-"
            f"{k['resumed_last_s']:.2f} s after the kill; the run took {k['took_s']:.1f} s")
        say(f"  tokens durable at the kill {k['durable']} of {k['streams'] * k['tokens']}; "
            f"resumed from exactly them: {k['resumed_at_durable']}/{k['streams']}; tokens "
            f"recomputed (whole steps between each stream's last durable step and the kill, "
            f"at {k['step_ms']:.1f} ms/token): {k['recomputed']}")
        if k["errors"]:
            say(f"  errors: {k['errors']}")
        return k["completed"] == k["identical"] == k["streams"]
