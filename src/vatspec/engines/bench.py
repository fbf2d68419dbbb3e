"""Serving benchmark: the same prompts sent to one engine serving the target alone (``NONE``) and with each
draft, at each concurrency and temperature, repeated, with the engine's own acceptance counters read around
every piece of load.

    arms = [Arm(NONE, launch=EngineLaunch("vllm", py, target)), Arm("vat", launch=EngineLaunch(..., draft=d))]
    results = serve_bench(arms, bodies, concurrencies=[1, 4, 16], temperatures=[0.0], repeats=2,
                          log_dir=out / "logs", save=write_json)

Runs are interleaved so that one burst of load cannot decide a comparison: repeat r takes the arms in an
order rotated by r, each arm running every (temperature, concurrency) cell. A launched server is started for
its turn and stopped after it (one accelerator holds one engine) unless ``together`` (all started once, up for
the whole run); a server given as an endpoint is the user's, never started nor stopped. ``save(results)`` is
called after every cell, so a run cut short keeps what it measured. A server that dies marks the cell it was
in as ``failed`` (with its exit code and log tail) and its later cells as not run; the others go on.

At concurrency 1 the counters are read after every request, so the engine's acceptance is known per prompt,
to be set beside vatspec's own decoding of the same prompts (``acceptance_difference``).

``ratio_interval``: a throughput ratio with a 95% bootstrap interval over requests. A closed loop at
concurrency c keeps c requests in flight, so its throughput is c x (output tokens / request-seconds) while
the queue is full; at the same c, the ratio of two servers' throughputs is the ratio of their
``sum(tokens) / sum(latency)`` over the same requests, resampled as pairs (one request: one prompt in one repeat).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from vatspec.engines.launch import EngineLaunch, Server, ServerError
from vatspec.engines.load import Request, run_load, stream_chat
from vatspec.engines.metrics import Scraper, SpecCounters
from vatspec.eval.stats import Interval, bootstrap_stratified, paired_difference

NONE = "none"  # the arm that serves the target without speculation


@dataclass
class Arm:
    """One server under test: launched from ``launch``, or the user's at ``url`` serving ``model``."""

    name: str
    launch: EngineLaunch | None = None
    url: str | None = None
    model: str | None = None
    server: Server | None = None
    dead: str | None = None  # why its remaining cells are not run
    warm: bool = False

    @contextlib.contextmanager
    def running(self, log_dir, start_s: float):
        """The arm serving for the block: started (and stopped after) unless already up or the user's."""
        if self.launch is None or self.server is not None:
            yield self
            return
        with Server(self.launch, log_dir, self.name, start_s) as server:
            self.server, self.url, self.model = server, server.url, server.model
            self.warm = False
            try:
                yield self
            finally:
                self.server = None

    def gone(self) -> str | None:
        """Why the arm's server can no longer answer (None: it can)."""
        if self.server is not None and not self.server.alive():
            return self.server.exit_note()
        return None


def body(messages: list[dict], model: str, max_tokens: int, temperature: float, seed: int,
         template_kwargs: dict | None) -> dict:
    out = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
    if temperature > 0:
        out["seed"] = seed
    if template_kwargs:
        out["chat_template_kwargs"] = template_kwargs
    return out


def _cell(arm: Arm, bodies: list[dict], concurrency: int, timeout: float, key: str | None) -> dict:
    scraper = Scraper(arm.url, key)
    before = scraper.read()
    per_request: list[dict | None] = []
    if concurrency == 1:  # the counters around each request: the engine's acceptance per prompt
        reqs, t0 = [], time.monotonic()
        for i, b in enumerate(bodies):
            reqs.append(stream_chat(arm.url, b, timeout, key, Request(index=i)))
            now = scraper.read()
            per_request.append(None if now is None or before is None else (now - before).to_dict())
            before = now if now is not None else before
            if arm.gone():
                break
        wall = time.monotonic() - t0
        total = _sum_counters(per_request)
    else:
        reqs, wall = run_load(arm.url, bodies, concurrency, timeout, key)
        after = scraper.read()
        total = None if before is None or after is None else (after - before).to_dict()
    out = {"wall_s": wall, "requests": [r.to_dict() for r in reqs], "counters": total,
           "counters_per_request": per_request or None, "metrics_error": scraper.failed}
    return out


def _sum_counters(items: Sequence[dict | None]) -> dict | None:
    if not items or any(c is None for c in items):
        return None
    n = max(len(c["accepted_per_pos"]) for c in items)
    gauges = [c["mean_acceptance_length"] for c in items  # SGLang: its gauge, where no counters are
              if c["drafts"] == 0 and c.get("mean_acceptance_length") is not None]
    total = SpecCounters(sum(c["drafts"] for c in items), sum(c["draft_tokens"] for c in items),
                         sum(c["accepted"] for c in items),
                         tuple(sum((c["accepted_per_pos"] + [0] * n)[j] for c in items) for j in range(n)), True,
                         sum(gauges) / len(gauges) if gauges else None)
    return total.to_dict()


def serve_bench(arms: Sequence[Arm], prompts: Sequence[list[dict]], *, concurrencies: Sequence[int],
                temperatures: Sequence[float], repeats: int, max_tokens: int, timeout: float, log_dir,
                template_kwargs: dict | None = None, together: bool = False, start_s: float = 900.0,
                seed: int = 0, key: str | None = None, save: Callable[[dict], None] = lambda r: None,
                say: Callable[[str], None] = print) -> dict:
    """Every arm x temperature x concurrency x repeat measured (see the module's text); the results dict."""
    results: dict = {"cells": [], "started": {}, "complete": False}
    stack = contextlib.ExitStack()
    with stack:
        if together:
            for arm in arms:
                try:
                    stack.enter_context(arm.running(log_dir, start_s))
                except ServerError as e:  # it did not start: the others are measured
                    _failed_start(arm, e, 0, results, save, say)
                    continue
                results["started"][arm.name] = arm.server.started_s if arm.server else None
        for rep in range(repeats):
            order = [arms[(i + rep) % len(arms)] for i in range(len(arms))]
            for arm in order:
                if arm.dead:
                    continue
                try:
                    with arm.running(log_dir, start_s):
                        if arm.server is not None:
                            results["started"].setdefault(arm.name, arm.server.started_s)
                        _arm_cells(arm, prompts, rep, results, concurrencies=concurrencies, temperatures=temperatures,
                                   max_tokens=max_tokens, timeout=timeout, template_kwargs=template_kwargs,
                                   seed=seed, key=key, save=save, say=say)
                except ServerError as e:  # it did not start
                    _failed_start(arm, e, rep, results, save, say)
    results["complete"] = all(not a.dead for a in arms)
    save(results)
    return results


def _failed_start(arm: Arm, error: ServerError, rep: int, results: dict, save, say) -> None:
    arm.dead = str(error)
    results["cells"].append({"arm": arm.name, "repeat": rep, "failed": str(error)})
    save(results)
    say(f"{arm.name}: {error}")


def _arm_cells(arm: Arm, prompts, rep: int, results: dict, *, concurrencies, temperatures, max_tokens, timeout,
               template_kwargs, seed, key, save, say) -> None:
    if not arm.warm:  # the first request of a fresh server pays for compilation and caches: not counted
        stream_chat(arm.url, body(prompts[0], arm.model, min(max_tokens, 16), 0.0, seed, template_kwargs),
                    timeout, key)
        arm.warm = True
    for temp in temperatures:
        bodies = [body(p, arm.model, max_tokens, temp, seed + i, template_kwargs) for i, p in enumerate(prompts)]
        for c in concurrencies:
            if (why := arm.gone()) is not None:
                arm.dead = why
                results["cells"].append({"arm": arm.name, "repeat": rep, "temperature": temp, "concurrency": c,
                                         "failed": why, "not_run": True})
                save(results)
                return
            cell = {"arm": arm.name, "repeat": rep, "temperature": temp, "concurrency": c,
                    **_cell(arm, bodies, c, timeout, key)}
            if (why := arm.gone()) is not None:
                cell["failed"] = arm.dead = why  # partial: its requests are kept, marked
            results["cells"].append(cell)
            save(results)
            ok = [r for r in cell["requests"] if r["error"] is None]
            toks = sum(r["output_tokens"] for r in ok)
            say(f"{arm.name:>12} T={temp:g} c={c:<3} repeat {rep}: {len(ok)}/{len(bodies)} answered, "
                f"{toks / cell['wall_s']:.1f} output tok/s" + (f"; FAILED: {cell['failed'].splitlines()[0]}"
                                                               if "failed" in cell else ""))


# -- the figures ------------------------------------------------------------------------------------------------

def _quantiles(xs: list[float]) -> dict:
    if not xs:
        return {"median": None, "p90": None}
    return {"median": float(np.median(xs)), "p90": float(np.quantile(xs, 0.9))}


def summarize(results: dict) -> dict:
    """Per arm, temperature and concurrency: throughputs (from each cell's wall clock, averaged over repeats),
    TTFT / TPOT / end-to-end quantiles over every request, and the engine's acceptance over every cell."""
    groups: dict = {}
    for cell in results["cells"]:
        if "requests" not in cell:
            continue
        groups.setdefault((cell["arm"], cell["temperature"], cell["concurrency"]), []).append(cell)
    out: dict = {}
    for (arm, temp, c), cells in groups.items():
        reqs = [r for cell in cells for r in cell["requests"] if r["error"] is None]
        full = [cell for cell in cells if "failed" not in cell]
        counters = [cell["counters"] for cell in cells if cell.get("counters")]
        acc = _sum_counters(counters) if counters else None
        tok_s = [sum(r["output_tokens"] for r in cell["requests"] if r["error"] is None) / cell["wall_s"]
                 for cell in full if cell["wall_s"] > 0]
        req_s = [sum(r["error"] is None for r in cell["requests"]) / cell["wall_s"] for cell in full
                 if cell["wall_s"] > 0]
        out.setdefault(arm, {}).setdefault(str(temp), {})[str(c)] = {
            "repeats": len(cells), "complete_repeats": len(full),
            "requests": sum(len(cell["requests"]) for cell in cells), "failed_requests":
                sum(r["error"] is not None for cell in cells for r in cell["requests"]),
            "output_tokens_per_s": float(np.mean(tok_s)) if tok_s else None,
            "requests_per_s": float(np.mean(req_s)) if req_s else None,
            "ttft_s": _quantiles([r["ttft"] for r in reqs if r["ttft"] is not None]),
            "tpot_s": _quantiles([r["tpot"] for r in reqs if r["tpot"] is not None]),
            "latency_s": _quantiles([r["latency"] for r in reqs]),
            "acceptance": acc if acc and acc["mean_acceptance_length"] is not None else None,
        }
    return out


def _paired_requests(results: dict, a: str, b: str, temp: float, c: int) -> tuple[np.ndarray, ...]:
    """Per (repeat, prompt) answered by both arms: tokens and latency of each."""
    def table(arm):
        return {(cell["repeat"], r["index"]): r for cell in results["cells"]
                if cell.get("arm") == arm and cell.get("temperature") == temp and cell.get("concurrency") == c
                for r in cell.get("requests", []) if r["error"] is None}

    ta, tb = table(a), table(b)
    keys = sorted(set(ta) & set(tb))
    return (np.array([ta[k]["output_tokens"] for k in keys], float), np.array([ta[k]["latency"] for k in keys]),
            np.array([tb[k]["output_tokens"] for k in keys], float), np.array([tb[k]["latency"] for k in keys]))


def ratio_interval(results: dict, a: str, b: str, temp: float, c: int, *, level: float = 0.95,
                   seed: int = 0) -> Interval | None:
    """Arm ``a``'s throughput over arm ``b``'s at (temperature, concurrency) with its bootstrap interval over
    paired requests (module text); None when no request was answered by both."""
    tok_a, lat_a, tok_b, lat_b = _paired_requests(results, a, b, temp, c)
    if len(tok_a) == 0 or lat_a.sum() <= 0 or lat_b.sum() <= 0 or tok_b.sum() <= 0:
        return None

    def stat(idx):
        i = idx[0]
        return (tok_a[i].sum(-1) / lat_a[i].sum(-1)) / (tok_b[i].sum(-1) / lat_b[i].sum(-1))

    est, low, high = bootstrap_stratified(stat, [len(tok_a)], level=level, seed=seed)
    return Interval(est, low, high, level, len(tok_a))


def ratio_words(what: str, iv: Interval | None) -> str:
    if iv is None:
        return f"{what}: no request answered by both, no ratio"
    if not iv.resolved:
        return f"{what}: {iv.estimate:.2f}x from {iv.units} request (too few for an interval)"
    head = f"{what}: {iv.estimate:.2f}x [{iv.low:.2f}, {iv.high:.2f}] over {iv.units} paired requests"
    if iv.contains_null:
        return head + ": the interval contains 1.0x, so this run shows no difference in throughput"
    return head + (": faster" if iv.estimate > 1 else ": slower")


def ratios(results: dict, pairs: Sequence[tuple[str, str]]) -> list[dict]:
    """Every pair ``(a, b)`` at every measured (temperature, concurrency): the ratio a / b with its interval."""
    cells = sorted({(cell["temperature"], cell["concurrency"]) for cell in results["cells"] if "requests" in cell})
    out = []
    for a, b in pairs:
        for temp, c in cells:
            iv = ratio_interval(results, a, b, temp, c)
            out.append({"arm": a, "vs": b, "temperature": temp, "concurrency": c,
                        "ratio": None if iv is None else iv.to_dict(),
                        "words": ratio_words(f"{a} / {b} at T={temp:g}, concurrency {c}", iv)})
    return out


def engine_acceptance_per_prompt(results: dict, arm: str, temp: float = 0.0) -> dict[int, tuple[int, int]]:
    """The engine's (accepted, drafts) per prompt index, summed over the repeats at concurrency 1."""
    out: dict[int, tuple[int, int]] = {}
    for cell in results["cells"]:
        if cell.get("arm") != arm or cell.get("concurrency") != 1 or cell.get("temperature") != temp:
            continue
        for r, cnt in zip(cell["requests"], cell.get("counters_per_request") or []):
            if cnt is None or r["error"] is not None:
                continue
            a, d = out.get(r["index"], (0, 0))
            out[r["index"]] = (a + cnt["accepted"], d + cnt["drafts"])
    return out


def acceptance_difference(engine: dict[int, tuple[int, int]], ours: dict[int, tuple[int, int]], seed: int = 0):
    """Engine - vatspec in accepted tokens per round (pooled over prompts), paired over the prompts both
    measured; a ``Difference`` (None without a common prompt)."""
    keys = sorted(i for i in set(engine) & set(ours) if engine[i][1] > 0 and ours[i][1] > 0)
    if not keys:
        return None
    return paired_difference([engine[i][0] for i in keys], [ours[i][0] for i in keys],
                             [engine[i][1] for i in keys], [ours[i][1] for i in keys], seed=seed)
