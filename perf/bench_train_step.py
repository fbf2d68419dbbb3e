"""Step time of VAT (and the other loss kinds) against the drafter's own baseline loss, side by side
in one process.

VAT changes only the loss, so its training step should cost about the same (goal: ratio <= 1.05).
Every arm sees the same batches, in an order rotated step by step after a warm-up (``timer.SideBySide``), on
the default target. Two ratios are printed per kind: the drafter step alone (forward + loss + backward +
optimiser, the part a loss can change) and the full step including the shared target forward.

    .venv/bin/python perf/bench_train_step.py --drafter eagle3 --steps 8
    .venv/bin/python perf/bench_train_step.py --drafter dflash --steps 8 --kinds vat,kl,tv,lk,dpace,specauf,dspark
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from timer import SideBySide

from vatspec import data as D
from vatspec.config import load_config
from vatspec.drafters import plan_batch
from vatspec.target import open_target
from vatspec.train import arm_step, build_arm, pad_id, shared_target_pass, step_generator, tokenize_items


def main() -> None:
    """The bench, top to bottom (flags, data, arms, interleaved timing, report): a script, read once in order."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="eagle3", choices=["eagle3", "dflash"])
    ap.add_argument("--data", help="conversations file (default: 32 bundled prompts answered by the target, "
                    "cached under $VATSPEC_HOME/demo like the demo's training set)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--kinds", default="vat", help="comma-separated loss kinds timed against the drafter's baseline")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    torch.manual_seed(0)
    target = open_target("default", device="cpu", dtype="float32")
    tmp = Path(tempfile.mkdtemp())
    if args.data:
        data = args.data
    else:
        from vatspec.outputs import vatspec_home
        from vatspec_recipes.experiment import prepare_training_data
        from vatspec_recipes.recipe import Size

        data = str(prepare_training_data(target, Size(prompts=32, regen_tokens=128), vatspec_home(), False)[0])
    baseline = args.drafter
    common = ["target.path=default", f"data.train={data}", f"data.batch_size={args.batch_size}",
              f"data.max_length={args.max_length}",
              f"drafter.kind={args.drafter}", f"drafter.draft_vocab_size={args.draft_vocab}",
              f"drafter.block_size={args.block_size}", f"drafter.num_anchors={args.anchors}"]
    kinds = [k for k in args.kinds.split(",") if k and k != baseline]
    cfgs = {k: load_config(None, [*common, f"loss.kind={k}", f"train.out_dir={tmp / k}"]) for k in (baseline, *kinds)}
    examples = tokenize_items(D.load_conversations(data), target.tokenizer, args.max_length, data)
    counts = D.token_counts(examples, target.vocab_size)
    total = args.steps + args.warmup
    arms = {k: build_arm(c, target, counts, total, device=target.device) for k, c in cfgs.items()}
    pad = pad_id(target)
    batches = [D.collate(examples[i : i + args.batch_size], pad)
               for i in range(0, args.batch_size * total, args.batch_size)]

    # the paths are the arms' drafter steps; "target" holds every arm's target forward
    t = SideBySide(list(arms), repeats=args.steps, warmup=args.warmup)
    for step, order in t.rounds():  # each arm in each slot alike
        batch = batches[step]
        for k in order:
            arm = arms[k]
            g = step_generator(0, step, 0, 0)
            plan = plan_batch(arm.drafter, batch, arm.cfg.drafter, g, with_logits=not arm.loss_cfg.chunk_size)
            with t.time("target"):
                tout = shared_target_pass(target, batch, [arm.drafter], [plan])[0]
            with t.time(k):
                arm.opt.zero_grad(set_to_none=True)
                res = arm_step(arm.model, arm.drafter, batch, tout, plan, arm.loss_cfg, g)
                res.loss.backward()
                torch.nn.utils.clip_grad_norm_(arm.params, arm.optim_cfg.grad_clip)
                arm.opt.step()
    drafter_t = {k: t.seconds[k] for k in arms}
    tokens = sum(int(b.attention_mask.sum()) for b in batches[args.warmup :])
    med = {k: t.median(k) for k in arms}
    tgt = t.median("target")
    ratio = {k: t.ratio(k, baseline) for k in kinds}
    out = {
        "drafter": args.drafter, "steps": args.steps, "batch_size": args.batch_size, "max_length": args.max_length,
        "drafter_step_s": med, "target_forward_s": tgt,
        "ratio_drafter_step": ratio,
        "ratio_full_step": {k: (med[k] + tgt) / (med[baseline] + tgt) for k in kinds},
        "train_tokens_per_s": {k: tokens / (sum(v) + tgt * len(v)) for k, v in drafter_t.items()},
        "threads": torch.get_num_threads(),
    }
    print(f"drafter={args.drafter} batch={args.batch_size}x{args.max_length} steps={args.steps} "
          f"(median seconds, interleaved)")
    print(f"  target forward          {tgt:.3f}s")
    for k in arms:
        print(f"  {k:>8} drafter step   {med[k]:.3f}s   tokens/s (full step) {out['train_tokens_per_s'][k]:.0f}")
    for k in kinds:
        print(f"  ratio {k}/{baseline}: drafter step {ratio[k]:.3f}, full step {out['ratio_full_step'][k]:.3f}"
              + ("  (goal <= 1.05)" if k == "vat" else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
