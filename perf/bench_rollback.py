"""What taking the cache back costs per verify round (``vatspec.target.rollback``), beside a plain crop.

Random-weight targets of one size, built from transformers' own config classes: a plain Llama (every layer cut
by ``crop``), a gated delta-net hybrid (Qwen3-Next layout: 3 linear-attention layers to 1 attention), a Mamba
hybrid (Nemotron-H layout) and a sliding-window target (gpt-oss layout, window 32, so the window slides). Each
decodes the same prompt with a drafter whose rounds accept 0..k drafts in turn, so most rounds roll back; the
hybrids and the windowed target once by ``record`` (the default: per-token states recorded during the pass) and
once by ``replay`` (a copy of the forgetting layers before the pass, restored and the accepted tokens run again).
The paths run interleaved (``timer.SideBySide``). Printed per path: the verify round's median (the target pass,
acceptance and the rollback) in ms, the rollback's own part (``before`` + ``drop``), and each round's ratio to
the plain Llama's crop round of the same size.

    .venv/bin/python perf/bench_rollback.py                         # hidden 256, 8 layers, 48 new tokens
    .venv/bin/python perf/bench_rollback.py --hidden 576 --layers 12 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from timer import SideBySide

from vatspec.drafters.sampling import Proposal
from vatspec.eval.decode import generate
from vatspec.target import Target
from vatspec.target.rollback import Rollback


class _Tokenizer:
    eos_token_id = None


def build(kind: str, hidden: int, layers: int, vocab: int, seed: int = 0) -> Target:
    import transformers as tf

    torch.manual_seed(seed)
    heads = max(4, hidden // 64)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=hidden // heads)
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif kind == "qwen3_next":
        types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * (layers // 4)
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
            **common, layer_types=types, linear_num_value_heads=heads, linear_num_key_heads=max(1, heads // 2),
            linear_key_head_dim=hidden // heads, linear_value_head_dim=hidden // heads, num_experts=0,
            decoder_sparse_step=1, mlp_only_layers=list(range(layers))))
    elif kind == "nemotron_h":
        pattern = ("M-M*" * layers)[:layers]
        model = tf.NemotronHForCausalLM(tf.NemotronHConfig(
            **common, hybrid_override_pattern=pattern, mamba_num_heads=heads, mamba_head_dim=hidden // heads,
            ssm_state_size=64, n_groups=1))
    elif kind == "sliding":
        model = tf.GptOssForCausalLM(tf.GptOssConfig(
            **common, layer_types=["sliding_attention", "full_attention"] * (layers // 2), sliding_window=32,
            num_local_experts=2, num_experts_per_tok=1))
    else:
        raise ValueError(kind)
    target = Target(model.eval(), _Tokenizer())
    target.model.generation_config.eos_token_id = None
    return target


class Rejecting:
    """Drafts k tokens of which round r's first ``r % (k + 1)`` are the target's greedy ones (known in advance):
    every depth of rejection in turn, and a whole accepted block once in k + 1 rounds."""

    target_layer_ids = (0,)

    def __init__(self, reference: list[int], prompt_len: int, k: int, vocab: int):
        self.ref, self.P, self.k, self.vocab = reference, prompt_len, k, vocab

    def new_session(self, **_):
        self.done, self.r = 0, 0
        return self

    def extend(self, features, tokens):
        self.done += tokens.shape[0]

    def propose(self, k, **_):
        good = self.r % (self.k + 1)
        self.r += 1
        start = self.done + 1
        toks = [self.ref[min(start + j, len(self.ref) - 1)] for j in range(k)]
        if good < k:
            toks[good] = (toks[good] + 1) % self.vocab
        return Proposal(torch.tensor(toks))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (past the 32-token window)")
    ap.add_argument("--new", type=int, default=48, help="new tokens per decode")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    prompt = torch.randint(0, args.vocab, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    targets = {kind: build(kind, args.hidden, args.layers, args.vocab) for kind in
               ("llama", "qwen3_next", "nemotron_h", "sliding")}
    refs = {kind: generate(t, prompt, None, max_new_tokens=args.new).tokens for kind, t in targets.items()}
    paths = {"llama crop": ("llama", None)}
    for kind in ("qwen3_next", "nemotron_h", "sliding"):
        paths[f"{kind} record"] = (kind, "record")
        paths[f"{kind} replay"] = (kind, "replay")

    parts: dict[str, list[float]] = {p: [] for p in paths}
    rounds: dict[str, list[float]] = {p: [] for p in paths}
    current = [None]
    before, drop = Rollback.before, Rollback.drop

    def timed(fn):
        def wrapper(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **k)
            finally:
                parts[current[0]].append(time.perf_counter() - t0)
        return wrapper

    Rollback.before, Rollback.drop = timed(before), timed(drop)

    def run(path: str):
        kind, mode = paths[path]
        current[0] = path
        target, ref = targets[kind], refs[kind]
        drafter = Rejecting(prompt + ref, len(prompt), args.k, args.vocab)
        out = generate(target, prompt, drafter, k=args.k, max_new_tokens=args.new, rollback=mode)
        assert out.tokens == ref, f"{path}: not the target's greedy output"
        rounds[path].extend(r.verify_s for r in out.rounds)
        return len(out.rounds)

    timer = SideBySide(list(paths), repeats=args.repeats, warmup=1)
    for _, order in timer.rounds():
        for path in order:
            with timer.time(path):
                n = run(path)
    base = statistics.median(rounds["llama crop"])
    print(f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, prompt {args.prompt} + {args.new} new "
          f"tokens, k = {args.k}, {n} rounds a decode, {args.repeats} repeats; torch threads "
          f"{torch.get_num_threads()}; every decode equals the target's greedy output")
    print(f"{'path':<20} {'verify round ms':>16} {'rollback ms':>12} {'rollback %':>11} {'round / llama crop':>19}")
    for path in paths:
        v = statistics.median(rounds[path])
        # before + drop per round: two timings a round
        per_round = sum(parts[path]) / max(1, len(rounds[path]))
        print(f"{path:<20} {1e3 * v:>16.2f} {1e3 * per_round:>12.3f} {100 * per_round / v:>10.1f}% {v / base:>18.2f}x")
    Rollback.before, Rollback.drop = before, drop
    print()
    recording_cost(targets, prompt, args)
    return 0


def recording_cost(targets: dict, prompt: list[int], args) -> None:
    """The pass itself: a verify pass of k + 1 tokens with recording on (per-token states kept) and off, on the
    same context, interleaved; the recorded pass is then cropped, the other restored from a copy (untimed)."""
    import copy

    x = torch.tensor([prompt[: args.k + 1]])
    print(f"{'verify pass of k+1':<20} {'recording off ms':>16} {'on ms':>8} {'on / off':>9}")
    for kind in ("qwen3_next", "nemotron_h", "sliding"):
        target = targets[kind]
        caches = {}
        for on in (False, True):
            caches[on] = target(torch.tensor([prompt]), logits=False, use_cache=True).past_key_values
            if on:
                Rollback(target, caches[on], most_fed=args.k + 1, mode="record")
        timer = SideBySide(["off", "on"], repeats=20 * args.repeats, warmup=2)
        for _, order in timer.rounds():
            for path in order:
                cache = caches[path == "on"]
                saved = copy.deepcopy(cache) if path == "off" else None
                with timer.time(path):
                    target(x, past_key_values=cache, use_cache=True)
                if saved is not None:
                    caches[False] = saved
                else:
                    cache.crop(-x.shape[1])
        off, on = timer.median("off"), timer.median("on")
        print(f"{kind:<20} {1e3 * off:>16.2f} {1e3 * on:>8.2f} {on / off:>8.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
