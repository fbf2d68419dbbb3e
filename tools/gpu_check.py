"""The one GPU check: real-scale shapes on one GPU, no network, nothing but this repository.

    PYTHONPATH=src python3 tools/gpu_check.py --out gpu_check.json      # tools/gpu_check.sh runs this
    PYTHONPATH=src python3 tools/gpu_check.py --small --device cpu      # the same code on tiny shapes

For each target built in code with random weights (a Llama-3-8B-shaped one, vocab 128256, and a
Qwen3-8B-shaped one, vocab 151936; bf16 on the GPU), it trains EAGLE-3 and DFlash, each with its
baseline loss and with VAT, for ``--steps`` steps through the training step the trainer runs
(``vatspec.train.arm_step`` after one shared target pass), with bf16 autocast and float32 weights
and optimizer state (``train.precision=bf16``) and the demo's optimizer (``--optim muon``). Per arm
it prints step time, tokens/s and peak GPU memory, and the VAT / baseline step-time ratio per drafter.
Then it decodes a few random prompts greedily with each trained VAT draft, first with the bf16
target (reported: where the output parts from Hugging Face ``generate``, and by how many bf16
spacings the two tokens' logits differ there), then with the target cast to float32, where the
output must equal ``generate`` token for token (lossless). One JSON holds everything; the exit
status is 0 when every loss is finite, every float32 decode is equal and no arm failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from vatspec.config import OptimConfig, load_config
from vatspec.data.batching import Batch
from vatspec.drafters import build_drafter, plan_batch
from vatspec.eval.decode import generate
from vatspec.features.format import atomic_write
from vatspec.target import Target
from vatspec.target.precision import precision_context
from vatspec.train import TrainModule, arm_step, shared_target_pass, step_generator
from vatspec.train.optim import build_optimizer

# (name, transformers config class, fields): the published 8B geometries; weights are random
TARGETS = {
    "llama3-8b-shaped": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)),
    "qwen3-8b-shaped": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, max_position_embeddings=8192, rms_norm_eps=1e-6)),
}
SMALL = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
# (drafter kind, the loss of its paper, sequence length, drafter overrides)
ARMS = {
    "eagle3": ("eagle3", ["drafter.ttt_steps=7", "drafter.draft_vocab_size=32000"]),
    "dflash": ("dflash", ["drafter.block_size=16", "drafter.num_anchors=256", "drafter.num_layers=5"]),
}


def build_target(name: str, device: torch.device, dtype: torch.dtype, small: bool) -> Target:
    import transformers
    from transformers import AutoModelForCausalLM

    cls_name, fields = TARGETS[name]
    if small:
        fields = {**fields, **SMALL}
    cfg = getattr(transformers, cls_name)(**fields, tie_word_embeddings=False, bos_token_id=1, eos_token_id=None,
                                          pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.generation_config.eos_token_id = None  # random weights: decode the full length
    model.generation_config.pad_token_id = 0
    return Target(model, tokenizer=None)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_arm(target: Target, kind: str, loss: str, args, device: torch.device) -> dict:
    """``args.steps`` timed steps (after ``args.warmup``) of one arm on random token batches."""
    small_vocab = ["drafter.draft_vocab_size=1024"] if args.small and kind == "eagle3" else []
    small_dflash = ["drafter.num_anchors=16", "drafter.num_layers=1"] if args.small and kind == "dflash" else []
    cfg = load_config(None, [f"drafter.kind={kind}", f"loss.kind={loss}", *ARMS[kind][1], *small_vocab,
                             *small_dflash])
    torch.manual_seed(cfg.train.seed)
    drafter = build_drafter(cfg.drafter, target).to(device)
    head = None
    if cfg.loss.head:
        from vatspec.drafters.base import AcceptHead

        head = AcceptHead(drafter.hidden_size).to(device)
    module = TrainModule(drafter, head).train()
    opt = build_optimizer(module, OptimConfig(kind=args.optim, lr=1e-4), args.precision)
    B, T = args.batch_size, args.seq_len
    g = torch.Generator().manual_seed(0)
    autocast = precision_context(device, args.precision)  # what train.precision=bf16 runs
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(3, target.vocab_size, (B, T), generator=g).to(device)
        batch = Batch(ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))
        gen = step_generator(cfg.train.seed, step, 0, 0, device)
        sync(device)
        t0 = time.perf_counter()
        with autocast:
            plan = plan_batch(drafter, batch, cfg.drafter, gen, with_logits=not cfg.loss.chunk_size)
            tout = shared_target_pass(target, batch, [drafter], [plan])[0]
            res = arm_step(module, drafter, batch, tout, plan, cfg.loss, gen)
        res.loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(res.loss.detach()))
    step_s = sorted(times)[len(times) // 2]
    out = {"kind": kind, "loss": loss, "batch": [B, T], "chunk_size": cfg.loss.chunk_size,
           "step_s_median": step_s, "tokens_per_s": B * T / step_s,
           "losses": losses, "finite": all(torch.isfinite(torch.tensor(losses)).tolist()),
           "draft_params_m": sum(p.numel() for p in module.parameters()) / 1e6}
    if device.type == "cuda":
        out["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    out["_drafter"] = drafter.eval()
    return out


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 numbers (8 significant bits) at magnitude ``x``."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 2.0**-126))) - 7)


def decode_check(target: Target, drafter, args, device: torch.device) -> dict:
    """Greedy speculative decoding vs HF generate on random prompts, in the target's current dtype.

    In float32 the tokens must be equal (lossless). In bf16 they need not be: verification scores
    k + 1 positions in one forward, generate one at a time, and the two kernels round differently, so
    a near-tie between the top two logits can flip; random-weight targets have many. Each divergence
    is reported with the target's own logits there (a teacher-forced forward of the prompt and the
    shared prefix): the gap between the two chosen tokens, in bf16 spacings at the top logit's
    magnitude, shows whether it is a tie."""
    g = torch.Generator().manual_seed(1)
    equal, n = 0, args.decode_prompts
    taus, divergences = [], []
    for j in range(n):
        prompt = torch.randint(3, target.vocab_size, (1, 24), generator=g).to(device)
        with torch.no_grad():
            hf = target.model.generate(prompt, max_new_tokens=args.decode_tokens, do_sample=False,
                                       attention_mask=torch.ones_like(prompt))[0, prompt.shape[1]:].tolist()
        ours = generate(target, prompt[0], drafter, max_new_tokens=args.decode_tokens)
        equal += ours.tokens == hf
        taus.append(ours.tau)
        at = next((i for i, (a, b) in enumerate(zip(hf, ours.tokens)) if a != b), None)
        if at is not None:
            prefix = torch.cat([prompt[0], torch.tensor(hf[:at], dtype=torch.long, device=device)])
            with torch.no_grad():
                logits = target.model(prefix[None]).logits[0, -1].float()
            a, b = hf[at], ours.tokens[at]
            gap, top = float(logits[a] - logits[b]), float(logits.max())
            divergences.append({"prompt": j, "at": at, "hf_token": a, "ours_token": b, "logit_gap": gap,
                                "top_logit": top, "top2_gap": float(logits.topk(2).values.diff().abs()),
                                "gap_in_bf16_ulps": abs(gap) / bf16_ulp(top)})
    return {"dtype": str(target.dtype).removeprefix("torch."), "prompts": n, "equal_to_hf_generate": equal,
            "tau": sum(taus) / n, "divergences": divergences}


def write_report(out: Path, report: dict, t_start: float) -> None:
    report["wall_s"] = time.perf_counter() - t_start
    atomic_write(out, (json.dumps(report, indent=2) + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    """The check, top to bottom (flags, then each target shape's steps, then the JSON): one script, read in order
    on the GPU machine, where a failure's traceback must point at the step that failed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test of the same code)")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--precision", choices=["bf16", "fp32"], default=None, help="default: bf16 on a GPU")
    p.add_argument("--optim", choices=["adamw", "muon"], default="muon", help="optim.kind (default: the demo's)")
    p.add_argument("--decode-prompts", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=48)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    args.precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    if args.small:
        args.seq_len = min(args.seq_len, 96)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
              "torch": torch.__version__, "precision": args.precision, "optim": args.optim, "small": args.small,
              "targets": {}}
    t_start = time.perf_counter()
    out = Path(args.out)
    for name in args.targets.split(","):
        target_dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
        t0 = time.perf_counter()
        res: dict = {"arms": {}, "errors": {}}
        report["targets"][name] = res
        try:
            target = build_target(name, device, target_dtype, args.small)
            sync(device)
        except Exception as e:  # noqa: BLE001 - reported in the JSON and the exit status
            res["errors"]["build"] = traceback.format_exc()
            print(f"{name}: build FAILED {type(e).__name__}: {e}", flush=True)
            continue
        res.update(vocab_size=target.vocab_size, layers=target.num_layers, build_s=time.perf_counter() - t0)
        drafters = {}  # the trained VAT drafters, decoded once every arm has trained
        for kind, (baseline, _) in ARMS.items():
            for loss in (baseline, "vat"):
                # one arm's failure is recorded and the others still run: the check gets one go on a lent machine
                try:
                    arm = train_arm(target, kind, loss, args, device)
                except Exception as e:  # noqa: BLE001 - reported in the JSON and the exit status
                    res["errors"][f"{kind}/{loss}"] = traceback.format_exc()
                    print(f"{name} {kind}/{loss}: FAILED {type(e).__name__}: {e}", flush=True)
                    continue
                finally:
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                drafter = arm.pop("_drafter")
                if loss == "vat":  # parked on the CPU so the next arms' peak memory is theirs alone
                    drafters[f"{kind}/{loss}"] = drafter.cpu()
                del drafter
                res["arms"][f"{kind}/{loss}"] = arm
                print(f"{name} {kind}/{loss}: step {arm['step_s_median'] * 1e3:.1f} ms, "
                      f"{arm['tokens_per_s']:.0f} tok/s, peak {arm.get('peak_gpu_mem_gib', float('nan')):.1f} GiB, "
                      f"finite losses {arm['finite']}", flush=True)
                write_report(out, report, t_start)  # what has run so far survives a timeout
            a = res["arms"]
            if f"{kind}/vat" in a and f"{kind}/{baseline}" in a:
                ratio = a[f"{kind}/vat"]["step_s_median"] / a[f"{kind}/{baseline}"]["step_s_median"]
                res[f"{kind}_vat_over_baseline_step_time"] = ratio
                print(f"{name} {kind}: VAT / baseline step time {ratio:.3f}")
        # decoding: in the training dtype (bf16 on a GPU: equality is not expected, see decode_check),
        # then with the target and the drafts in float32, where it must hold exactly
        passes = [("decode", None)] + ([("decode_fp32", torch.float32)] if target.dtype != torch.float32 else [])
        for key, dtype in passes:
            if dtype is not None:
                target.model.to(dtype)
            for arm_name, drafter in drafters.items():
                try:
                    d = decode_check(target, drafter.to(device), args, device)  # float32 draft weights, as trained
                except Exception as e:  # noqa: BLE001 - reported in the JSON and the exit status
                    res["errors"][f"{arm_name}/{key}"] = traceback.format_exc()
                    print(f"{name} {arm_name} {key}: FAILED {type(e).__name__}: {e}", flush=True)
                    continue
                res["arms"][arm_name][key] = d
                gaps = ", ".join(f"{x['gap_in_bf16_ulps']:.1f}" for x in d["divergences"])
                gaps = f"; where they part, the logits differ by {gaps} bf16 spacings" if gaps else ""
                print(f"{name} {arm_name}: {d['dtype']} decode equal to HF generate {d['equal_to_hf_generate']}/"
                      f"{d['prompts']}{gaps}", flush=True)
                write_report(out, report, t_start)
        del drafters
        del target
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_report(out, report, t_start)
    print(f"wrote {args.out} ({report['wall_s']:.0f} s)")
    arms = [arm for t in report["targets"].values() for arm in t["arms"].values()]
    # lossless: every float32 decode equals HF generate (the training-dtype decode when that is float32)
    exact = [a.get("decode_fp32", a.get("decode")) for a in arms]
    exact = [d for d in exact if d is not None and d["dtype"] == "float32"]
    lossless = bool(exact) and all(d["equal_to_hf_generate"] == d["prompts"] for d in exact)
    ok = lossless and all(a["finite"] for a in arms) and not any(t["errors"] for t in report["targets"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
