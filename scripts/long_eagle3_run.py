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

size = DemoSize(prompts=256, steps=300, eval_every=50, batch_size=4, max_length=192)
target = Target.from_pretrained(prepare_default_target())
t0 = time.time()
data, info = prepare_training_data(target, size, vatspec_home(), progress=False)
print("data", info["new_tokens"], round(time.time() - t0), flush=True)
out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/long-eagle3")
cfgs = arm_configs(["EAGLE-3", "EAGLE-3 + VAT"], size, data, out)
finals = train_arms(cfgs, target=target, progress=False,
                    on_log=lambda a, r: print(a.name, r["step"], round(r["train/tau_sim"], 3), r.get("eval/tau_sim"), flush=True) if "eval/tau_sim" in r else None)
print(json.dumps({c.train.out_dir: {k: f[k] for k in ("tau_sim", "mean_first_reject", "post_reject_match", "acc")} for c, f in zip(cfgs, finals)}, indent=1))
print("total", round(time.time() - t0))
