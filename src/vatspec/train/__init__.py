"""Training, in parts:

    data.py          conversations -> rendered, split, tokenized (or feature-cache rows), batched: ``TrainData``
    arms.py          one drafter being trained (``build_arm``) and its step (``arm_step``, ``arms_micro_step``)
    loop.py          the loop over arms in lockstep (``train``, ``train_arms``)
    checkpointer.py  the run folders: one writer, resume, checkpoints, metrics (``Checkpointer``)
    dist.py          torchrun's process group and averaged metrics
    optim.py         the optimizer (``optim.kind``): AdamW, or Muon with AdamW (``build_optimizer``)
    tracking.py      experiment trackers: TensorBoard, W&B, Trackio, MLflow (``open_trackers``)
    errors.py        the one error training raises for bad input (``TrainError``)

    cfg = load_config("run.yaml", ["drafter=eagle3", "loss=vat", "train.steps=200"])
    metrics = train(cfg)            # `vatspec train --config run.yaml drafter=eagle3 loss=vat ...`
    train(cfg, resume=True)         # `... --resume`: continue the run in cfg.train.out_dir
"""

from vatspec.train.arms import (
    CHAINS_KEY,
    Arm,
    StepResult,
    TrainModule,
    arm_step,
    arms_micro_step,
    build_arm,
    evaluate_arms,
    lr_lambda,
    reference_optim,
    shared_target_pass,
    step_generator,
)
from vatspec.train.checkpointer import Checkpointer, config_changes, finished, save_interval
from vatspec.train.data import MIN_SUPERVISED, TrainData, heldout_split, load_training_data, pad_id, tokenize_items
from vatspec.train.errors import TrainError
from vatspec.train.loop import lockstep_key, train, train_arms

__all__ = [
    "CHAINS_KEY", "MIN_SUPERVISED", "Arm", "Checkpointer", "StepResult", "TrainData", "TrainError",
    "TrainModule", "arm_step", "arms_micro_step", "build_arm", "config_changes", "evaluate_arms", "finished",
    "heldout_split", "load_training_data", "lockstep_key", "lr_lambda", "pad_id", "reference_optim", "save_interval",
    "shared_target_pass", "step_generator", "tokenize_items", "train", "train_arms",
]
