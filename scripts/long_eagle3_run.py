"""EAGLE-3 baseline vs EAGLE-3 + VAT, trained in lockstep for 300 steps on 256 target-regenerated
conversations: the longer CPU-sized run behind docs/results.md (about 30 minutes on 2 cores).

    .venv/bin/python scripts/long_eagle3_run.py [OUT_DIR]
"""

import json
import sys
import time
from pathlib import Path

from vatspec.demo import DemoSize, arm_configs, prepare_training_data
from vatspec.target import Target, prepare_default_target, vatspec_home
from vatspec.train import train_arms


def log(arm, record) -> None:
    if "eval/tau_sim" in record:
        print(arm.name, record["step"], "train tau_sim", round(record["train/tau_sim"], 3),
              "held-out tau_sim", round(record["eval/tau_sim"], 3), flush=True)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/long-eagle3")
    size = DemoSize(prompts=256, steps=300, eval_every=50, batch_size=4, max_length=192)
    target = Target.from_pretrained(prepare_default_target())
    t0 = time.time()
    data, info = prepare_training_data(target, size, vatspec_home(), progress=False)
    print("regenerated", info["new_tokens"], "new tokens in", round(time.time() - t0), "s", flush=True)
    cfgs = arm_configs(["EAGLE-3", "EAGLE-3 + VAT"], size, data, out)
    finals = train_arms(cfgs, target=target, progress=False, on_log=log)
    keys = ("tau_sim", "mean_first_reject", "post_reject_match", "acc")
    print(json.dumps({c.train.out_dir: {k: f[k] for k in keys} for c, f in zip(cfgs, finals)}, indent=1))
    print("total seconds", round(time.time() - t0))


if __name__ == "__main__":
    main()
