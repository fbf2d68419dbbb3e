"""Lockstep pilot: several named arms (each its own config overrides) trained on the same batches,
sharing one target pass per batch; prints held-out tau_sim and per-step accuracy at each evaluation.

    .venv/bin/python scripts/pilot_arms.py OUT STEPS EVAL_EVERY "COMMON OVERRIDES" NAME="OVERRIDES" ...
    .venv/bin/python scripts/pilot_arms.py runs/pilot 50 25 \\
        "data.train=train.jsonl data.heldout=held.jsonl data.batch_size=4 data.max_length=192" \\
        "ref=drafter.kind=eagle3 loss.kind=eagle3 optim.lr=1e-3 drafter.ttt_steps=7" \\
        "best=drafter.kind=eagle3 loss.kind=eagle3 optim.lr=3e-3 drafter.ttt_steps=3"

The lever table in docs/results.md was measured this way (one torch thread; ``PILOT_THREADS=N``
for N). Writes OUT/<name>/ run folders, OUT/cmd.txt and OUT/summary.json.
"""

import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from vatspec.config import load_config
from vatspec.target import open_target
from vatspec.train import CHAINS_KEY, train_arms


def main() -> None:
    if len(sys.argv) < 6:
        raise SystemExit(__doc__)
    torch.set_num_threads(int(os.environ.get("PILOT_THREADS", "1")))
    out, steps, every = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    common = ["target.path=default", *shlex.split(sys.argv[4])]  # the embedded target unless COMMON names one
    arms = [(name, shlex.split(ov)) for name, _, ov in (a.partition("=") for a in sys.argv[5:])]
    out.mkdir(parents=True, exist_ok=True)
    (out / "cmd.txt").write_text(" ".join(shlex.quote(x) for x in sys.argv) + "\n")
    cfgs = [load_config(None, [*common, f"train.steps={steps}", f"train.eval_every={every}",
                               "train.keep_checkpoints=1", *ov, f"train.out_dir={out / name}"]) for name, ov in arms]
    target = open_target(cfgs[0].target.path, device="cpu", dtype="float32")
    t0 = time.time()

    def on_log(arm, r) -> None:
        if "eval/tau_sim" in r:
            acc = " ".join(f"{x:.2f}" for x in r.get("eval/acc") or [])
            print(f"{Path(arm.cfg.train.out_dir).name:>14} step {r['step']:4d} t={time.time() - t0:6.0f}s "
                  f"held-out tau_sim {r['eval/tau_sim']:.3f} acc {acc}", flush=True)

    finals = train_arms(cfgs, target=target, progress=False, on_log=on_log)
    secs = time.time() - t0
    for f in finals:
        f.pop(CHAINS_KEY, None)
    summary = {"seconds": secs, "s_per_step": secs / steps, "arms": {n: f for (n, _), f in zip(arms, finals)}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    print(f"total {secs:.0f} s, {secs / steps:.2f} s/step (evaluation included)")


if __name__ == "__main__":
    main()
