"""``vatspec check``: any served draft folder (this project's exports or a peer trainer's) checked the
way the engines load it, and its greedy acceptance on held-out prompts next to training's
(``vatspec.eval.check``). Exit status 0 when every check passes, 1 when one fails, 2 on bad input.

    vatspec check served/eagle3-hf --target default [--prompts FILE] [--num-prompts 2]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from vatspec import benchmarks, data
from vatspec.commands import add_device_args, add_template_args, check_report_out, report, use_template
from vatspec.data import DataError
from vatspec.data.chat import format_kwargs, pin_date
from vatspec.eval.bench import prompt_ids
from vatspec.eval.check import check_draft
from vatspec.export.record import recorded_template
from vatspec.outputs import OutputError
from vatspec.target import TargetError, open_target
from vatspec.target.architecture import describe


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", help="a served draft folder (config.json + *.safetensors)")
    parser.add_argument("--target", required=True, help="a local HF folder, or 'default' (the embedded SmolLM2)")
    add_template_args(parser)
    parser.add_argument("--prompts", metavar="FILE", help="held-out prompts (JSONL conversations); "
                        "default: the bundled benchmarks")
    parser.add_argument("--num-prompts", type=int, default=2, help="prompts per benchmark (or of --prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--no-measure", action="store_true", help="conventions only: decode nothing")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    add_device_args(parser)


def run(args: argparse.Namespace) -> int:
    folder = Path(args.folder)
    if not (folder / "config.json").is_file():
        return report("check", ValueError(f"{folder}: no config.json (not a served draft folder)"))
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        return report("check", ValueError("--num-prompts and --max-new-tokens must be >= 1"))
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.json:
            check_report_out(Path(args.json), {"FOLDER": folder, "--prompts": args.prompts},  # never in FOLDER
                             lambda old: isinstance(old, dict) and {"folder", "format", "ok", "findings"} <= set(old),
                             "check report")
    except OutputError as e:
        return report("check", e)
    try:
        target = open_target(args.target, device=args.device, dtype=args.dtype)
        about = describe(target)  # a target whose cache cannot be taken back is refused here, before any work
        # the day it was trained with, for a template that stamps one
        template = pin_date(use_template(target, args), target.tokenizer, recorded_template(folder))
        prompts = None if args.no_measure else _prompts(args, target, template)
    except (TargetError, DataError) as e:
        return report("check", e)
    with torch.inference_mode():
        rep = check_draft(folder, target, prompts, max_new_tokens=args.max_new_tokens, template=template)
    print(f"vatspec check {folder} ({rep.format or 'unknown format'}) against {target.path}, chat template "
          f"arguments {format_kwargs(template.kwargs)}")
    print("\n".join(about))
    for f in rep.findings:
        print(f"  {'ok  ' if f.ok else 'FAIL'}  {f.what:<22} {f.detail}")
    if rep.measured:
        m = rep.measured
        print(f"served: {m['prompts']} held-out prompts, T=0, k={m['k']}, {m['max_new_tokens']} new tokens: "
              f"tau {m['tau']:.3f} over {m['rounds']} rounds; P(accept | reached) by position: "
              + " ".join(_p(x) for x in m["cond_accept"]))
    held = (rep.training or {}).get("heldout")
    if held:
        print(f"training (vatspec.json, step {held.get('step')}): held-out tau_sim {held['tau_sim']:.3f}; "
              "P(accept | reached) by position: " + " ".join(_p(x) for x in held.get("cond_acc") or []))
    elif rep.measured:
        print("training: no held-out record in the folder (vatspec.json): nothing to compare the acceptance with")
    failed = [f.what for f in rep.findings if not f.ok]
    print("verdict: " + ("OK" if not failed else f"FAIL ({', '.join(dict.fromkeys(failed))})"))
    if args.json:
        Path(args.json).write_text(json.dumps(rep.to_dict(), indent=2) + "\n")
    return 0 if not failed else 1


def _prompts(args: argparse.Namespace, target, template) -> list[list[int]]:
    if args.prompts:
        convs = data.load_conversations(args.prompts, require_assistant=False)[: args.num_prompts]
    else:
        convs = [c for b in benchmarks.list_benchmarks() for c in benchmarks.load_benchmark(b)[: args.num_prompts]]
    return [prompt_ids(target.tokenizer, c, template) for c in convs]


def _p(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"
