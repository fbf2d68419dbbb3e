"""Peak memory and step time of one training step at a large vocabulary: unchunked vs chunked lm_head + CE.

Memory: every ``loss.chunk_size`` runs one step in a fresh subprocess (peaks do not mix); its peak is
``ru_maxrss`` minus the RSS before the step (torch keeps no CPU allocator statistics). Time: one more
subprocess runs every chunk size, the order rotating step by step after a warm-up step each
(``timer.SideBySide``), so a machine shared with other work slows them alike; the median of ``--steps``
steps (target forward, drafter forward, verification, loss, backward, optimiser step: ``train.arm_step`` as
the loop runs it).
The target is a random Llama built in code: vocabulary 152k (Qwen3's), hidden 64, 8 layers; or
``--target PATH`` for a real one (then the data are random ids of its vocabulary too).

    .venv/bin/python perf/bench_vocab_memory.py --chunks 0 64 256 1024   # DFlash 512x16, EAGLE-3 k=7 @ 2048
    .venv/bin/python perf/bench_vocab_memory.py --target ~/.cache/vatspec/targets/gemma-3-270m \\
        --length 1024 --anchors 128 --chunks 0 64 256                        # after tools/gemma3_270m.py
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

VOCAB, HIDDEN, LAYERS = 151_936, 64, 8  # Qwen3's vocabulary; a tiny body so the vocabulary dominates


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def build(args):
    """The target and one step function per ``args.chunks`` value (same drafter init for each)."""
    import torch

    from vatspec.config import load_config
    from vatspec.data import Batch
    from vatspec.drafters import plan_batch
    from vatspec.target import Target, open_target
    from vatspec.train import arm_step, build_arm, shared_target_pass, step_generator

    torch.manual_seed(0)
    if args.target:
        target = open_target(args.target, device="cpu", dtype="float32")
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                          tie_word_embeddings=True)
        target = Target(LlamaForCausalLM(cfg).eval(), tokenizer=None)
    V, T = target.vocab_size, args.length
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (args.batch_size, T), generator=g)
    counts = torch.bincount(ids.view(-1), minlength=V)
    lm = torch.ones(args.batch_size, T, dtype=torch.bool)
    lm[:, :16] = False  # a short prompt
    batch = Batch(input_ids=ids, attention_mask=torch.ones(args.batch_size, T, dtype=torch.long), loss_mask=lm)

    def make_step(chunk: int):
        cfg = load_config(None, [
            f"drafter.kind={args.kind}", "loss.kind=vat", f"loss.chunk_size={chunk}",
            f"drafter.ttt_steps={args.ttt_steps}",
            f"drafter.block_size={args.block_size}", f"drafter.num_anchors={args.anchors}",
            f"drafter.draft_vocab_size={args.draft_vocab}", f"train.out_dir={tempfile.mkdtemp()}"])
        arm = build_arm(cfg, target, counts, 10, device=torch.device("cpu"))

        def step(i: int, timer=None) -> float:
            """Step ``i``; with a ``timer.SideBySide``, timed whole as ``str(chunk)`` and its drafter part
            (everything after the target pass) as ``f"{chunk} drafter"``. Returns the loss."""
            gen = step_generator(0, i, 0, 0)
            plan = plan_batch(arm.drafter, batch, cfg.drafter, gen, with_logits=not chunk)
            with timer.time(str(chunk)) if timer else nullcontext():
                tout = shared_target_pass(target, batch, [arm.drafter], [plan])[0]
                with timer.time(f"{chunk} drafter") if timer else nullcontext():
                    arm.opt.zero_grad(set_to_none=True)
                    res = arm_step(arm.model, arm.drafter, batch, tout, plan, arm.loss_cfg, gen)
                    res.loss.backward()
                    arm.opt.step()
            return float(res.loss)

        return step

    return target, {c: make_step(c) for c in args.chunks}


def measure_memory(args) -> dict:
    """Peak RSS of one step (``args.chunks`` holds one value) above the RSS before it."""
    import torch

    _, steps = build(args)
    (chunk, step), = steps.items()
    base = _rss_mib()
    loss = step(0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"kind": args.kind, "chunk": chunk, "peak_mib": peak - base, "maxrss_mib": peak, "loss": loss,
            "threads": torch.get_num_threads()}


def measure_time(args) -> dict:
    """Median step time of every chunk value, the order rotating step by step after one warm-up
    step each (``timer.SideBySide``), so a machine shared with other work slows them alike."""
    from timer import SideBySide

    _, steps = build(args)
    t = SideBySide([str(c) for c in steps], repeats=args.steps, warmup=1)
    for i, order in t.rounds():
        for c in order:
            steps[int(c)](i, t)
    return {"kind": args.kind, "step_s": {c: t.median(str(c)) for c in steps},
            "drafter_step_s": {c: t.median(f"{c} drafter") for c in steps}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["dflash", "eagle3"], help="one drafter (default: both)")
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 1024], help="loss.chunk_size values; 0 = unchunked")
    ap.add_argument("--target", help="a target folder (default: the random 152k-vocabulary Llama)")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--mode", choices=["memory", "time"], help=argparse.SUPPRESS)  # one subprocess
    ap.add_argument("--kind", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.mode:
        print(json.dumps(measure_memory(args) if args.mode == "memory" else measure_time(args)))
        return
    common = ["--length", str(args.length), "--batch-size", str(args.batch_size), "--anchors", str(args.anchors),
              "--block-size", str(args.block_size), "--ttt-steps", str(args.ttt_steps), "--draft-vocab",
              str(args.draft_vocab), "--steps", str(args.steps)] + (["--target", args.target] if args.target else [])

    def sub(mode: str, kind: str, chunks: list[int]) -> dict | None:
        cmd = [sys.executable, __file__, "--mode", mode, "--kind", kind, "--chunks", *map(str, chunks), *common]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            tail = (p.stderr.strip().splitlines() or ["?"])[-1]
            print(f"{kind} {mode} chunks={chunks}: failed (exit {p.returncode}: {tail})", flush=True)
            return None
        return json.loads(p.stdout.strip().splitlines()[-1])

    rows = []
    for kind in [args.only] if args.only else ["dflash", "eagle3"]:
        mem = {}
        for c in args.chunks:
            r = sub("memory", kind, [c])
            mem[c] = r["peak_mib"] if r else None
            if r:
                print(f"{kind:>6} chunk={c:<5} peak {r['peak_mib']:8.0f} MiB (maxrss {r['maxrss_mib']:.0f})",
                      flush=True)
        tm = sub("time", kind, args.chunks) if args.steps else None
        for c in args.chunks:
            rows.append({"kind": kind, "chunk": c, "peak_mib": mem[c],
                         "step_s": tm["step_s"][str(c)] if tm else None,
                         "drafter_step_s": tm["drafter_step_s"][str(c)] if tm else None})
    what = f"target {args.target or f'random Llama V={VOCAB} H={HIDDEN}'}, batch {args.batch_size}x{args.length}"
    print(f"\n{what}; DFlash {args.anchors} anchors x block {args.block_size}, EAGLE-3 k={args.ttt_steps} "
          f"draft vocab {args.draft_vocab}; peak = max RSS of one step above the RSS before it; step times are "
          f"medians of {args.steps} steps, variants alternating in one process")
    print(f"{'drafter':>7} {'chunk':>6} {'peak MiB':>9} {'vs unchunked':>13} {'step s':>7} {'ratio':>6} "
          f"{'drafter s':>9} {'ratio':>6}")

    def fmt(x, f):
        return format(x, f) if x is not None else "-"

    for r in rows:
        base = next((b for b in rows if b["kind"] == r["kind"] and b["chunk"] == 0), None)
        lower = ratio = dratio = ""
        if base and r is not base:
            if base["peak_mib"] and r["peak_mib"]:
                lower = f"{base['peak_mib'] / r['peak_mib']:.1f}x lower"
            if base["step_s"] and r["step_s"]:
                ratio = f"{r['step_s'] / base['step_s']:.2f}"
                dratio = f"{r['drafter_step_s'] / base['drafter_step_s']:.2f}"
        print(f"{r['kind']:>7} {r['chunk']:>6} {fmt(r['peak_mib'], '9.0f')} {lower:>13} {fmt(r['step_s'], '7.2f')} "
              f"{ratio:>6} {fmt(r['drafter_step_s'], '9.2f')} {dratio:>6}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
