"""What ``vatspec eval`` reports from ``bench.evaluate``'s results: the paper's table, where a round's time goes,
every speedup with its paired-bootstrap interval and the compared pairs' differences in words, the draft
length's calibration and its re-check, the per-prompt τ differences, the plots, and the files.

    results = bench.evaluate(target, methods, prompts, ...)
    write_report(results, "runs/eval", relative_to={"vat": "base"})   # results.json, .md, tau.png, acceptance.png

Nothing here measures; every figure comes from ``results``. A report never prints nan or inf (``check_finite``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from vatspec.eval.bench import AR, DISPLAY, HF
from vatspec.eval.machine import BUSY


# --------------------------------------------------------------------------- report
def _fmt(x: float, kind: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return {"speedup": f"{x:.2f}×", "tau": f"{x:.2f}", "pct": f"{x:+.1f}%", "tps": f"{x:.1f}"}[kind]


def _pairs(results: dict, relative_to: str | Mapping[str, str] | None) -> dict[str, str] | None:
    """``relative_to`` as method -> its baseline: one name means every other method vs it."""
    methods = [n for n in results["summary"] if n not in (AR, HF)]
    if isinstance(relative_to, str):
        relative_to = {m: relative_to for m in methods if m != relative_to}
    for base in (relative_to or {}).values():
        if base not in results["summary"]:
            raise ValueError(f"--relative-to {base!r}: no such method (have {', '.join(methods)})")
    return dict(relative_to) if relative_to else None


def markdown_table(results: dict, relative_to: str | Mapping[str, str] | None = None) -> str:
    """The paper's table (method x benchmark: speedup and tau, then the average), a row of
    relative change under every method compared (``relative_to``: one baseline name for all, or
    a mapping method -> its own baseline), and a throughput table that puts the AR baseline next
    to HF ``generate()``."""
    summary, benches = results["summary"], list(results["benchmarks"])
    cols = [*benches, "average"]
    methods = [n for n in summary if n not in (AR, HF)]
    relative_to = _pairs(results, relative_to)
    cfg = results["config"]
    lines = [
        f"Speculative decoding at temperature {cfg['temperature']:g}, max_new_tokens {cfg['max_new_tokens']}, "
        f"batch size 1, {cfg['device']}. Speedup = tokens/s over the AR baseline (same loop, no draft), "
        "measured interleaved; τ = tokens committed per target verify pass, bonus included.",
        "",
        "| Method | " + " | ".join(f"{c} speedup | {c} τ" for c in cols) + " |",
        "|---|" + "---:|---:|" * len(cols),
    ]
    for name in [AR, *methods]:
        row = summary[name]
        cells = [f"{_fmt(row[c].get('speedup'), 'speedup')} | {_fmt(row[c].get('tau'), 'tau')}" for c in cols]
        lines.append(f"| {DISPLAY.get(name, name)} | " + " | ".join(cells) + " |")
        if relative_to and name in relative_to:
            base = summary[relative_to[name]]
            rel = [" | ".join(_fmt(relative_change(row[c].get(m), base[c].get(m)), "pct") for m in ("speedup", "tau"))
                   for c in cols]
            lines.append(f"| Δ vs {relative_to[name]} | " + " | ".join(rel) + " |")
    head = ["Benchmark", "prompts", "AR tok/s"]
    head += [f"{DISPLAY[HF]} tok/s", "AR / HF"] if HF in summary else []
    head += [f"{m} tok/s" for m in methods]
    lines += ["", "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for c in cols:
        ar = summary[AR][c]["tokens_per_s"]
        cells = [c, str(results["benchmarks"].get(c, sum(results["benchmarks"].values()))), _fmt(ar, "tps")]
        if HF in summary:
            hf = summary[HF][c]["tokens_per_s"]
            cells += [_fmt(hf, "tps"), f"{ar / hf:.2f}"]
        cells += [_fmt(summary[m][c]["tokens_per_s"], "tps") for m in methods]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *round_cost_table(summary, benches, methods)]
    if "runs" in results:
        intervals = speedup_intervals(results, relative_to)
        lines += ["", *remeasure_lines(results), *speedup_lines(results, intervals)]
    if results.get("calibration"):
        lines += ["", *calibration_lines(results["calibration"])]
        if "runs" in results:
            lines += ["", *recheck_lines(results, intervals)]
    if relative_to and "runs" in results:
        lines += ["", *paired_tau_lines(results, relative_to)]
    return "\n".join(lines) + "\n"


def remeasure_lines(results: dict) -> list[str]:
    """Markdown: which prompts were measured again because a burst of load hit one of their runs, and
    whether a quiet measurement was found (``_remeasure``); nothing when none was."""
    cfg = results["config"]
    again = cfg.get("remeasured") or {}
    if not again:
        return []
    n = sum(len(v) for v in again.values())
    runs = results["runs"][AR]
    still = [f"{b} #{i}" for b, idx in again.items() for i in idx
             if runs[b][i].get("disturbance", 0) > cfg["disturbed_above"]]
    text = (f"{n} prompt(s) were measured again ({', '.join(f'{b} #{i}' for b, idx in again.items() for i in idx)}): "
            f"one of their runs took more than {cfg['disturbed_above']:.1f}x its method's median time per round, or "
            f"other work took more than {BUSY} of a core during it; up to {cfg['remeasure']} more measurements of "
            "the whole prompt, the least disturbed kept.")
    if still:
        text += (f" Still disturbed after that: {', '.join(still)}; the machine stayed busy, and the intervals below "
                 "carry that noise.")
    return [text, ""]


def relative_change(x: float | None, base: float | None) -> float:
    """x over base as a change in percent; nan (printed "-") when there is no base to compare with."""
    if x is None or not base or not (math.isfinite(x) and math.isfinite(base)):
        return float("nan")
    return 100.0 * (x / base - 1.0)


NONFINITE = re.compile(r"(?<![\w.])[+-]?(nan|inf|infinity)(?![\w])", re.IGNORECASE)


def check_finite(text: str, where: str) -> str:
    """``text`` (a report) unchanged, or a ValueError naming the first line that prints a nan or an inf: every
    figure of a report is formatted so that a missing one reads "-"; one that does not is a bug."""
    for n, line in enumerate(text.splitlines(), 1):
        if NONFINITE.search(line):
            raise ValueError(f"{where}:{n}: the report prints a non-finite number (nan or inf): {line.strip()[:160]}")
    return text


def calibration_lines(calibration: Mapping[str, dict]) -> list[str]:
    """Markdown: per method, the k chosen on the calibration prompts and why (``calibrate``)."""
    level = next(iter(calibration.values())).get("confidence", 0.95)
    lines = ["Draft length chosen on held-out calibration prompts: a round drafting k costs `cost(k)` AR steps "
             "and commits `1 + S(1) + ... + S(k)` tokens on average (S(j) = P(at least j drafts accepted)). "
             f"From k = 1 up, a longer k is chosen only when it is faster in {100 * level:.0f}% of the calibration "
             "rounds and timing repetitions resampled with replacement (last column: the share of resamples in "
             "which each k beats the chosen one). The cost is the median over interleaved repetitions of each piece "
             "against the AR step of the same repetition, fitted non-decreasing in k (a pass over more tokens cannot "
             "cost less); \"as timed\" is before the fit.", "",
             "| Method | k | S(1..k_max) | cost(0..k_max), AR steps | as timed | expected speedup(0..k_max) | rounds "
             "| P(faster than chosen k), k = 1..k_max |",
             "|---|---:|---|---|---|---|---:|---|"]
    for name, c in calibration.items():
        if c.get("chosen_on") in calibration:  # a VAT arm decodes at its baseline's k: not calibrated itself
            lines.append(f"| {name} | {c['k']} | {c['chosen_on']}'s k (the same decode settings) | | | | | |")
            continue
        row = [" ".join(f"{x:.2f}" for x in c[f][start:]) if f in c else "-" for f, start in
               (("survival", 1), ("cost", 0), ("cost_measured", 0), ("speedup", 0), ("faster", 1))]
        lines.append(f"| {name} | {c['k']} | " + " | ".join([*row[:4], str(c["rounds"]), row[4]]) + " |")
    busy = [f"{name} ({c['others_cores']:.1f})" for name, c in calibration.items()
            if (c.get("others_cores") or 0) > BUSY and "chosen_on" not in c]
    if busy:
        lines += ["", f"Other work took cores of this machine while calibration timed the rounds of {', '.join(busy)} "
                  "(cores in brackets): those costs, and the k chosen on them, describe a busy machine."]
    slow = [name for name, c in calibration.items() if c.get("ar_wins") and "chosen_on" not in c]
    if slow:
        lines += ["", f"For {', '.join(slow)} even the best k is expected to be slower than decoding without the "
                  "draft (expected speedup < 1 on the calibration prompts): at this acceptance, drafting does not pay "
                  "on this machine. k is kept >= 1 so the draft is still measured."]
    return lines


def paired_tau(results: dict, method: str, base: str, *, seed: int = 0):
    """``stats.Difference`` of mean per-prompt τ, method - base, over every (benchmark, prompt) both
    ran (paired: the same prompt under both), with a 95% paired-bootstrap interval."""
    from vatspec.eval.stats import paired_difference

    a, b = [], []
    for bench, runs in results["runs"][method].items():
        for ra, rb in zip(runs, results["runs"][base][bench]):
            if ra.get("rounds") and rb.get("rounds"):
                a.append(ra["committed"] / ra["rounds"])
                b.append(rb["committed"] / rb["rounds"])
    return paired_difference(a, b, seed=seed)


def paired_tau_lines(results: dict, relative_to: Mapping[str, str]) -> list[str]:
    """Markdown: each compared method's per-prompt τ difference from its baseline, with its interval."""
    lines = ["| Method | vs | Δ mean per-prompt τ | 95% interval (paired bootstrap) | prompts |",
             "|---|---|---:|---:|---:|"]
    words = []
    for method, base in relative_to.items():
        d = paired_tau(results, method, base)
        lines.append(f"| {method} | {base} | {d.estimate:+.3f} ({d.relative:+.1f}%) | "
                     f"[{d.low:+.3f}, {d.high:+.3f}] | {d.units} |")
        words.append(d.sentence("Decode τ", method, base, "prompts"))
    return [*lines, "", *words]


# --------------------------------------------------------------------------- speedup intervals
def _tokens_and_seconds(results: dict, name: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per benchmark: ([n] new tokens, [n] wall seconds) of ``name``'s runs, prompt by prompt."""
    return [(np.array([r["tokens"] for r in rs], dtype=np.float64), np.array([r["wall_s"] for r in rs]))
            for rs in results["runs"][name].values()]


def _speedup_stat(results: dict, name: str, column: int | None):
    """``stat(indices) -> [R]`` (``stats.bootstrap_stratified``): ``name``'s speedup over AR, tokens/s pooled
    over the resampled prompts of a benchmark (``column``: its position), or (None) the mean over benchmarks;
    AR's runs are resampled with the same prompts, so the pair stays together."""
    mine, ar = _tokens_and_seconds(results, name), _tokens_and_seconds(results, AR)
    picked = range(len(mine)) if column is None else [column]

    def stat(indices: list[np.ndarray]) -> np.ndarray:
        per = [(mine[b][0][i].sum(-1) / mine[b][1][i].sum(-1)) / (ar[b][0][i].sum(-1) / ar[b][1][i].sum(-1))
               for b, i in zip(picked, indices)]
        return np.mean(per, axis=0)
    return stat, [len(mine[b][0]) for b in picked]


def speedup_intervals(results: dict, pairs: Mapping[str, str] | None = None, *, level: float = 0.95,
                      resamples: int = 10_000, seed: int = 0) -> dict:
    """Each method's speedup over AR with a paired-bootstrap interval, per benchmark and for the average over
    benchmarks (prompts resampled within each benchmark, the AR run of a prompt with it), and, for every
    ``pairs`` entry (method -> its baseline) and every re-checked k (chosen k -> k = 1), the difference of the
    two speedups on the same resampled prompts.

    Returns ``{"speedup": {method: {column: Interval}}, "difference": {"A vs B": {"method": A, "vs": B, column:
    Difference}}}``; the estimates equal ``summary``'s speedups (tokens/s pooled per benchmark, then averaged)."""
    from vatspec.eval.stats import Difference, Interval, bootstrap_stratified

    methods = [n for n in results["summary"] if n != AR]
    cols = [*results["runs"][AR], "average"]
    compared = [*(pairs or {}).items(), *results["config"].get("recheck", {}).items()]

    def column_stat(name: str, c: int):
        return _speedup_stat(results, name, None if cols[c] == "average" else c)

    out: dict = {"speedup": {}, "difference": {}}
    for name in methods:
        out["speedup"][name] = {}
        for c, col in enumerate(cols):
            stat, sizes = column_stat(name, c)
            est, low, high = bootstrap_stratified(stat, sizes, level=level, resamples=resamples, seed=seed)
            out["speedup"][name][col] = Interval(est, low, high, level, sum(sizes), 1.0)
    for a, b in compared:
        row = out["difference"][f"{a} vs {b}"] = {"method": a, "vs": b}
        for c, col in enumerate(cols):
            (sa, sizes), (sb, _) = column_stat(a, c), column_stat(b, c)
            est, low, high = bootstrap_stratified(lambda i, sa=sa, sb=sb: sa(i) - sb(i), sizes, level=level,
                                                  resamples=resamples, seed=seed)
            base = sb([np.arange(n)[None] for n in sizes])[0]
            row[col] = Difference(est, low, high, level, sum(sizes), float(base))
    return out


# below this many prompts in a benchmark, a percentile bootstrap within it under-covers (2 prompts give 3
# distinct resamples; the demo's widths at 2 and 4 prompts: docs/LOG.md, 2026-12-07)
FEW_PROMPTS = 4


def speedup_words(name: str, iv) -> str:
    """One method's speedup interval in words; says plainly when it contains 1.0x (no change)."""
    head = f"{name}: {iv.estimate:.2f}× the AR baseline"
    if not iv.resolved:
        return head + (f" over {iv.units} prompts; no interval (a benchmark with a single prompt cannot be "
                       "resampled): this run cannot tell a speedup from noise.")
    head += f", {round(100 * iv.level)}% interval [{iv.low:.2f}×, {iv.high:.2f}×] over {iv.units} prompts"
    if iv.contains_null:
        return head + ": the interval contains 1.0×, so this run does not show it faster or slower than decoding " \
                      "without a draft."
    return head + f": the interval excludes 1.0×, so it is {'faster' if iv.estimate > 1 else 'slower'} than " \
                  "decoding without a draft in this run."


def _interval_cell(iv) -> str:
    return f"{iv.estimate:.2f}× [{iv.low:.2f}, {iv.high:.2f}]" if iv.resolved else f"{iv.estimate:.2f}× [-]"


def _difference_words(what: str, a: str, b: str, d) -> str:
    if not (math.isfinite(d.low) and math.isfinite(d.high)):
        return (f"{what}: {a} - {b} = {d.estimate:+.3f} over {d.units} prompts; no interval (a benchmark with a "
                "single prompt cannot be resampled).")
    return d.sentence(what, a, b, "prompts")


def speedup_lines(results: dict, intervals: dict) -> list[str]:
    """Markdown: every method's speedup with its interval per benchmark and on average, the differences of the
    compared pairs, and both in words."""
    if not intervals["speedup"]:  # the AR baseline alone: nothing to compare
        return []
    cols = [*results["runs"][AR], "average"]
    level = round(100 * next(iter(next(iter(intervals["speedup"].values())).values())).level)
    lines = [f"Speedup over the AR baseline with {level}% intervals (paired bootstrap over prompts, resampled within "
             "each benchmark; the AR run of a prompt is resampled with it):", "",
             "| Method | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, row in intervals["speedup"].items():
        lines.append(f"| {DISPLAY.get(name, name)} | " + " | ".join(_interval_cell(row[c]) for c in cols) + " |")
    rechecks = results["config"].get("recheck", {})
    diffs = [d for d in intervals["difference"].values() if rechecks.get(d["method"]) != d["vs"]]
    if diffs:
        lines += ["", "| Method | vs | " + " | ".join(f"Δ speedup {c}" for c in cols) + " |",
                  "|---|---|" + "---:|" * len(cols)]
        for d in diffs:
            cells = [f"{d[c].estimate:+.2f} [{d[c].low:+.2f}, {d[c].high:+.2f}]" if math.isfinite(d[c].low)
                     else f"{d[c].estimate:+.2f} [-]" for c in cols]
            lines.append(f"| {d['method']} | {d['vs']} | " + " | ".join(cells) + " |")
    fewest = min(len(rs) for rs in results["runs"][AR].values())
    if 2 <= fewest < FEW_PROMPTS:
        lines += ["", f"With {fewest} prompts in a benchmark, resampling them gives few distinct draws: these "
                  "intervals are narrower than the noise they stand for; more prompts per benchmark make them honest."]
    lines += ["", *("- " + speedup_words(DISPLAY.get(n, n), row["average"]) for n, row in intervals["speedup"].items()
                    if n != HF)]
    for d in diffs:
        lines.append("- " + _difference_words("Speedup (average over benchmarks)", d["method"], d["vs"], d["average"]))
        iv = d["average"]
        if math.isfinite(iv.low) and not iv.contains_zero and d["vs"] not in (AR, HF) \
                and paired_tau(results, d["method"], d["vs"]).contains_zero:
            lines[-1] += (" But their τ did not move (its interval contains 0): a speedup difference without one in "
                          "τ comes from the drafts' cost per round or from the machine, not from their acceptance.")
    return lines


def recheck_lines(results: dict, intervals: dict) -> list[str]:
    """Markdown: for each method whose k was chosen, its speedup at that k against the same draft at k = 1 in
    this run's own interleaved timing, and whether the choice held."""
    ks, rechecks = results["config"]["k"], results["config"].get("recheck", {})
    chosen = [n for n in results.get("calibration", {}) if "chosen_on" not in results["calibration"][n]]
    lines = ["The chosen k, re-checked against k = 1 on this run's own interleaved timing (the same draft decoded "
             "at k = 1 beside it on every prompt):", ""]
    for name in chosen:
        timed = results["calibration"][name].get("cost", [None] * (ks[name] + 1))[ks[name]]
        decoded = _round_cost(results, name) if timed is not None else None
        if timed is not None and abs(timed - decoded) > COST_DRIFT * decoded:
            lines.append(f"- {name}: calibration timed a round at k = {ks[name]} at {timed:.2f} AR steps, the decode "
                         f"at {decoded:.2f}: the machine's load changed between them, and the k chosen (and its "
                         "expected speedup) rests on the calibration's timing.")
        if name not in rechecks:
            lines.append(f"- {name}: k = {ks[name]} was chosen; nothing to re-check.")
            continue
        d = intervals["difference"][f"{name} vs {rechecks[name]}"]["average"]
        at = intervals["speedup"]
        held = not (math.isfinite(d.high) and d.high < 0)
        lines.append(f"- {name}: k = {ks[name]} gave {_interval_cell(at[name]['average'])}, k = 1 gave "
                     f"{_interval_cell(at[rechecks[name]]['average'])}; k = {ks[name]} - k = 1: "
                     f"{d.estimate:+.2f}" + (f" [{d.low:+.2f}, {d.high:+.2f}]" if math.isfinite(d.low) else "")
                     + (": the choice held (k = 1 was not faster beyond the noise)." if held else
                        ": **the choice did not hold**: k = 1 was faster on this run, so the calibration's timing "
                        "misjudged the cost of a longer draft (a busy machine, or too few calibration rounds)."))
    return lines


# calibration's round cost and the decode's may differ this much (a share of the decode's) on one machine state:
# the calibration times one prompt's context, the decode every benchmark prompt's (well inside this share in the
# demo's runs: docs/LOG.md, "Figures moved out of code comments")
COST_DRIFT = 0.25


def _pooled_rounds(summary: dict, benches: Sequence[str], name: str) -> tuple[float, float, int]:
    """``name``'s (draft seconds, verify seconds, rounds), pooled over ``benches``."""
    rows = [summary[name][b] for b in benches]
    return sum(r["draft_s"] for r in rows), sum(r["verify_s"] for r in rows), sum(r["rounds"] for r in rows)


def _round_cost(results: dict, name: str) -> float:
    """``name``'s decode time per round (draft + verify) in AR steps, pooled over benchmarks."""
    d, v, n = _pooled_rounds(results["summary"], results["benchmarks"], name)
    d_ar, v_ar, n_ar = _pooled_rounds(results["summary"], results["benchmarks"], AR)
    return ((d + v) / n) / ((d_ar + v_ar) / n_ar)


def round_cost_table(summary: dict, benches: Sequence[str], methods: Sequence[str]) -> list[str]:
    """Where a round's time goes, pooled over benchmarks, in units of one AR step (a round that
    drafts nothing): ``speedup / tau ~= 1 / (draft + verify)``, so this shows what keeps a method
    from its tau."""
    d, v, n = _pooled_rounds(summary, benches, AR)
    ar_step = (d + v) / n
    lines = [f"Per round, in AR steps (one AR step = {ar_step * 1e3:.1f} ms):", "",
             "| Method | rounds | draft | verify | speedup / τ |", "|---|---:|---:|---:|---:|"]
    cheap = []
    for m in methods:
        d, v, n = _pooled_rounds(summary, benches, m)
        avg = summary[m]["average"]
        lines.append(f"| {m} | {n} | {d / n / ar_step:.2f} | {v / n / ar_step:.2f} | "
                     f"{avg['speedup'] / avg['tau']:.2f} |")
        if v / n / ar_step < VERIFY_FLOOR:
            cheap.append(m)
    if cheap:
        lines += ["", f"**The AR baseline ran slow in this run**: {', '.join(cheap)} verified k + 1 tokens in less "
                  f"than {VERIFY_FLOOR:.2f} of the 1-token AR step, which no pass over more tokens can do on a quiet "
                  "machine. A burst of load hit the AR runs, or the target's few-row kernel was chosen under "
                  "load (`vatspec.eval.kernels`): the speedups of this run are overstated; measure again on a "
                  "quiet machine."]
    return lines


# a verify pass over k + 1 >= 2 tokens (with the feature capture) costs at least the 1-token AR step; below this
# share of it, the AR step was measured slow (5% below: beyond the run-to-run spread of a quiet machine's passes)
VERIFY_FLOOR = 0.95


def _legend_below(ax, n: int) -> None:
    """The legend under the axes, 4 entries a row: any number of methods fits without covering bars."""
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=min(n, 4), frameon=False)


def plot(results: dict, out_dir: str | Path) -> list[Path]:
    """tau.png (tau per benchmark for each method) and acceptance.png (acceptance-length histogram)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    summary, cols = results["summary"], [*results["benchmarks"], "average"]
    methods = [n for n in summary if n not in (AR, HF)] or [AR]
    width = 0.8 / len(methods)
    paths = []

    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(cols), 3.6))
    for j, m in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(cols))]
        ax.bar(xs, [summary[m][c]["tau"] for c in cols], width, label=m)
    ax.set_xticks(range(len(cols)), cols)
    ax.set_ylabel("τ (tokens per verify pass)")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    _legend_below(ax, len(methods))
    ax.set_title(f"Acceptance length τ, temperature {results['config']['temperature']:g}")
    paths.append(out_dir / "tau.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for j, m in enumerate(methods):
        h = summary[m]["average"]["histogram"]
        total = sum(h) or 1
        ns = range(1, len(h))
        ax.bar([n + (j - (len(methods) - 1) / 2) * width for n in ns], [h[n] / total for n in ns], width, label=m)
    ax.set_xlabel("tokens committed per round (accepted + 1)")
    ax.set_ylabel("fraction of rounds")
    _legend_below(ax, len(methods))
    ax.set_title("Acceptance-length histogram (all benchmarks)")
    paths.append(out_dir / "acceptance.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return paths


def _intervals_dict(intervals: dict) -> dict:
    return {"speedup": {n: {c: iv.to_dict() for c, iv in row.items()} for n, row in intervals["speedup"].items()},
            "difference": {key: {c: (v if c in ("method", "vs") else v.to_dict()) for c, v in d.items()}
                           for key, d in intervals["difference"].items()}}


def write_report(
    results: dict, out_dir: str | Path, relative_to: str | Mapping[str, str] | None = None, plots: bool = True
) -> dict:
    """Write results.json, results.md and the plots; return {kind: path}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "results.md"}
    if relative_to:
        results = {**results, "paired_tau": {m: {"vs": b, **paired_tau(results, m, b).to_dict()}
                                             for m, b in _pairs(results, relative_to).items()}}
    pairs = _pairs(results, relative_to)
    results = {**results, "speedup_intervals": _intervals_dict(speedup_intervals(results, pairs))}
    paths["json"].write_text(json.dumps(results, indent=1))
    paths["markdown"].write_text(check_finite(markdown_table(results, relative_to), str(paths["markdown"])))
    if plots:
        paths["tau_plot"], paths["hist_plot"] = plot(results, out_dir)
    return paths
