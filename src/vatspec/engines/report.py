"""The serving benchmark's report: ``serve-bench.json`` (everything measured), ``serve-bench.md`` (the tables
and the verdicts in words) and two plots: ``throughput.png`` (output tokens/s against concurrency, one line per
draft and the no-speculation line) and ``acceptance.png`` (the engine's per-position acceptance)."""

from __future__ import annotations

from pathlib import Path

from vatspec.engines.bench import NONE
from vatspec.outputs import strict_json


def _ms(x) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def _num(x, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(report: dict) -> str:
    eng, cfg = report["engine"], report["config"]
    lines = [f"# Serving benchmark: {eng['name']} {eng.get('version') or '(version unknown)'}", "",
             f"Target `{cfg['target']}`; {cfg['prompts']} prompts ({', '.join(cfg['benchmarks'])}), at most "
             f"{cfg['max_tokens']} output tokens each, {cfg['repeats']} repeats interleaved; machine: "
             f"{report['machine']}.", ""]
    if not report.get("complete", False):
        why = report.get("stopped", "the run has not finished; this report is rewritten after every cell")
        lines += [f"**Incomplete run:** {why}.", ""]
    for name, arm in report["arms"].items():
        what = "the target alone" if arm.get("draft") is None else f"`{arm['draft']}` ({arm['method']}, k = {arm['k']})"
        lines.append(f"- **{name}**: {what}" + (f"; launched as `{arm['launch']}`" if arm.get("launch") else
                                                 f"; the server at {arm.get('url')}"))
    summary = report["summary"]
    for temp in cfg["temperatures"]:
        t = str(temp)
        lines += ["", f"## Temperature {temp:g}", "",
                  "| arm | concurrency | output tok/s | req/s | TTFT ms median / p90 | TPOT ms median / p90 | "
                  "latency ms median / p90 | mean acceptance length | failed requests |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for arm in report["arms"]:
            for c in cfg["concurrencies"]:
                s = summary.get(arm, {}).get(t, {}).get(str(c))
                if s is None:
                    lines.append(f"| {arm} | {c} | not measured | | | | | | |")
                    continue
                acc = s["acceptance"]
                lines.append(
                    f"| {arm} | {c} | {_num(s['output_tokens_per_s'])} | {_num(s['requests_per_s'], '.2f')} | "
                    f"{_ms(s['ttft_s']['median'])} / {_ms(s['ttft_s']['p90'])} | {_ms(s['tpot_s']['median'])} / "
                    f"{_ms(s['tpot_s']['p90'])} | {_ms(s['latency_s']['median'])} / {_ms(s['latency_s']['p90'])} | "
                    f"{_num(acc and acc['mean_acceptance_length'], '.3f')} | {s['failed_requests']} |")
        rows = [r for r in report["ratios"] if r["temperature"] == temp]
        if rows:
            lines += ["", "Throughput ratios (95% bootstrap interval over paired requests):", ""]
            lines += [f"- {r['words']}" for r in rows]
    if report.get("vatspec_acceptance"):
        lines += ["", "## The engine's acceptance beside vatspec's decoding of the same prompts", "",
                  "| draft | prompts | engine: accepted a round | vatspec: accepted a round | engine - vatspec, 95% |",
                  "|---|---:|---:|---:|---|"]
        for name, v in report["vatspec_acceptance"].items():
            d = v.get("difference")
            lines.append(f"| {name} | {v['prompts']} | {_num(v['engine'], '.3f')} | {_num(v['vatspec'], '.3f')} | "
                         + ("-" if d is None else f"{d['estimate']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]") + " |")
        lines += ["", "A gap whose interval excludes 0 says the served setting differs from the measured one "
                  "(template, dtype, k, the engine's sampling); at T > 0 both sides sample, so only the means agree."]
    failed = [c for c in report["cells"] if "failed" in c]
    if failed:
        lines += ["", "## Failures", ""]
        lines += [f"- {c['arm']}" + (f" T={c['temperature']:g} c={c['concurrency']}" if "concurrency" in c else "")
                  + f", repeat {c['repeat']}: " + c["failed"].splitlines()[0] for c in failed]
    lines += ["", "## Launch commands", "", "```bash"]
    lines += [f"# {name}\n{arm['launch']}" for name, arm in report["arms"].items() if arm.get("launch")]
    lines += ["```", ""]
    return "\n".join(lines)


def plot(report: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, summary, paths = report["config"], report["summary"], []
    temps = cfg["temperatures"]
    fig, axes = plt.subplots(1, len(temps), figsize=(5.2 * len(temps), 3.8), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        for arm in report["arms"]:
            pts = [(c, summary.get(arm, {}).get(str(temp), {}).get(str(c), {}).get("output_tokens_per_s"))
                   for c in cfg["concurrencies"]]
            pts = [(c, y) for c, y in pts if y is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=arm, **({"color": "black", "ls": "--"} if arm == NONE else {}))
        ax.set_xscale("log", base=2)
        ax.set_xticks(cfg["concurrencies"], [str(c) for c in cfg["concurrencies"]])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel("output tokens / s")
        ax.set_title(f"{report['engine']['name']}, T = {temp:g}")
        ax.legend(fontsize="small")
    paths.append(out_dir / "throughput.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    t0, drawn = str(temps[0]), 0
    for arm in report["arms"]:
        if arm == NONE:
            continue
        cells = summary.get(arm, {}).get(t0, {})
        acc = next((cells[str(c)]["acceptance"] for c in cfg["concurrencies"]
                    if cells.get(str(c), {}).get("acceptance")), None)
        if acc and acc["per_position_rate"]:
            ax.plot(range(1, len(acc["per_position_rate"]) + 1), acc["per_position_rate"], marker="o", label=arm)
            drawn += 1
    most = max((len(summary[a][t0][c]["acceptance"]["per_position_rate"]) for a in summary if a != NONE
                for c in summary[a].get(t0, {}) if summary[a][t0][c].get("acceptance")), default=0)
    ax.set_xticks(range(1, most + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of rounds accepted there")
    ax.set_title(f"The engine's acceptance per position, T = {temps[0]:g}")
    if drawn:
        ax.legend(fontsize="small")
    paths.append(out_dir / "acceptance.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return paths


def write(report: dict, out_dir: Path, plots: bool = True) -> dict[str, Path]:
    """The JSON always (strict: no NaN), the markdown and plots."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "serve-bench.json", "markdown": out_dir / "serve-bench.md"}
    tmp = paths["json"].with_suffix(".json.tmp")
    tmp.write_text(strict_json(report, indent=1))
    tmp.replace(paths["json"])
    paths["markdown"].write_text(markdown(report))
    if plots:
        paths["throughput_plot"], paths["acceptance_plot"] = plot(report, out_dir)
    return paths
