"""Draft objectives side by side on identical batches (``vatspec ablate --arms``).

Every arm is one ``loss.kind`` (``losses.KINDS``: vat, eagle3, dflash, kl, tv, lk, dpace, specauf,
dspark) on one drafter; all arms train in lockstep (``train.train_arms``: the same batches, steps,
seed and initialisation) from the demo's training set and feature cache, then decode the held-out
bundled benchmarks the way the demo does (temperature 0, one k for every arm, chosen on held-out
training prompts from the baseline arm). Each arm is reported against the drafter's own baseline kind
(``losses.BASELINE``: eagle3 for EAGLE-3, dflash for DFlash), which is always trained:

    held-out tau_sim, and the accepted length per held-out chain minus the baseline's, 95% paired
    bootstrap over chains; decode tau, and the per-prompt tau minus the baseline's, 95% paired
    bootstrap over prompts (``stats.paired_difference``); a plot of held-out tau_sim over steps.

Worked example of one row: arms eagle3 and lk, 3 held-out chains accepting (1, 0, 2) and (1, 1, 2)
drafts -> lk - eagle3 = +0.333 accepted per chain; the interval comes from resampling the 3 chains.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from vatspec.demo import (
    ARMS,
    DemoSize,
    _fmt,
    _prepare_out,
    arm_configs,
    log,
    prepare_features,
    prepare_training_data,
    read_curves,
)
from vatspec.losses import BASELINE, KINDS

OUTPUTS = ("objectives.md", "objectives.json", "objectives_tau_sim.png")  # beside the demo's runs/ and eval/


def parse_arms(text: str) -> list[str]:
    """``"vat,kl,tv"`` -> ``["vat", "kl", "tv"]``: loss kinds, each once. A name that is not a kind is a
    ValueError naming it and the choices."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"no arm named; choose from {', '.join(KINDS)}")
    for n in names:
        if n not in KINDS:
            raise ValueError(f"unknown arm {n!r}; choose from {', '.join(KINDS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"an arm is named twice in {text!r}")
    return names


def with_baseline(arms: list[str], drafter: str) -> list[str]:
    """The arms with the drafter's baseline kind first (added when missing): the differences are from it.
    eagle3 drafter, [vat, kl] -> [eagle3, vat, kl]."""
    base = BASELINE[drafter]
    return [base, *(a for a in arms if a != base)]


def objective_configs(arms: list[str], drafter: str, size: DemoSize, data_path: Path, runs: Path,
                      features: Path | None = None):
    """One run config per arm (``demo.arm_configs``): the same data, steps and seed, ``loss.kind=ARM`` on
    ``drafter``; a kind the drafter cannot train is a one-line ConfigError here."""
    overrides = {a: [f"drafter.kind={drafter}", f"loss.kind={a}"] for a in arms}
    return arm_configs(arms, size, data_path, runs, loss_overrides=overrides, features=features)


def run_objectives(out: Path, size: DemoSize, drafter: str, arms: list[str], *, threads: int | None = None,
                   progress: bool = True) -> dict:
    """Train ``arms`` (loss kinds) in lockstep on ``drafter``, decode each, and write ``objectives.md``,
    ``objectives.json``, ``objectives_tau_sim.png`` and ``eval/`` in ``out``; return the summary."""
    from vatspec.target import open_target, vatspec_home
    from vatspec.train import train_arms

    t_start = time.perf_counter()
    arms = with_baseline(arms, drafter)
    objective_configs(arms, drafter, size, Path("data.jsonl"), out / "runs")  # a bad pair fails before any work
    _prepare_out(out)
    for name in OUTPUTS:
        (out / name).unlink(missing_ok=True)
    if threads:
        torch.set_num_threads(threads)
    target = open_target("default", device="cpu", dtype="float32")
    log.info(f"1/3 training {len(arms)} {drafter} arms in lockstep for {size.steps_of(drafter)} steps of "
             f"{size.batch_of(drafter)}: {', '.join(arms)}")
    data_path, _ = prepare_training_data(target, size, vatspec_home(), progress)
    # the demo's cache (both drafters' layers), so the demo and every ablation share one
    features, _ = prepare_features(target, data_path, arm_configs(list(ARMS), size, data_path, out / "runs"),
                                   progress)
    cfgs = objective_configs(arms, drafter, size, data_path, out / "runs", features)
    finals = dict(zip(arms, train_arms(cfgs, progress=progress)))
    t_train = time.perf_counter() - t_start

    log.info(f"2/3 decoding every arm on {', '.join(size.benches)} ({size.eval_prompts} prompts each, T=0)")
    results = decode_arms(target, dict(zip(arms, cfgs)), size, progress)
    log.info("3/3 writing the report")
    from vatspec import bench

    bench.write_report(results, out / "eval", relative_to={a: arms[0] for a in arms[1:]})
    curves = {a: read_curves(Path(c.train.out_dir)) for a, c in zip(arms, cfgs)}
    plot_tau_sim(curves, out / "objectives_tau_sim.png")
    summary = summarize(arms, finals, results)
    summary.update(drafter=drafter, size=dataclasses.asdict(size), threads=torch.get_num_threads(),
                   timings_s={"train": t_train, "total": time.perf_counter() - t_start},
                   curves={a: [(r["step"], r["eval/tau_sim"]) for r in rs if "eval/tau_sim" in r]
                           for a, rs in curves.items()})
    (out / "objectives.json").write_text(json.dumps(summary, indent=1, default=float))
    (out / "objectives.md").write_text(report_md(summary, size))
    log.info(f"done in {summary['timings_s']['total'] / 60:.1f} min: {out / 'objectives.md'}")
    return summary


def decode_arms(target, cfgs: dict, size: DemoSize, progress: bool) -> dict:
    """Every arm decodes the held-out benchmarks at T = 0 (``bench.evaluate``, interleaved with the AR
    baseline), all at the k that the baseline arm (the first) calibrates on held-out training prompts."""
    from vatspec import bench
    from vatspec.benchmarks import load_benchmark
    from vatspec.drafts import open_draft

    methods = {a: open_draft(c.train.out_dir, target) for a, c in cfgs.items()}
    base, cfg = next(iter(cfgs.items()))
    cal = calibrate_k(target, methods[base][0], cfg, size)
    prompts = {b: load_benchmark(b)[: size.eval_prompts] for b in size.benches}
    results = bench.evaluate(target, methods, prompts, temperature=0.0, max_new_tokens=size.eval_tokens, warmup=1,
                             seed=size.seed, progress=progress, hf_baseline=False,
                             k={a: cal["k"] for a in methods} if cal else None)
    if cal:
        results["calibration"] = {base: cal, **{a: {**cal, "chosen_on": base} for a in list(methods)[1:]}}
    return results


def calibrate_k(target, drafter, cfg, size: DemoSize) -> dict | None:
    """k for every arm, from ``drafter``'s acceptance and the measured round cost on held-out training
    prompts (the held-out split of training, never the benchmarks); None with no calibration prompts."""
    if not size.calibration_prompts:
        return None
    from vatspec import bench
    from vatspec import data as D
    from vatspec.calibrate import calibrate
    from vatspec.train import heldout_split

    _, held = heldout_split(D.load_conversations(cfg.data.train), cfg.data, cfg.train.seed)
    ids = [bench.prompt_ids(target.tokenizer, c) for c in held[: size.calibration_prompts]]
    cal = calibrate(target, drafter, ids, max_new_tokens=size.eval_tokens).to_dict()
    log.info(f"    k = {cal['k']} for every arm (expected speedup {cal['speedup'][cal['k']]:.2f} on held-out prompts)")
    return cal


def summarize(arms: list[str], finals: dict, results: dict) -> dict:
    """Per arm: held-out tau_sim and decode tau, and (every arm but the baseline, the first) the paired
    differences from the baseline: accepted drafts per held-out chain, tau per prompt."""
    from vatspec.bench import paired_tau
    from vatspec.stats import paired_difference
    from vatspec.train import CHAINS_KEY

    base = arms[0]
    chains = {a: finals[a].pop(CHAINS_KEY, None) for a in arms}  # each run keeps them in heldout_chains.json
    rows = {}
    for a in arms:
        row = {"tau_sim": finals[a].get("tau_sim"), "decode_tau": results["summary"][a]["average"]["tau"],
               "speedup": results["summary"][a]["average"]["speedup"], "heldout": finals[a]}
        if a != base and chains[a] and chains[base]:
            row["vs_baseline_chains"] = paired_difference(chains[a], chains[base]).to_dict()
            row["vs_baseline_prompts"] = paired_tau(results, a, base).to_dict()
        rows[a] = row
    return {"baseline": base, "arms": rows, "k": results["config"]["k"], "benchmarks": results["benchmarks"]}


def objectives_table(summary: dict) -> str:
    """Markdown: per arm its held-out tau_sim and decode tau, each with its difference from the baseline
    and the 95% paired interval."""
    def cell(d: dict | None) -> str:
        return f"{d['estimate']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]" if d else "baseline"

    lines = ["| Arm | held-out τ_sim | Δ accepted per chain [95% CI] | decode τ | Δ τ per prompt [95% CI] | speedup |",
             "|---|---:|---:|---:|---:|---:|"]
    for a, r in summary["arms"].items():
        dc, dp = r.get("vs_baseline_chains"), r.get("vs_baseline_prompts")
        lines.append(f"| {a} | {_fmt(r['tau_sim'], 3)} | {cell(dc)} | {_fmt(r['decode_tau'], 3)} | {cell(dp)} | "
                     f"{_fmt(r['speedup'], 2)}× |")
    return "\n".join(lines) + "\n"


def verdicts(summary: dict) -> list[str]:
    """Each arm's two comparisons in words (``stats.Difference.sentence``: says when an interval contains 0)."""
    from vatspec.stats import Difference

    def diff(d: dict) -> Difference:
        return Difference(**{f: d[f] for f in ("estimate", "low", "high", "level", "units", "base")})

    base, out = summary["baseline"], []
    for a, r in summary["arms"].items():
        if a == base:
            continue
        out.append("- " + diff(r["vs_baseline_chains"]).sentence("Held-out accepted drafts per chain", a, base,
                                                                 "chains"))
        out.append("- " + diff(r["vs_baseline_prompts"]).sentence("Decode τ per prompt", a, base, "prompts"))
    return out


def report_md(summary: dict, size: DemoSize) -> str:
    t = summary["timings_s"]
    return "\n".join([
        f"# Draft objectives side by side on {summary['drafter']} (SmolLM2-135M-Instruct)",
        "",
        f"Every arm trained in lockstep on the same batches and initialisation: {size.prompts} regenerated "
        f"conversations, {size.steps_of(summary['drafter'])} steps of {size.batch_of(summary['drafter'])} sequences, "
        f"seed {size.seed}; held-out split of "
        f"the training set for τ_sim; {size.eval_prompts} prompt(s) of each of {', '.join(size.benches)} decoded at "
        f"temperature 0 with k = {next(iter(summary['k'].values()))} for every arm. Differences are from "
        f"{summary['baseline']}, with 95% paired-bootstrap intervals. Small-scale CPU run: "
        f"{t['total'] / 60:.1f} min on {summary['threads']} thread(s).",
        "",
        objectives_table(summary),
        *verdicts(summary),
        "",
        "![held-out τ_sim over training](objectives_tau_sim.png)",
        "",
        "`eval/results.md` has the per-benchmark decode tables; `runs/` each arm's run folder and metrics.",
    ]) + "\n"


def plot_tau_sim(curves: dict[str, list[dict]], out: Path) -> Path:
    """Held-out tau_sim over training steps, one line per arm (the baseline black, dashed and on top: an
    arm that trains as it does, kl on EAGLE-3, lies under it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, recs) in enumerate(curves.items()):
        ev = [r for r in recs if "eval/tau_sim" in r]
        style = {"color": "black", "ls": "--", "zorder": 3} if i == 0 else {"ls": "-"}
        ax.plot([r["step"] for r in ev], [r["eval/tau_sim"] for r in ev], marker="o", label=name, **style)
    ax.set_title("held-out τ_sim (simulated acceptance length) per objective")
    ax.set_xlabel("optimizer step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
