"""A drafter's baseline vs the same drafter + VAT, trained in lockstep (one shared target pass per
batch) for a few hundred steps on target-regenerated conversations: the longer CPU-sized runs
behind docs/results.md.

    .venv/bin/python scripts/long_run.py --drafter eagle3                     # 300 steps, ~30 min
    .venv/bin/python scripts/long_run.py --drafter dflash --prompts 512 --steps 600 --anchors 64  # ~1 h
    .venv/bin/python scripts/long_run.py --drafter eagle3 dflash --steps 450 --anchors 64   # 4 arms

Prints train and held-out tau_sim at every evaluation and the final metrics as JSON.
"""

import argparse
import json
import time
from pathlib import Path

from vatspec.demo import ARMS, DemoSize, arm_configs, prepare_training_data
from vatspec.target import Target, prepare_default_target, vatspec_home

KINDS = sorted({kind for kind, _ in ARMS.values()})


def log(arm, record) -> None:
    if "eval/tau_sim" in record:
        print(arm.name, record["step"], "train tau_sim", round(record["train/tau_sim"], 3),
              "held-out tau_sim", round(record["eval/tau_sim"], 3), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", nargs="+", choices=KINDS, default=["eagle3"],
                    help="one or both drafters; every arm shares each batch's target pass")
    ap.add_argument("--out", default=None, help="run folder (default runs/long-<drafters>)")
    ap.add_argument("--prompts", type=int, default=256, help="regenerated training conversations")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--anchors", type=int, default=DemoSize.anchors, help="DFlash anchors per sequence")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="extra config overrides for both arms, e.g. optim.lr=1e-3 drafter.num_layers=2")
    args = ap.parse_args()

    from vatspec.train import train_arms

    out = Path(args.out or f"runs/long-{'-'.join(args.drafter)}")
    size = DemoSize(prompts=args.prompts, steps=args.steps, eval_every=args.eval_every, batch_size=4,
                    max_length=192, anchors=args.anchors)
    target = Target.from_pretrained(prepare_default_target())
    t0 = time.time()
    data, info = prepare_training_data(target, size, vatspec_home(), progress=False)
    print("regenerated", info["new_tokens"], "new tokens in", round(time.time() - t0), "s", flush=True)
    overrides = {name: [f"drafter.kind={kind}", f"loss.kind={loss}", *args.set]
                 for name, (kind, loss) in ARMS.items() if kind in args.drafter}
    cfgs = arm_configs(list(overrides), size, data, out, loss_overrides=overrides)
    finals = train_arms(cfgs, target=target, progress=False, on_log=log)
    keys = ("tau_sim", "mean_first_reject", "post_reject_match", "acc")
    print(json.dumps({c.train.out_dir: {k: f[k] for k in keys} for c, f in zip(cfgs, finals)}, indent=1))
    print("total seconds", round(time.time() - t0))


if __name__ == "__main__":
    main()
