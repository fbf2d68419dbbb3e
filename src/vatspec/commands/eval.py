"""``vatspec eval``: speculative decoding of each draft against the AR baseline on benchmarks
(``vatspec.eval.bench`` measures, ``vatspec.eval.report`` writes the report).

    vatspec eval --draft base=runs/e3 --draft vat=runs/e3_vat --bench gsm8k --relative-to vat=base
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from vatspec import benchmarks, data
from vatspec.checkpoint import CheckpointError
from vatspec.commands import (
    add_device_args,
    add_report_to_arg,
    add_template_args,
    float_arg,
    int_arg,
    report,
    use_template,
)
from vatspec.data import DataError
from vatspec.data.chat import check_settings, pin_date
from vatspec.drafts import open_draft
from vatspec.eval.bench import AR, HF, evaluate, prompt_ids
from vatspec.eval.calibrate import calibrate
from vatspec.eval.report import write_report
from vatspec.export.record import recorded_template
from vatspec.outputs import OutputError, check_apart, check_folder, claim_folder
from vatspec.target import TargetError, open_target
from vatspec.target.architecture import describe


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="a local HF folder, or 'default' (the embedded SmolLM2)")
    add_template_args(parser)
    parser.add_argument("--draft", action="append", default=[], metavar="[NAME=]PATH",
                        help="a checkpoint, run folder or exported draft; repeat for several methods")
    parser.add_argument("--bench", action="append", default=[], metavar="NAME",
                        help="a bundled benchmark (repeatable; default: all, unless --prompts is given)")
    parser.add_argument("--prompts", action="append", default=[], metavar="FILE",
                        help="your own prompts (JSONL conversations); the file stem names the benchmark")
    parser.add_argument("--num-prompts", type=int_arg(1), default=None, help="first N prompts of each benchmark")
    parser.add_argument("--temperature", type=float_arg(0.0), default=0.0)
    parser.add_argument("--top-k", type=int_arg(0), default=0)
    parser.add_argument("--top-p", type=float_arg(0.0, 1.0, above=True), default=1.0)
    parser.add_argument("--draft-argmax", action="store_true", help="draft by argmax at T > 0 (as vLLM)")
    parser.add_argument("--k", type=_k_arg, default=None,
                        help="drafted tokens per round (default: the drafter's), or 'auto': each method's k chosen "
                             "from its acceptance and the measured round cost on --calibration prompts")
    parser.add_argument("--calibration", metavar="FILE", default=None,
                        help="with --k auto: held-out prompts (JSONL conversations, never the evaluation set)")
    parser.add_argument("--calibration-prompts", type=int_arg(1), default=4, help="with --k auto: how many of them")
    parser.add_argument("--max-new-tokens", type=int_arg(1), default=256)
    parser.add_argument("--warmup", type=int_arg(0), default=1, help="prompts run untimed first")
    parser.add_argument("--remeasure", type=int_arg(0), default=2,
                        help="times a prompt is measured again when a burst of load hit one of its runs (0: never)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exit-threshold", type=float_arg(0.0, 1.0), default=None, help="accept-head early exit")
    parser.add_argument("--no-head", action="store_true", help="ignore saved accept heads")
    parser.add_argument("--relative-to", action="append", default=[], metavar="[METHOD=]BASE",
                        help="add Δ%% rows vs BASE: under every method, or under METHOD only (repeatable)")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF generate() baseline")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--out", default="runs/eval", help="output folder (new, empty, or an earlier eval's)")
    add_device_args(parser)
    add_report_to_arg(parser)  # the experiment trackers (vatspec/train/tracking.py)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (CheckpointError, DataError, TargetError, OutputError, ValueError) as e:
        return report("eval", e)


def _run(args: argparse.Namespace) -> int:
    if args.calibration and args.k != "auto":  # before any work: it would be read for nothing
        raise ValueError(f"--calibration is read only to choose k: pass --k auto with it, or drop it (--k {args.k})")
    if args.threads:
        torch.set_num_threads(args.threads)
    # the report folder first: new, empty or an earlier eval's, and apart from every input
    inputs = {f"--draft {s}": _parse_draft(s)[1] for s in args.draft}
    inputs.update({f"--prompts {f}": f for f in args.prompts})
    inputs.update({"--calibration": args.calibration, "--target": args.target if Path(args.target).exists() else None})
    check_apart(args.out, inputs, "--out")
    check_folder(args.out, "eval", "--out")
    target = open_target(args.target, device=args.device, dtype=args.dtype)
    print("\n".join(describe(target)), file=sys.stderr)  # refuses a target that cannot be verified, before any work
    template = use_template(target, args)
    methods = {}
    for spec in args.draft:
        name, path = _parse_draft(spec)
        if name in methods:
            raise ValueError(f"--draft: method name {name!r} given twice")
        drafter, head = open_draft(path, target)
        # a template that stamps a date: the day it was trained with
        template = pin_date(template, target.tokenizer, recorded_template(path))
        check_settings(recorded_template(path), template.settings(target.tokenizer), f"--draft {path}", "this eval")
        methods[name] = (drafter, None if args.no_head else head)
    relative = _relative_to(args.relative_to, list(methods))  # names checked before any decoding
    known = [*methods, AR, *([] if args.no_hf else [HF])]  # the baselines every eval measures too
    for base in (relative or {}).values():
        if base not in known:
            raise ValueError(f"--relative-to {base!r}: no such method (have {', '.join(known)})")
    if isinstance(args.k, int):
        if args.k == 0:
            raise ValueError("--k 0 drafts nothing (the autoregressive baseline is measured in every eval anyway); "
                             "give --k >= 1 or --k auto")
        for name, (drafter, _) in methods.items():
            most = getattr(drafter, "max_k", None)  # a DFlash draft: its block's slots
            if most is not None and args.k > most:
                raise ValueError(f"--k {args.k}: the {drafter.title} draft {name!r} fills at most {most} tokens a "
                                 "round")
    benches = args.bench or ([] if args.prompts else benchmarks.list_benchmarks())
    prompts = {b: benchmarks.load_benchmark(b) for b in benches}
    for f in args.prompts:
        prompts[Path(f).stem] = data.load_conversations(f, require_assistant=False)
    if args.num_prompts is not None:
        prompts = {b: ps[: args.num_prompts] for b, ps in prompts.items()}
    k, calibration = args.k, None
    if k == "auto":
        if not args.calibration:
            raise ValueError("--k auto needs --calibration FILE (held-out prompts)")
        convs = data.load_conversations(args.calibration, require_assistant=False)[: args.calibration_prompts]
        ids = [prompt_ids(target.tokenizer, c, template) for c in convs]
        scored = {tuple(prompt_ids(target.tokenizer, p, template)) for ps in prompts.values() for p in ps}
        if same := sum(tuple(i) in scored for i in ids):  # k chosen on the prompts it is scored on
            raise ValueError(f"--calibration {args.calibration}: {same} of its {len(ids)} prompts are among the "
                             "evaluation prompts; calibrate on held-out prompts")
        calibration = {name: calibrate(target, d, ids) for name, (d, _) in methods.items()}
        k = {name: c.k for name, c in calibration.items()}
    results = evaluate(
        target, methods, prompts, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
        warmup=args.warmup, seed=args.seed, exit_threshold=args.exit_threshold, k=k, top_k=args.top_k,
        top_p=args.top_p, draft_argmax=args.draft_argmax, hf_baseline=not args.no_hf,
        recheck=list(calibration or ()), remeasure=args.remeasure, template=template,
    )
    if calibration:
        results["calibration"] = {name: c.to_dict() for name, c in calibration.items()}
    results["config"]["drafts"] = dict(_parse_draft(s) for s in args.draft)
    claim_folder(args.out, "eval")
    paths = write_report(results, args.out, relative, plots=not args.no_plots)
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    if args.report_to:  # the report's table and plots, one tracked run named after --out
        from vatspec.train.tracking import log_report

        log_report(args.report_to, Path(args.out), [p for p in paths.values() if p.suffix in (".md", ".png")],
                   results["config"])
    return 0


def _k_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of drafted tokens or 'auto', got {text!r}") from None
    if k < 0:
        raise argparse.ArgumentTypeError(f"k must be >= 0, got {k}")
    return k


def _relative_to(specs: Sequence[str], methods: Sequence[str]) -> dict[str, str] | None:
    """``["BASE"]`` -> every other method vs BASE; ``["M=BASE", ...]`` -> M vs BASE; both may mix."""
    out: dict[str, str] = {}
    for spec in specs:
        method, sep, base = spec.rpartition("=")
        if sep:
            if method not in methods:
                raise ValueError(f"--relative-to {spec!r}: no method {method!r} (have {', '.join(methods)})")
            out[method] = base
        else:
            out.update({m: base for m in methods if m != base and m not in out})
    return out or None


def _parse_draft(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep:
        path = spec
        name = Path(spec.rstrip("/")).name
    if not name or not path:
        raise ValueError(f"--draft {spec!r}: expected NAME=PATH or PATH")
    return name, path
