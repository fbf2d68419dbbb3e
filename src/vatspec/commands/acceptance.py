"""``vatspec acceptance``: teacher-forced acceptance of trained drafts on the target's own greedy answers to
benchmark prompts, the decode tau of temperature 0 without the decode loop's few prompts.

At T = 0 the decode loop commits exactly the target's greedy text, so whether a draft is accepted at a
position is fixed by that text. Teacher-forced on it, training's simulated verification gives the acceptance
decoding would see, at every position of every prompt instead of the rounds of the few prompts a timed
decode can afford. What this cannot give is wall-clock speed (``vatspec eval`` measures that).

    vatspec acceptance --answers runs/bench-2-26.jsonl --prompts 2:26 \\
        --pair EAGLE3_VAT=EAGLE3 EAGLE3=reports/demo/runs/eagle3 EAGLE3_VAT=reports/demo/runs/eagle3_vat

``--answers``: the target's greedy answers (128 new tokens at most) to prompts ``--prompts LO:HI`` of every
bundled benchmark, written there by ``vatspec.data.regenerate`` when the file does not exist (they are
evaluation prompts: never train on this file). Each ``NAME=RUN`` is a run folder or one of its checkpoint
folders, read with its own saved config (max length, anchors, precision). Prints tau_sim (1 + accepted drafts
per chain) overall and per benchmark, the per-position accuracy, and for each ``--pair A=B`` the difference
A - B with a 95% paired bootstrap interval over prompts (each prompt's chains pooled).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vatspec.checkpoint import CheckpointError
from vatspec.commands import add_device_args, check_report_out, report
from vatspec.config import ConfigError
from vatspec.data import DataError
from vatspec.outputs import OutputError, check_apart, check_file
from vatspec.target import TargetError
from vatspec.train import TrainError

REGEN_BATCH, ANSWER_TOKENS = 16, 128  # the answers: 16 prompts a batch, 128 new tokens at most


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="NAME=RUN",
                        help="a draft to score: a run folder or one of its checkpoint folders (repeatable)")
    parser.add_argument("--answers", required=True, metavar="FILE",
                        help="the target's greedy answers to the benchmark prompts (JSONL conversations); "
                        "regenerated into FILE when it does not exist")
    parser.add_argument("--prompts", type=_span_arg, default="2:26", metavar="LO:HI",
                        help="prompts LO..HI-1 of each bundled benchmark, when --answers is regenerated")
    parser.add_argument("--pair", action="append", default=[], metavar="A=B",
                        help="print A - B with a 95%% paired interval over prompts (repeatable)")
    parser.add_argument("--target", default="default",
                        help="the target the drafts were trained for: a local HF folder, or 'default' (SmolLM2)")
    parser.add_argument("--json", metavar="FILE", help="also write each draft's figures here")
    add_device_args(parser)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (CheckpointError, ConfigError, DataError, OutputError, TargetError, TrainError, ValueError) as e:
        return report("acceptance", e)


def _run(args: argparse.Namespace) -> int:
    from vatspec.target import open_target

    runs = _parse_runs(args.runs)
    pairs = [_parse_pair(p, runs) for p in args.pair]
    answers = Path(args.answers)
    if not answers.exists():  # regenerated: an output, kept apart from the drafts it scores
        check_file(answers, "--answers")
        check_apart(answers, {f"{n}={r}": r for n, r in runs.items()}, "--answers")
    elif not answers.is_file():
        raise ValueError(f"--answers {answers} is a folder; expected a JSONL file of conversations")
    if args.json:
        check_report_out(Path(args.json), {"--answers": answers, **{f"{n}={r}": r for n, r in runs.items()}},
                         _ours, "acceptance report")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = open_target(args.target, device=args.device, dtype=args.dtype)
    convs = _answers(target, answers, *args.prompts)
    res = {name: per_prompt(run, target, convs, where=f"{name}={run}") for name, run in runs.items()}
    benches = sorted({bench_of(i) for i in next(iter(res.values()))["ids"]})
    print(f"teacher-forced acceptance on the target's greedy answers to {len(convs)} benchmark prompts "
          f"({answers})")
    print(f"{'draft':<14} {'tau_sim':>8} " + " ".join(f"{b:>10}" for b in benches) + "  per-position acc")
    for name, r in res.items():
        per = [tau(r, lambda i, b=b: bench_of(i) == b) for b in benches]
        print(f"{name:<14} {tau(r):8.3f} " + " ".join(f"{t:10.3f}" for t in per) + "  "
              + " ".join(f"{a:.3f}" for a in r["acc"]))
    from vatspec.eval.stats import paired_difference

    for a, b in pairs:
        d = paired_difference(res[a]["accepted"], res[b]["accepted"], res[a]["chains"], res[b]["chains"])
        print(d.sentence("tau_sim on benchmark answers", a, b, "prompts"))
    if args.json:
        out = {n: {**r, "tau_sim": tau(r)} for n, r in res.items()}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def _answers(target, path: Path, lo: int, hi: int) -> list:
    """The target's greedy answers to prompts ``lo:hi`` of every benchmark (regenerated once into ``path``)."""
    from vatspec import data as D
    from vatspec.benchmarks import list_benchmarks, load_benchmark

    if not path.exists():
        convs = [c for b in list_benchmarks() for c in load_benchmark(b)[lo:hi]]
        D.regenerate(convs, target, path, batch_size=REGEN_BATCH, max_new_tokens=ANSWER_TOKENS)
    return D.load_conversations(path)


def per_prompt(run: str | Path, target, convs, where: str | None = None) -> dict:
    """One draft's chains on each prompt: ``{"accepted": [sum per prompt], "chains": [...], "ids": [...],
    "acc": [per-position accuracy]}``. ``where`` names the draft in errors."""
    from vatspec import data as D
    from vatspec.config import load_config
    from vatspec.drafters import drafter_class
    from vatspec.objective.metrics import MetricAccumulator
    from vatspec.train import CHAINS_KEY, arms_micro_step, build_arm, pad_id, step_generator, tokenize_items

    where = where or str(run)
    saved_path = Path(run) / "config.yaml"  # a run folder and each of its checkpoints hold one
    if not saved_path.is_file():
        raise ValueError(f"{where}: {saved_path} does not exist (not a run folder or one of its checkpoint folders)")
    saved = load_config(saved_path)
    # the drafter's own CE: no accept head to build, the same chains and verification
    baseline = drafter_class(saved.drafter.kind).baseline_loss
    cfg = load_config(None, [f"drafter.kind={saved.drafter.kind}", f"loss.kind={baseline}",
                             f"drafter.num_anchors={saved.drafter.num_anchors}",
                             f"drafter.block_size={saved.drafter.block_size}",
                             f"drafter.ttt_steps={saved.drafter.ttt_steps}",
                             f"drafter.draft_vocab_size={saved.drafter.draft_vocab_size}",
                             f"train.precision={saved.train.precision}", f"train.seed={saved.train.seed}"])
    device = target.device
    arm = build_arm(cfg, target, None, 1, device=device, init_from=str(run))
    arm.model.eval()
    examples = tokenize_items(convs, target.tokenizer, saved.data.max_length, "--answers")
    out = {"accepted": [], "chains": [], "ids": [e.id for e in examples]}
    acc = MetricAccumulator()
    with torch.no_grad():
        for i, ex in enumerate(examples):
            batch = D.collate([ex], pad_id(target)).to(device)
            res = next(arms_micro_step([arm], target, batch, [step_generator(cfg.train.seed, -1, i, 0, device)]))
            chains = res.metrics.chain_accepted
            out["accepted"].append(float(chains.sum()))
            out["chains"].append(chains.numel())
            acc.add(res.metrics)
    summary = acc.summary()
    summary.pop(CHAINS_KEY, None)
    out["acc"] = summary["acc"]
    return out


def tau(r: dict, keep=lambda i: True) -> float:
    """tau_sim of ``per_prompt``'s figures: 1 + accepted drafts per chain, over the prompts ``keep`` keeps."""
    num = sum(a for i, a in zip(r["ids"], r["accepted"]) if keep(i))
    den = sum(c for i, c in zip(r["ids"], r["chains"]) if keep(i))
    return 1.0 + num / max(den, 1)


def bench_of(conv_id: str) -> str:
    """The benchmark a conversation id belongs to: "HumanEval/3" -> "humaneval", "gsm8k/12" -> "gsm8k"."""
    return conv_id.split("/")[0].lower()


def _span_arg(value: str) -> tuple[int, int]:
    """argparse ``type=`` for ``--prompts LO:HI``: 0 <= LO < HI."""
    lo, sep, hi = value.partition(":")
    try:
        span = int(lo), int(hi)
    except ValueError:
        span = None
    if not sep or span is None or not 0 <= span[0] < span[1]:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 0 <= LO < HI, got {value!r}")
    return span


def _parse_runs(specs: list[str]) -> dict[str, str]:
    runs: dict[str, str] = {}
    for spec in specs:
        name, sep, run = spec.partition("=")
        if not sep or not name or not run:
            raise ValueError(f"{spec!r}: expected NAME=RUN (a run folder or one of its checkpoint folders)")
        if name in runs:
            raise ValueError(f"{spec!r}: the name {name!r} is given twice")
        if not Path(run).is_dir():
            raise ValueError(f"{spec}: {run} is not a folder (a run folder or one of its checkpoint folders)")
        if not (Path(run) / "config.yaml").is_file():
            raise ValueError(f"{spec}: {Path(run) / 'config.yaml'} does not exist (not a run folder or one of its "
                             "checkpoint folders)")
        runs[name] = run
    return runs


def _parse_pair(spec: str, runs: dict[str, str]) -> tuple[str, str]:
    a, sep, b = spec.partition("=")
    if not sep or not a or not b:
        raise ValueError(f"--pair {spec!r}: expected A=B, two draft names")
    for name in (a, b):
        if name not in runs:
            raise ValueError(f"--pair {spec}: no draft named {name!r} (have {', '.join(runs)})")
    return a, b


def _ours(old) -> bool:
    """An earlier acceptance report: each draft's figures."""
    return isinstance(old, dict) and bool(old) and all(
        isinstance(v, dict) and {"accepted", "chains", "tau_sim"} <= set(v) for v in old.values())
