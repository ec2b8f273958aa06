"""bench/throughput.py's rounds: one workload's rounds, every side in turn (the side runners:
`.delay`, `generate_many`, direct, bare Celery, with and without logprobs) and each round's
ratios, the LoRA lanes' own cost, and the line each measured round prints."""
from __future__ import annotations

import time

from bench.cpu_meter import _errors_note, _fmt_cpu, collect
from bench.direct_engine import MODEL, DirectEngine, make_prompts
from bench.step_meter import Steps, scrape_steps
from bench.throughput_args import Workload


class WorkloadRounds:
    """The measured rounds of bench/throughput.py's `Bench`, its base class: they use its args,
    Redis, temp dir, process list and helpers (`say`, `measure`, `submit_all`)."""

    def _workload(self, w: "Workload", metrics_port: int, direct, bare) -> dict:
        """`w`'s rounds, each side going first in turn; per side its req/s per round, and the
        ratios of each round's pair of sides."""
        from tasks.inference import generate, generate_many

        a = self.args
        rates: dict[str, list[float]] = {side: [] for side in w.sides}
        steps: dict[str, list[Steps]] = {side: [] for side in w.sides}

        def celery_side(k: int, prompts: list[str], side: str, logprobs: int | None,
                        many: bool = False) -> None:
            submit_s = []
            extra = {} if logprobs is None else {"logprobs": logprobs}

            def celery_round():
                t0 = time.perf_counter()
                items = [dict(model=MODEL, prompt=p, max_tokens=w.max_tokens,
                              ignore_eos=True, **extra) for p in prompts]
                rs = generate_many(items) if many else self.submit_all(generate, items)
                submit_s.append(time.perf_counter() - t0)
                values, errors = collect(rs)
                return sum(v["completion_tokens"] for v in values), len(values), errors

            before = scrape_steps(metrics_port)
            wall, (tokens, ok, errors), cpu = self.measure(celery_round)
            st = scrape_steps(metrics_port).over(before, wall)
            steps[side].append(st)
            self._report(w, k, side, wall, tokens, cpu, rates,
                         f" [submit {submit_s[0]:.2f} s]{_errors_note(errors)} | "
                         f"{st.describe()}", ok)

        def direct_side(k: int, prompts: list[str], side: str, logprobs: int | None) -> None:
            _, reply, cpu = self.measure(lambda: direct.run_round(w.round_base + k, w.requests,
                                                                   w.max_tokens, logprobs))
            st = Steps(reply["steps"], reply["step_outputs"], reply["elapsed"])
            steps[side].append(st)
            self._report(w, k, side, reply["elapsed"], reply["tokens"], cpu, rates,
                         f" | {st.describe()}")

        def bare_side(k: int, prompts: list[str], logprobs: int | None) -> None:
            before = bare.steps()
            wall, (tokens, ok, errors), cpu = self.measure(
                lambda: bare.run_round(prompts, w.max_tokens, logprobs))
            st = bare.steps().over(before, wall)
            steps["bare"].append(st)
            self._report(w, k, "bare", wall, tokens, cpu, rates,
                         f"{_errors_note(errors)} | {st.describe()}", ok)

        lp = w.logprobs  # what every side of the workload asks; the +lp sides add a.logprobs
        runs = {"celery": lambda k, p: celery_side(k, p, "celery", lp),
                "direct": lambda k, p: direct_side(k, p, "direct", lp),
                "bare": lambda k, p: bare_side(k, p, lp),
                "many": lambda k, p: celery_side(k, p, "many", lp, many=True),
                "celery+lp": lambda k, p: celery_side(k, p, "celery+lp", a.logprobs),
                "direct+lp": lambda k, p: direct_side(k, p, "direct+lp", a.logprobs)}
        sides = w.sides
        if w.logprobs is not None:  # each engine's first logprobs steps are slow (seconds)
            warm = make_prompts(16, 998)
            kw = dict(model=MODEL, max_tokens=w.max_tokens, ignore_eos=True, logprobs=w.logprobs)
            collect([generate.delay(prompt=p, **kw) for p in warm])
            direct.run_round(998, len(warm), w.max_tokens, w.logprobs)
            if bare is not None:
                bare.run_round(warm, w.max_tokens, w.logprobs)
        for k in range(w.rounds):  # each side goes first in turn
            prompts = make_prompts(w.requests, w.round_base + k)
            for side in sides[k % len(sides):] + sides[:k % len(sides)]:
                runs[side](k, prompts)

        def per_round(x: str, y: str) -> list[float]:
            return [p / q for p, q in zip(rates[x], rates[y])]

        out = {"rates": rates, "ratios": per_round("celery", "direct"),
               "step_ratios": [c.per_s / d.per_s for c, d in zip(steps["celery"],
                                                                  steps["direct"])],
               "batch_ratios": [c.batch / d.batch for c, d in zip(steps["celery"],
                                                                  steps["direct"])]}
        if "celery+lp" in rates:
            for side in ("celery", "direct"):
                out[f"{side}_lp_cost"] = per_round(f"{side}+lp", side)
            out["lp_ratios"] = per_round("celery+lp", "direct+lp")
        if "many" in rates:
            out["many_ratios"] = per_round("many", "direct")
        if "bare" in rates:
            out["bare_ratios"] = per_round("bare", "direct")
            if "many" in rates:
                out["many_bare_ratios"] = per_round("many", "bare")
            out["celery_bare_ratios"] = per_round("celery", "bare")
        return out

    def lora_cost(self) -> dict[str, list[float]]:
        """The direct engine with the worker's LoRA lanes against the same engine without them,
        `--lora-rounds` rounds each, alternating: what enabling LoRA costs the engine itself."""
        a = self.args
        engines = {"direct+lora": DirectEngine(self.emb.vigil_env(self.redis.url),
                                               self.tmp / "direct-lora.log", str(self.emb.REPO)),
                   "direct-nolora": DirectEngine(self.emb.vigil_env(self.redis.url),
                                                 self.tmp / "direct-nolora.log",
                                                 str(self.emb.REPO), lora=False)}
        self.procs += [e.proc for e in engines.values()]
        rates: dict[str, list[float]] = {name: [] for name in engines}
        try:
            for e in engines.values():
                e.wait_ready()
            for e in engines.values():
                e.run_round(999, min(a.requests, 128), 8)
            for k in range(a.lora_rounds):
                names = list(engines) if k % 2 == 0 else list(reversed(engines))
                for name in names:
                    _, reply, cpu = self.measure(
                        lambda e=engines[name]: e.run_round(k, a.requests, a.max_tokens))
                    self._report(Workload("lora", a.requests, a.max_tokens, None, 0, 0, []),
                                 k, name, reply["elapsed"], reply["tokens"], cpu, rates)
        finally:
            for e in engines.values():
                e.close(self.emb.stop_process)
        return rates

    def _report(self, w: "Workload", k, side, wall, tokens, cpu, rates, extra: str = "",
                ok=None) -> None:
        rate = (w.requests if ok is None else ok) / wall  # failed requests do not count
        rates[side].append(rate)
        note = "" if tokens == w.requests * w.max_tokens or ok is not None and ok < w.requests \
            else f" (!) {tokens} tokens, expected {w.requests * w.max_tokens}"
        self.say(f"round {k + 1} {side:13s}: {w.requests} req in {wall:6.2f} s = {rate:6.1f} req/s "
                 f"({tokens / wall:7.0f} tok/s){note}{extra} | cpu% {_fmt_cpu(cpu)}")
